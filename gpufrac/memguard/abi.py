"""The memguard config and usage files (native/memguard_abi.h), for the agent.

One definition: the C header is the source of truth, these ctypes structures
mirror it, and tests/memguard/test_abi.py proves they match offset for offset.

The agent is the only writer of `config` (the container mounts it read-only);
it updates in place under the seqlock so the shim never sees a torn limit.
The shim is the writer of `usage`; the agent reads it and reaps dead slots. Over 500 lines:
every file the agent and the shim share is mirrored here, so that one test holds all of them
to the C header.
"""

from __future__ import annotations

import ctypes
import itertools
import mmap
import os
import stat
import struct as _struct
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from gpufrac.core import flags as _flags
from gpufrac.core import units as _units

CONFIG_MAGIC = 0x3147464347464D47
USAGE_MAGIC = 0x3147534547464D47
COMPUTE_MAGIC = 0x3150434347464D47
ABI_VERSION = 1
MAX_PROCS = 256

# The least arbiter_timeout_ms the agent writes (gpufrac.core.config refuses less); the shim
# reads a smaller one as this (memguard_abi.h MG_MIN_ARBITER_TIMEOUT_MS).
MIN_ARBITER_TIMEOUT_MS = _units.MIN_ARBITER_TIMEOUT_MS

CONFIG_FILE = "config"
USAGE_FILE = "usage"
COMPUTE_FILE = "compute"  # the shim's launch clock while a compute share paces the container
# The container's arbiter socket sits alone in a directory of its host directory that the
# device plugin mounts (read-only) at SOCKET_DIR: a directory mount shows the socket a
# restarted agent binds anew, a mount of the socket file keeps the dead one (memguard_abi.h).
# An older agent mounted the file at SOCKET_FILE; gpufrac.memguard.wire.socket_path falls
# back to it, as the shim does.
SOCKET_DIR = "arbiter"
SOCKET_FILE = "arbiter.sock"
DEFAULT_DIR = "/var/run/gpufrac"

# The flag bits and class numbers are part of this ABI; the policy in gpufrac.core speaks them
# too, so they are defined there (gpufrac.core.flags) and named here with the files' other fields.
FLAG_POD_KNOWN = _flags.FLAG_POD_KNOWN
FLAG_PREEMPTIBLE = _flags.FLAG_PREEMPTIBLE
FLAG_SWAPPABLE = _flags.FLAG_SWAPPABLE
FLAG_WHOLE_GPU = _flags.FLAG_WHOLE_GPU
FLAG_DISABLED = _flags.FLAG_DISABLED
CLASS_BATCH = _flags.CLASS_BATCH
CLASS_INTERACTIVE = _flags.CLASS_INTERACTIVE
CLASS_INFERENCE = _flags.CLASS_INFERENCE
CLASS_NAMES = _flags.CLASS_NAMES
CLASS_BY_NUMBER = _flags.CLASS_BY_NUMBER


u32, u64, i32 = ctypes.c_uint32, ctypes.c_uint64, ctypes.c_int32


class ConfigStruct(ctypes.Structure):
    _fields_ = [
        ("magic", u64),
        ("abi_version", u32),
        ("file_size", u32),
        ("seq", u64),
        ("generation", u64),
        ("gpu_uuid", ctypes.c_char * 80),
        ("request_bytes", u64),
        ("limit_bytes", u64),
        ("grant_bytes", u64),
        ("flags", u32),
        ("workload_class", u32),
        ("arbiter_timeout_ms", u32),
        ("wait_timeout_ms", u32),
        ("priority", i32),
        ("compute_pace_ns", u32),  # agent-written outside the seqlock: ConfigFile.set_pace
        ("namespace_", ctypes.c_char * 64),
        ("pod", ctypes.c_char * 128),
        ("container", ctypes.c_char * 64),
        ("pod_uid", ctypes.c_char * 40),
    ]


class ProcSlot(ctypes.Structure):
    _fields_ = [
        ("pid", i32),
        ("host_pid", i32),  # as NVML names the process, as the agent told it (0: not known)
        ("start_time", u64),
        ("used_bytes", u64),
        ("peak_bytes", u64),
        ("launches", u64),
        ("last_activity_ns", u64),
        ("oom_refusals", u64),
        ("swapped", u32),
        ("pad1", u32),
    ]


