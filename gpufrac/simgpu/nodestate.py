"""Python mirror of the simgpu node-state file (native/nodestate.h).

The layout is defined once, in C; this module mirrors it with ctypes and a test
(`tests/memguard/test_abi.py`) compiles a probe against the header and compares every
offset. Tests and the CLI use it to create a node, read what the fake drivers
recorded, and inject faults.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

MAGIC = 0x31305550474D4953  # "SIMGPU01"
ABI_VERSION = 2
MAX_GPUS = 16
MAX_NVLINKS = 18
MAX_PROCS = 1024
EVENT_RING = 64
CPU_WORDS = 4
SEG_RING = 32  # runs of a context kept (context time -> wall time)
SCHED_LOCK_BYTES = 64
TIMESLICE_US = 2000  # the time slice when a spec names none
UUID_LEN = 80
NAME_LEN = 96
BUSID_LEN = 32
NVLINK_NVSWITCH = -2  # nvlink_peer entry: the link goes into an NVSwitch fabric

TOPO_INTERNAL = 0
TOPO_SINGLE = 10
TOPO_MULTIPLE = 20
TOPO_HOSTBRIDGE = 30
TOPO_NODE = 40
TOPO_SYSTEM = 50

CKPT_RUNNING, CKPT_LOCKED, CKPT_CHECKPOINTED, CKPT_FAILED = 0, 1, 2, 3
PID_FREE, PID_REAPING = 0, -1

NVML_EVENT_XID_CRITICAL = 0x8

u32, u64, i32 = ctypes.c_uint32, ctypes.c_uint64, ctypes.c_int32


class Event(ctypes.Structure):
    _fields_ = [("seq", u64), ("type", u64), ("data", u64), ("time_us", u64)]


class Seg(ctypes.Structure):
    """One run of a context on the GPU: wall time [wall_ns, wall_ns + len_ns) was its context
    time [ctx_ns, ctx_ns + len_ns)."""

    _fields_ = [("wall_ns", u64), ("ctx_ns", u64), ("len_ns", u64)]


class Gpu(ctypes.Structure):
    _fields_ = [
        ("uuid", ctypes.c_char * 80),
        ("name", ctypes.c_char * 96),
        ("pci_bus_id", ctypes.c_char * 32),
        ("pci_domain", u32),
        ("pci_bus", u32),
        ("pci_device", u32),
        ("pci_device_id", u32),
        ("pci_subsystem_id", u32),
        ("minor", u32),
        ("numa_node", i32),
        ("nvlink_count", u32),
        ("nvlink_peer", i32 * MAX_NVLINKS),
        ("topo_level", u32 * MAX_GPUS),
        ("cpu_affinity", u64 * CPU_WORDS),
        ("total_bytes", u64),
        ("reserved_bytes", u64),
        ("sm_count", u32),
        ("cc_major", u32),
        ("cc_minor", u32),
        ("ctx_mib", ctypes.c_uint16),  # device memory one CUDA context takes (MiB)
        ("mig_mode", ctypes.c_uint8),  # 1 = MIG enabled
        ("pad0", ctypes.c_uint8),
        ("used_bytes", u64),
        ("util_gpu_override", u32),
        ("util_mem_override", u32),
        ("lost", u32),
        ("pad1", u32),
        ("event_seq", u64),
        ("events", Event * EVENT_RING),
        # The compute model (native/simstate.c sim_sched_*), played by the fake drivers.
        ("timeslice_us", u32),  # static: the time slice between contexts with work
        ("sched_init", u32),
        ("holder", u32),  # 1 + the slot index whose context holds the GPU; 0 = none
        ("pad2", u32),
        ("sched_now_ns", u64),  # wall time the schedule has been played up to
        ("slice_end_ns", u64),
        ("busy_ns_total", u64),  # time some context's work ran
        ("switches", u64),  # context switches
        ("sched_lock", ctypes.c_char * SCHED_LOCK_BYTES),
    ]


class Proc(ctypes.Structure):
    _fields_ = [
        ("pid", i32),
        ("gpu", u32),
        ("used_bytes", u64),
        ("swapped_bytes", u64),
        ("launches", u64),
        ("last_launch_ns", u64),
        ("busy_until_ns", u64),
        ("busy_ns_total", u64),
        ("ckpt_state", u32),
        ("api_inflight", u32),
        ("start_time", u64),
        ("ctx_ns", u64),  # context time: how long its work has held the GPU
        ("work_end_ns", u64),  # context time at which its submitted work is done
        ("sm_end_ns", u64),
        ("seg_count", u64),
        ("segs", Seg * SEG_RING),
    ]


class Node(ctypes.Structure):
    _fields_ = [
        ("magic", u64),
        ("abi_version", u32),
        ("file_size", u32),
        ("gpu_count", u32),
        ("cuda_driver_version", u32),
        ("driver_version", ctypes.c_char * 32),
        ("nvml_version", ctypes.c_char * 32),
        ("node_name", ctypes.c_char * 64),
        ("checkpoint_supported", u32),
        ("event_wake", u32),  # futex word: bumped after every posted event
        ("gpus", Gpu * MAX_GPUS),
        ("procs", Proc * MAX_PROCS),
    ]


class NodeStateError(Exception):
    """The node-state file is missing, truncated or of another version."""


class NodeState:
    """A mapped node-state file. Writes from Python are plain stores of aligned
    64/32-bit words (atomic on the platforms we support); multi-field updates
    that must look atomic to C readers do not go through here."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        try:
            fd = os.open(self.path, os.O_RDWR)
        except OSError as e:
            raise NodeStateError(f"cannot open node-state file {self.path}: {e.strerror}") from e
        try:
            size = os.fstat(fd).st_size
            if size < ctypes.sizeof(Node):
                raise NodeStateError(
                    f"{self.path} is not a node-state file: {size} bytes, want {ctypes.sizeof(Node)}"
                )
            self._mm = mmap.mmap(fd, ctypes.sizeof(Node))
        finally:
            os.close(fd)
        self.node = Node.from_buffer(self._mm)
        if self.node.magic != MAGIC or self.node.abi_version != ABI_VERSION:
            raise NodeStateError(
                f"{self.path}: bad magic or ABI version {self.node.abi_version} (want {ABI_VERSION})"
            )

    @property
    def gpus(self) -> list[Gpu]:
        return [self.node.gpus[i] for i in range(self.node.gpu_count)]

    def live_procs(self) -> list[Proc]:
        return [p for p in self.node.procs if p.pid > 0]

    def close(self) -> None:
        del self.node
        self._mm.close()

    def __enter__(self) -> NodeState:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def allocate_file(path: str | os.PathLike[str]) -> tuple[mmap.mmap, Node]:
    """Create a zeroed node-state file of the right size and map it (creator side)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    with open(tmp, "wb") as f:
        f.truncate(ctypes.sizeof(Node))
    fd = os.open(tmp, os.O_RDWR)
    try:
        mm = mmap.mmap(fd, ctypes.sizeof(Node))
    finally:
        os.close(fd)
    return mm, Node.from_buffer(mm)