class UsageStruct(ctypes.Structure):
    _fields_ = [
        ("magic", u64),
        ("abi_version", u32),
        ("file_size", u32),
        ("total_used", u64),
        ("grant_returned", u64),
        ("slots", ProcSlot * MAX_PROCS),
    ]


class ComputeStruct(ctypes.Structure):
    _fields_ = [
        ("magic", u64),
        ("abi_version", u32),
        ("file_size", u32),
        ("next_ns", u64),
        ("held_ns", u64),
        ("held_launches", u64),
        ("paced_launches", u64),
    ]


class FormatError(Exception):
    """A config or usage file is missing, truncated, or of another version."""


@dataclass
class ContainerConfig:
    """What the agent decides for one container; written to its config file."""

    gpu_uuid: str
    request_bytes: int
    limit_bytes: int
    grant_bytes: int = 0
    flags: int = FLAG_PREEMPTIBLE
    workload_class: int = CLASS_BATCH
    arbiter_timeout_ms: int = 2000
    wait_timeout_ms: int = 30000
    priority: int = 0
    namespace: str = ""
    pod: str = ""
    container: str = ""
    pod_uid: str = ""

    def __post_init__(self) -> None:
        # Never a limit below the guarantee, never a grant past the limit.
        self.limit_bytes = max(self.limit_bytes, self.request_bytes)
        self.grant_bytes = max(0, min(self.grant_bytes, self.limit_bytes - self.request_bytes))


# Modes of the agent-written files. The usage file is world-writable: container processes
# may run as any uid, and it holds only that container's own counters.
CONFIG_MODE = 0o644
USAGE_MODE = 0o666


def _map(
    path: Path, struct: type[ctypes.Structure], magic: int, writable: bool
) -> tuple[mmap.mmap, ctypes.Structure]:
    flags = os.O_RDWR if writable else os.O_RDONLY
    try:
        fd = os.open(path, flags)
    except OSError as e:
        raise FormatError(f"cannot open {path}: {e.strerror}") from e
    try:
        size = os.fstat(fd).st_size
        if size < ctypes.sizeof(struct):
            want = ctypes.sizeof(struct)
            raise FormatError(f"{path}: {size} bytes, want {want} (truncated or foreign file)")
        mm = mmap.mmap(fd, ctypes.sizeof(struct), access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ)
    finally:
        os.close(fd)
    s = struct.from_buffer(mm) if writable else struct.from_buffer_copy(mm)
    if s.magic != magic or s.abi_version != ABI_VERSION or s.file_size != ctypes.sizeof(struct):
        raise FormatError(f"{path}: bad magic, version {s.abi_version} or size {s.file_size}")
    return mm, s


def _blank(struct: type[ctypes.Structure], magic: int) -> bytes:
    """A zeroed file with its header."""
    s = struct()
    s.magic, s.abi_version, s.file_size = magic, ABI_VERSION, ctypes.sizeof(struct)
    return bytes(s)


def _create(path: Path, struct: type[ctypes.Structure], magic: int, mode: int, durable: bool = True) -> None:
    """Create a zeroed file with its header, atomically (write tmp, rename)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(_blank(struct, magic))
        f.flush()
        if durable:
            os.fsync(f.fileno())
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def create_unpublished(directory: str | os.PathLike[str]) -> None:
    """A container directory's config and usage files, blank, in a directory no reader sees
    yet (the agent's spares, renamed into place later): written in place, with no temporary
    file, rename or sync, each of which costs a journalled metadata write."""
    for name, struct, magic, mode in (
        (CONFIG_FILE, ConfigStruct, CONFIG_MAGIC, CONFIG_MODE),
        (USAGE_FILE, UsageStruct, USAGE_MAGIC, USAGE_MODE),
        (COMPUTE_FILE, ComputeStruct, COMPUTE_MAGIC, USAGE_MODE),
    ):
        fd = os.open(os.path.join(directory, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        try:
            os.fchmod(fd, mode)  # past the umask
            os.write(fd, _blank(struct, magic))
        finally:
            os.close(fd)


# Integer fields of ContainerConfig and the range of the ConfigStruct field each goes to.
_FIELD_RANGES = {
    "request_bytes": (0, 2**64 - 1),
    "limit_bytes": (0, 2**64 - 1),
    "grant_bytes": (0, 2**64 - 1),
    "flags": (0, 2**32 - 1),
    "workload_class": (0, 2**32 - 1),
    "arbiter_timeout_ms": (MIN_ARBITER_TIMEOUT_MS, 2**32 - 1),
    "wait_timeout_ms": (0, 2**32 - 1),
    "priority": (-(2**31), 2**31 - 1),
}


def _check_fits(cfg: ContainerConfig) -> None:
    for name, (low, high) in _FIELD_RANGES.items():
        value = getattr(cfg, name)
        if not low <= value <= high:
            raise FormatError(f"config field {name}: {value} does not fit (range {low}..{high})")


class ConfigFile:
    """The agent's handle on one container's config file (the only writer)."""

    def __init__(self, directory: str | os.PathLike[str], durable: bool = True) -> None:
        # durable=False skips fsync/msync: for files the agent rebuilds after a crash anyway
        # (the device plugin's Allocate path, where each sync is kubelet-visible latency).
        # Readers map the same page cache, so they see every write either way.
        self._durable = durable
        self.path = Path(directory) / CONFIG_FILE
        if not self.path.exists():
            _create(self.path, ConfigStruct, CONFIG_MAGIC, CONFIG_MODE, durable)
        self._mm, self._s = _map(self.path, ConfigStruct, CONFIG_MAGIC, writable=True)
        self.written: ContainerConfig | None = None  # the last config write() published

    def moved(self, directory: str | os.PathLike[str]) -> None:
        """Its directory was renamed: the mapping follows the file, the path is told here."""
        self.path = Path(directory) / CONFIG_FILE

    def write(self, cfg: ContainerConfig) -> int:
        """Publish a new config under the seqlock; returns the new generation. A value its
        field cannot hold raises FormatError (ctypes would silently wrap it around)."""
        _check_fits(cfg)
        s = self._s
        # Odd while writing: readers retry. `|= 1` rather than `+= 1`: an agent killed mid-write
        # left seq odd, and adding one would make this write look consistent half-way through.
        s.seq |= 1
        s.generation += 1
        s.gpu_uuid = cfg.gpu_uuid.encode()
        s.request_bytes = cfg.request_bytes
        s.limit_bytes = cfg.limit_bytes
        s.grant_bytes = cfg.grant_bytes
        s.flags = cfg.flags
        s.workload_class = cfg.workload_class
        s.arbiter_timeout_ms = cfg.arbiter_timeout_ms
        s.wait_timeout_ms = cfg.wait_timeout_ms
        s.priority = cfg.priority
        s.namespace_ = cfg.namespace.encode()[:63]
        s.pod = cfg.pod.encode()[:127]
        s.container = cfg.container.encode()[:63]
        s.pod_uid = cfg.pod_uid.encode()[:39]
        s.seq += 1  # even: consistent
        self.written = cfg
        if self._durable:
            self._mm.flush()
        return int(s.generation)

    def set_pace(self, pace_ns: int) -> None:
        """The container's launch pace (memguard_abi.h compute_pace_ns): one aligned word the
        shim reads on every launch, stored alone, outside the seqlock and the generation (it
        changes every control period and means nothing to the rest of the config)."""
        value = max(0, min(int(pace_ns), 2**32 - 1))
        u32.from_buffer(self._mm, ConfigStruct.compute_pace_ns.offset).value = value

    def pace(self) -> int:
        return int(u32.from_buffer_copy(self._mm, ConfigStruct.compute_pace_ns.offset).value)

    def read(self) -> ContainerConfig:
        return read_config(self.path.parent)

    def close(self) -> None:
        del self._s
        self._mm.close()


def _seq(mm: mmap.mmap) -> int:
    """The config's seqlock counter, read from the live mapping."""
    return int(u64.from_buffer_copy(mm, ConfigStruct.seq.offset).value)


SEQ_SPINS = 1000  # tries before read_config starts sleeping between them
SEQ_PATIENCE_S = 0.5  # how long read_config waits for a write in flight to complete


def read_config(directory: str | os.PathLike[str]) -> ContainerConfig:
    """A consistent snapshot of a container's config (retries while a write is in flight)."""
    path = Path(directory) / CONFIG_FILE
    mm, _ = _map(path, ConfigStruct, CONFIG_MAGIC, writable=False)
    try:
        deadline = 0.0
        for tries in itertools.count():
            if tries >= SEQ_SPINS:
                # A writer preempted mid-write holds seq odd for a scheduler slice or more on a
                # busy node: past the spins, wait for it in short sleeps, up to SEQ_PATIENCE_S.
                # Only a writer killed mid-write (fixed when the agent attaches the directory
                # again) leaves it odd for good.
                now = time.monotonic()
                deadline = deadline or now + SEQ_PATIENCE_S
                if now > deadline:
                    break
                time.sleep(0.0005)
            # The seqlock: seq even before the copy and unchanged after it, read from the live
            # mapping (the copy's own seq may predate a write that began during the copy).
            before = _seq(mm)
            if before % 2:
                continue
            s = ConfigStruct.from_buffer_copy(mm)
            if _seq(mm) != before:
                continue
            return ContainerConfig(
                gpu_uuid=s.gpu_uuid.decode(),
                request_bytes=s.request_bytes,
                limit_bytes=s.limit_bytes,
                grant_bytes=s.grant_bytes,
                flags=s.flags,
                workload_class=s.workload_class,
                arbiter_timeout_ms=s.arbiter_timeout_ms,
                wait_timeout_ms=s.wait_timeout_ms,
                priority=s.priority,
                namespace=s.namespace_.decode(),
                pod=s.pod.decode(),
                container=s.container.decode(),
                pod_uid=s.pod_uid.decode(),
            )
    finally:
        mm.close()
    raise FormatError(f"{path}: a write never completed (seq stays odd)")


def generation(directory: str | os.PathLike[str]) -> int:
    mm, s = _map(Path(directory) / CONFIG_FILE, ConfigStruct, CONFIG_MAGIC, writable=False)
    mm.close()
    return int(s.generation)


COMPUTE_SIZE = ctypes.sizeof(ComputeStruct)


def create_compute(directory: str | os.PathLike[str], durable: bool = True) -> Path:
    """Create the container's compute file (the shim's shared launch clock) unless it is there."""
    path = Path(directory) / COMPUTE_FILE
    if not path.exists():
        _create(path, ComputeStruct, COMPUTE_MAGIC, USAGE_MODE, durable)
    return path


def read_compute(directory: str | os.PathLike[str]) -> ComputeStruct:
    """A validated copy of a container's compute file, read by pread (the tenant may write or
    truncate it: only figures for display come from it). FormatError when missing or broken."""
    path = Path(directory) / COMPUTE_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        raise FormatError(f"cannot open {path}: {e.strerror}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise FormatError(f"{path}: not a regular file")
        data = os.pread(fd, COMPUTE_SIZE, 0)
    except OSError as e:
        raise FormatError(f"cannot read {path}: {e.strerror}") from None
    finally:
        os.close(fd)
    if len(data) < COMPUTE_SIZE:
        raise FormatError(f"{path}: {len(data)} bytes, want {COMPUTE_SIZE}")
    s = ComputeStruct.from_buffer_copy(data)
    if s.magic != COMPUTE_MAGIC or s.abi_version != ABI_VERSION or s.file_size != COMPUTE_SIZE:
        raise FormatError(f"{path}: bad magic, version {int(s.abi_version)} or size {int(s.file_size)}")
    return s


def create_usage(directory: str | os.PathLike[str], durable: bool = True) -> Path:
    """Create an empty usage file (agent side, when the container is allocated)."""
    path = Path(directory) / USAGE_FILE
    if not path.exists():
        _create(path, UsageStruct, USAGE_MAGIC, USAGE_MODE, durable)
    return path


class UsageFile:
    """A writable mapping of a container's usage file: the shim's side of it (the stand-in
    workload of gpufrac.simgpu.runtime, tests). The agent never keeps one: a container may
    truncate its own usage file, and a mapping of a shrunk file kills its reader with SIGBUS.
    The agent reads with read_usage() and writes with write_usage_fields() (copies)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.path = Path(directory) / USAGE_FILE
        self._mm, self.usage = _map(self.path, UsageStruct, USAGE_MAGIC, writable=True)

    def live_slots(self) -> list[ProcSlot]:
        return [s for s in self.usage.slots if s.pid > 0]

    def close(self) -> None:
        del self.usage
        self._mm.close()


USAGE_SIZE = ctypes.sizeof(UsageStruct)
# No GPU holds this much (256 TiB): a byte counter above it is garbage (a tenant's write, or a
# u64 the shim would have to have underflowed), and is read as this much, never as 0, so that
# garbage cannot hide usage. What a counter may count against others is decided by its reader
# (the arbiter caps it at what it granted, gpufrac.agent.gpu.truth).
USAGE_MAX_BYTES = 1 << 48
USAGE_HEADER = _struct.Struct("=QIIQQ")  # magic, abi_version, file_size, total_used, grant_returned
assert USAGE_HEADER.size == UsageStruct.slots.offset
_SLOT_SIZE = ctypes.sizeof(ProcSlot)
_SLOTS_AT = UsageStruct.slots.offset
_SLOT_WORDS, _SLOT_INTS = _SLOT_SIZE // 8, _SLOT_SIZE // 4  # a slot in u64 and in i32 units
_USED_WORD, _PEAK_WORD = ProcSlot.used_bytes.offset // 8, ProcSlot.peak_bytes.offset // 8
_PID_INT = ProcSlot.pid.offset // 4
assert _SLOT_SIZE % 8 == 0 and _SLOTS_AT % 8 == 0 and ProcSlot.used_bytes.offset % 8 == 0


def _short(where: str, size: int) -> FormatError:
    """The one error for a usage file cut short, however much of it was read: the agent logs
    each kind of fault once, and a truncation is one fault whether the header or the whole
    file was asked for."""
    return FormatError(f"{where}: {size} bytes, want {USAGE_SIZE} (truncated or foreign file)")


def _check_header(where: str, magic: int, version: int, size: int) -> None:
    """FormatError for a usage header of another kind, worded alike for a header-only read and
    a whole-file one (the same fault is one warning)."""
    if magic != USAGE_MAGIC:
        raise FormatError(f"{where}: bad magic {magic:#x}")
    if version != ABI_VERSION:
        raise FormatError(f"{where}: ABI version {version}, want {ABI_VERSION}")
    if size != USAGE_SIZE:
        raise FormatError(f"{where}: header says {size} bytes, want {USAGE_SIZE}")


def _open_usage(path: Path, writable: bool) -> int:
    """An fd on a regular usage file (never a FIFO or a device: the file is the tenant's)."""
    flags = (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
    try:
        fd = os.open(path, flags)
    except OSError as e:
        raise FormatError(f"cannot open {path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FormatError(f"{path}: not a regular file")
        if st.st_size < USAGE_SIZE:
            raise _short(str(path), st.st_size)
    except BaseException:
        os.close(fd)
        raise
    return fd


def parse_usage(data: bytes | bytearray | memoryview, where: str = "usage file") -> UsageStruct:
    """Validate and clamp the bytes of a usage file: a UsageStruct copy, or FormatError (the only
    exception it raises, whatever the bytes). Byte counters are clamped to USAGE_MAX_BYTES."""
    if len(data) < USAGE_SIZE:
        raise _short(where, len(data))
    s = UsageStruct.from_buffer_copy(bytes(data[:USAGE_SIZE]))
    _check_header(where, int(s.magic), int(s.abi_version), int(s.file_size))
    s.total_used = min(int(s.total_used), USAGE_MAX_BYTES)
    s.grant_returned = min(int(s.grant_returned), USAGE_MAX_BYTES)
    # The slots' counters looked at as one array of words (no slot object made): only a file
    # holding garbage is walked slot by slot (the agent reads hundreds of files a second).
    words = memoryview(s).cast("B")[_SLOTS_AT:].cast("Q")
    if (
        max(words[_USED_WORD::_SLOT_WORDS]) > USAGE_MAX_BYTES
        or max(words[_PEAK_WORD::_SLOT_WORDS]) > USAGE_MAX_BYTES
    ):
        for slot in s.slots:
            slot.used_bytes = min(int(slot.used_bytes), USAGE_MAX_BYTES)
            slot.peak_bytes = min(int(slot.peak_bytes), USAGE_MAX_BYTES)
    return s


def live_slots(usage: UsageStruct) -> list[ProcSlot]:
    """The slots of a usage copy that name a process (pid > 0), in order; the empty ones (most
    of the 256) are skipped without a slot object made for each."""
    pids = memoryview(usage).cast("B")[_SLOTS_AT:].cast("i")[_PID_INT::_SLOT_INTS]
    slots = usage.slots
    return [slots[i] for i, pid in enumerate(pids.tolist()) if pid > 0]


def read_usage(directory: str | os.PathLike[str]) -> UsageStruct:
    """A validated, clamped copy of a container's usage file, read by pread (never mapped: the
    file is writable, and truncatable, by the container). Raises FormatError only."""
    path = Path(directory) / USAGE_FILE
    fd = _open_usage(path, writable=False)
    try:
        data = os.pread(fd, USAGE_SIZE, 0)
    except OSError as e:
        raise FormatError(f"cannot read {path}: {e.strerror}") from None
    finally:
        os.close(fd)
    return parse_usage(data, str(path))


def parse_usage_total(head: bytes, where: str = "usage file") -> int:
    """The clamped total_used from the first USAGE_HEADER.size bytes of a usage file, its
    header validated; FormatError (only) otherwise."""
    if len(head) < USAGE_HEADER.size:
        raise _short(where, len(head))
    magic, version, size, total, _ = USAGE_HEADER.unpack(head[: USAGE_HEADER.size])
    _check_header(where, magic, version, size)
    return min(int(total), USAGE_MAX_BYTES)


def read_usage_total(directory: str | os.PathLike[str]) -> int:
    """Only the header's total_used (the arbiter reads it per request: 32 bytes, not 16 KiB)."""
    path = Path(directory) / USAGE_FILE
    fd = _open_usage(path, writable=False)
    try:
        data = os.pread(fd, USAGE_HEADER.size, 0)
    except OSError as e:
        raise FormatError(f"cannot read {path}: {e.strerror}") from None
    finally:
        os.close(fd)
    return parse_usage_total(data, str(path))


def slot_field_offset(index: int, name: str) -> int:
    """Where slot `index`'s field `name` lies in the usage file."""
    offset: int = getattr(ProcSlot, name).offset  # a ctypes field, looked up by name
    return _SLOTS_AT + index * _SLOT_SIZE + offset


def write_usage_fields(directory: str | os.PathLike[str], writes: list[tuple[str, int, int]]) -> None:
    """Write fields of a usage file in place by pwrite, in order: (field name in UsageStruct or
    ProcSlot, slot index or -1 for the header, value). The file is checked first (size, header)
    and never mapped; a file the container broke meanwhile only loses these writes."""
    path = Path(directory) / USAGE_FILE
    fd = _open_usage(path, writable=True)
    try:
        head = os.pread(fd, USAGE_HEADER.size, 0)
        want = (USAGE_MAGIC, ABI_VERSION, USAGE_SIZE)
        if len(head) < USAGE_HEADER.size or USAGE_HEADER.unpack(head)[:3] != want:
            raise FormatError(f"{path}: bad header")
        for name, index, value in writes:
            if index < 0:
                field = getattr(UsageStruct, name)
                at = field.offset
            else:
                field = getattr(ProcSlot, name)
                at = slot_field_offset(index, name)
            os.pwrite(fd, value.to_bytes(field.size, sys.byteorder, signed=name == "pid"), at)
    except OSError as e:
        raise FormatError(f"cannot write {path}: {e.strerror}") from None
    finally:
        os.close(fd)
