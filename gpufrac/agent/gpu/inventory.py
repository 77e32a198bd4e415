"""The node's GPUs as NVML reports them, through nvidia-ml-py.

The same code reads a real node and a simgpu node (the fake libnvidia-ml.so.1 is
found by soname exactly like the real one). Every function here blocks on the
driver: the agent calls them through asyncio.to_thread, so they are plain
synchronous functions that keep no state of their own beyond NVML's init count.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pynvml  # nvidia-ml-py ships no type hints

from gpufrac.core.gpus import MIG_REASON, Gpu, Inventory, Link, PcieLink

log = logging.getLogger(__name__)

NVML_LIBRARY = "libnvidia-ml.so.1"
SYSFS_PCI = Path("/sys/bus/pci/devices")
NVIDIA_PCI_VENDOR = 0x10DE

# NVML's nvmlGpuTopologyLevel_t -> the nvidia-smi name of the path between two GPUs.
# INTERNAL (two GPUs on one board, e.g. K80) is the closest PCIe relation there is.
_TOPOLOGY_LEVELS = {
    pynvml.NVML_TOPOLOGY_INTERNAL: PcieLink.BOARD,
    pynvml.NVML_TOPOLOGY_SINGLE: PcieLink.BOARD,
    pynvml.NVML_TOPOLOGY_MULTIPLE: PcieLink.SWITCH,
    pynvml.NVML_TOPOLOGY_HOSTBRIDGE: PcieLink.HOST_BRIDGE,
    pynvml.NVML_TOPOLOGY_NODE: PcieLink.NUMA,
    pynvml.NVML_TOPOLOGY_SYSTEM: PcieLink.SYSTEM,
}

# Error codes that mean "this device or link does not have that": not a failure.
_ABSENT = (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_INVALID_ARGUMENT, pynvml.NVML_ERROR_NOT_FOUND)

LOST_REASON = "fell off the bus (NVML: GPU is lost)"
NO_DRIVER_HINT = (
    "for a simulated node run `gpufrac sim create` and set SIMGPU_STATE / LD_LIBRARY_PATH, or use `make run`"
)

T = TypeVar("T")
BusKey = tuple[int, int, int, int]  # PCI (domain, bus, device, function)


class NvmlError(RuntimeError):
    """An NVML call failed; the message names the call, the GPU and NVML's reason."""

    def __init__(self, message: str, code: int = pynvml.NVML_ERROR_UNKNOWN) -> None:
        super().__init__(message)
        self.code = code

    @property
    def gpu_lost(self) -> bool:
        return bool(self.code == pynvml.NVML_ERROR_GPU_IS_LOST)


class NvmlUnavailable(NvmlError):
    """No usable NVIDIA driver: libnvidia-ml.so.1 is missing or cannot initialise."""


def nvml_call(what: str, fn: Callable[..., T], *args: Any) -> T:
    """Call a pynvml function, turning its exception into an NvmlError that says what was asked."""
    try:
        return fn(*args)
    except pynvml.NVMLError as e:
        raise NvmlError(f"{what}: {e}", e.value) from None


def _library_load_error() -> str:
    """Why the dynamic loader cannot load libnvidia-ml.so.1 (pynvml swallows the reason)."""
    try:
        ctypes.CDLL(NVML_LIBRARY)
    except OSError as e:
        return str(e)
    return "NVML Shared Library Not Found"


def nvml_init() -> None:
    """nvmlInit, with a clear error when there is no driver. NVML counts inits:
    every successful call must be paired with nvml_shutdown()."""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        if e.value == pynvml.NVML_ERROR_LIBRARY_NOT_FOUND:
            raise NvmlUnavailable(
                f"no NVIDIA driver found ({NVML_LIBRARY}): {_library_load_error()}; {NO_DRIVER_HINT}", e.value
            ) from None
        if e.value == pynvml.NVML_ERROR_DRIVER_NOT_LOADED:
            raise NvmlUnavailable(
                f"no NVIDIA driver found ({NVML_LIBRARY} loaded but nvmlInit says: {e}); {NO_DRIVER_HINT}",
                e.value,
            ) from None
        raise NvmlError(f"nvmlInit: {e}", e.value) from None


def nvml_shutdown() -> None:
    try:
        pynvml.nvmlShutdown()
    except pynvml.NVMLError as e:
        # Shutdown failing leaves nothing for the caller to do; say so and go on.
        log.warning("nvmlShutdown: %s", e)


@contextmanager
def nvml_session() -> Iterator[None]:
    """`with nvml_session(): ...` — NVML initialised for the duration of the block."""
    nvml_init()
    try:
        yield
    finally:
        nvml_shutdown()


def query_gpus(
    what: str, query: Callable[[Any], T], level: int = logging.WARNING
) -> Iterator[tuple[int, str, T]]:
    """(index, UUID, query(handle)) for every GPU that answers, with NVML initialised
    around the loop. A GPU whose handle, UUID or query fails is logged at `level`
    ("<what> of GPU <index>: <NVML's reason>") and skipped, so one bad GPU does not hide
    the others. A lost GPU is logged at debug level only: the health monitor reports it,
    and callers poll often (the arbiter, ten times a second)."""
    with nvml_session():
        for i in range(nvml_call("nvmlDeviceGetCount", pynvml.nvmlDeviceGetCount)):
            try:
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                uuid = pynvml.nvmlDeviceGetUUID(h)
                result = query(h)
            except pynvml.NVMLError as e:
                lost = e.value == pynvml.NVML_ERROR_GPU_IS_LOST
                log.log(logging.DEBUG if lost else level, "%s of GPU %d: %s", what, i, e)
                continue
            yield i, uuid, result


def parse_bus_id(bus_id: str) -> BusKey:
    """(domain, bus, device, function) of a PCI address in NVML ("00000000:18:00.0")
    or sysfs ("0000:18:00.0") form, so the two compare equal."""
    try:
        domain, bus, rest = bus_id.strip().split(":")
        device, function = rest.split(".")
        return int(domain, 16), int(bus, 16), int(device, 16), int(function, 16)
    except ValueError:
        raise ValueError(f"{bus_id!r} is not a PCI bus id like 00000000:18:00.0") from None


def sysfs_pci_dir(bus_id: str) -> Path:
    domain, bus, device, function = parse_bus_id(bus_id)
    return SYSFS_PCI / f"{domain:04x}:{bus:02x}:{device:02x}.{function:x}"


def _sysfs_device(bus_id: str, pci_device_id: int) -> Path | None:
    """The sysfs directory of this GPU, only if it really is this NVIDIA device
    (a simulated GPU's bus id may name some unrelated host device)."""
    try:
        d = sysfs_pci_dir(bus_id)
        vendor = int((d / "vendor").read_text(), 16)
        device = int((d / "device").read_text(), 16)
    except (OSError, ValueError):
        return None
    if vendor != NVIDIA_PCI_VENDOR or device != (pci_device_id >> 16) & 0xFFFF:
        return None
    return d


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """A kernel CPU list ("0-55,112-167") as sorted CPU numbers."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return tuple(sorted(cpus))


def _cpu_mask_words() -> int:
    # nvmlDeviceGetCpuAffinity fills this many 64-bit words; room for at least 1024 CPUs.
    return max(16, -(-(os.cpu_count() or 1) // 64))


def _mask_to_cpus(words: Any) -> tuple[int, ...]:
    return tuple(w * 64 + b for w, word in enumerate(words) for b in range(64) if (int(word) >> b) & 1)


def _numa_node(handle: Any, sysfs: Path | None) -> int | None:
    try:
        node = pynvml.nvmlDeviceGetNumaNodeId(handle)
    except pynvml.NVMLError as e:
        if e.value not in (*_ABSENT, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND):
            raise
        node = -1
        if sysfs is not None:
            with suppress(OSError, ValueError):
                node = int((sysfs / "numa_node").read_text())
    return node if node >= 0 else None


def _cpu_affinity(handle: Any, sysfs: Path | None) -> tuple[int, ...]:
    try:
        cpus = _mask_to_cpus(pynvml.nvmlDeviceGetCpuAffinity(handle, _cpu_mask_words()))
    except pynvml.NVMLError as e:
        if e.value not in (*_ABSENT, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND):
            raise
        cpus = ()
    if not cpus and sysfs is not None:
        with suppress(OSError, ValueError):
            cpus = parse_cpu_list((sysfs / "local_cpulist").read_text())
    return cpus


def _read_gpu(index: int, handle: Any) -> Gpu:
    """One GPU's identity and placement."""
    what = f"GPU {index}"
    try:
        uuid = pynvml.nvmlDeviceGetUUID(handle)
        model = pynvml.nvmlDeviceGetName(handle)
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        pci = pynvml.nvmlDeviceGetPciInfo(handle)
        minor = pynvml.nvmlDeviceGetMinorNumber(handle)
        sysfs = _sysfs_device(pci.busId, pci.pciDeviceId)
        numa = _numa_node(handle, sysfs)
        cpus = _cpu_affinity(handle, sysfs)
    except pynvml.NVMLError as e:
        raise NvmlError(f"reading {what}: {e}", e.value) from None
    return Gpu(
        index=index,
        uuid=uuid,
        model=model,
        memory_total=int(memory.total),
        pci_bus_id=pci.busId,
        numa_node=numa,
        cpu_affinity=cpus,
        minor=minor,
        compute_capability=_compute_capability(handle),
    )


def _compute_capability(handle: Any) -> str:
    """ "major.minor", or "" where the driver cannot say (it is an attribute, not a decision)."""
    try:
        major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
    except pynvml.NVMLError:
        return ""
    return f"{major}.{minor}"


def mig_enabled(handle: Any) -> bool:
    """NVML's current MIG mode. A GPU that cannot do MIG (or a driver too old to say) is
    a plain GPU; a mode change pending a reset does not count until the reset happens."""
    try:
        current, _pending = pynvml.nvmlDeviceGetMigMode(handle)
    except pynvml.NVMLError as e:
        if e.value in (*_ABSENT, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND):
            return False
        raise
    return bool(current == pynvml.NVML_DEVICE_MIG_ENABLE)


def nvlink_peers(index: int, handle: Any, bus_to_index: dict[BusKey, int]) -> dict[int, int]:
    """Active NVLinks of one GPU: {peer GPU index: link count}. Links to an NVSwitch
    reach every GPU on the fabric; they are counted under key -1."""
    peers: dict[int, int] = {}
    for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
        try:
            if pynvml.nvmlDeviceGetNvLinkState(handle, link) != pynvml.NVML_FEATURE_ENABLED:
                continue
            remote = pynvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link)
        except pynvml.NVMLError as e:
            if e.value in _ABSENT:
                continue  # this link (or NVLink at all) does not exist on this GPU
            if e.value == pynvml.NVML_ERROR_GPU_IS_LOST:
                raise NvmlError(f"reading NVLink {link} of GPU {index}: {e}", e.value) from None
            # One unreadable link costs that link's bandwidth in the topology, not the inventory.
            log.warning("NVLink %d of GPU %d: %s; not counted", link, index, e)
            continue
        try:
            peer = bus_to_index.get(parse_bus_id(remote.busId))
        except ValueError:
            peer = None
        if peer is None and _remote_is_switch(handle, link):
            peer = -1
        if peer is not None and peer != index:
            peers[peer] = peers.get(peer, 0) + 1
    return peers


def _remote_is_switch(handle: Any, link: int) -> bool:
    try:
        kind = pynvml.nvmlDeviceGetNvLinkRemoteDeviceType(handle, link)
    except pynvml.NVMLError:
        return False  # an older driver cannot tell: not a GPU we know, so not counted
    return bool(kind == pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH)


def pcie_link(a: int, ha: Any, b: int, hb: Any) -> PcieLink:
    """The PCIe path between two GPUs. Where NVML cannot tell (some VMs), the farthest
    one is assumed, so placement never counts on a closeness it has not seen."""
    try:
        level = pynvml.nvmlDeviceGetTopologyCommonAncestor(ha, hb)
    except pynvml.NVMLError as e:
        if e.value not in (*_ABSENT, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND):
            raise NvmlError(f"PCIe path between GPU {a} and GPU {b}: {e}", e.value) from None
        log.warning("PCIe path between GPU %d and GPU %d: %s; assuming SYS", a, b, e)
        return PcieLink.SYSTEM
    try:
        return _TOPOLOGY_LEVELS[level]
    except KeyError:
        raise NvmlError(f"GPU {a} and GPU {b}: unknown NVML topology level {level}") from None


def read_inventory() -> Inventory:
    """Every GPU on the node with its pairwise NVLink/PCIe topology and driver versions.

    A GPU that has fallen off the bus cannot say who it is: it is left out of
    `gpus` and listed in `unreachable` (NVML index -> reason) instead, so one dead
    GPU does not take the node's other GPUs with it."""
    with nvml_session():
        count = nvml_call("nvmlDeviceGetCount", pynvml.nvmlDeviceGetCount)
        gpus: list[Gpu] = []
        handles: dict[int, Any] = {}
        unreachable: dict[int, str] = {}
        mig: list[Gpu] = []
        for i in range(count):
            try:
                h = nvml_call(f"nvmlDeviceGetHandleByIndex({i})", pynvml.nvmlDeviceGetHandleByIndex, i)
                gpu = _read_gpu(i, h)
                partitioned = nvml_call(f"nvmlDeviceGetMigMode(GPU {i})", mig_enabled, h)
            except NvmlError as e:
                if not e.gpu_lost:
                    raise
                log.warning("GPU %d: %s", i, LOST_REASON)
                unreachable[i] = LOST_REASON
                continue
            if partitioned:
                log.info("GPU %d (%s, %s): %s", i, gpu.uuid, gpu.pci_bus_id, MIG_REASON)
                mig.append(gpu)
                continue
            gpus.append(gpu)
            handles[i] = h
        bus_to_index = {parse_bus_id(g.pci_bus_id): g.index for g in gpus}
        peers = {i: nvlink_peers(i, h, bus_to_index) for i, h in handles.items()}
        links: dict[tuple[int, int], Link] = {}
        for a in handles:
            for b in handles:
                if a < b:
                    pcie = pcie_link(a, handles[a], b, handles[b])
                    links[(a, b)] = links[(b, a)] = Link(nvlinks=_pair_nvlinks(peers, a, b), pcie=pcie)
        driver = nvml_call("nvmlSystemGetDriverVersion", pynvml.nvmlSystemGetDriverVersion)
        cuda = nvml_call("nvmlSystemGetCudaDriverVersion", pynvml.nvmlSystemGetCudaDriverVersion)
    return Inventory(
        gpus=gpus,
        links=links,
        driver_version=driver,
        cuda_driver_version=cuda,
        unreachable=unreachable,
        mig=mig,
    )


def _pair_nvlinks(peers: dict[int, dict[int, int]], a: int, b: int) -> int:
    # Direct links are seen from both ends; take the smaller count so a link that
    # one side reports down is not counted. Through NVSwitches the pair gets the
    # bandwidth of the less-connected GPU (what nvidia-smi topo -m shows as NV#).
    direct = min(peers[a].get(b, 0), peers[b].get(a, 0))
    fabric = min(peers[a].get(-1, 0), peers[b].get(-1, 0))
    return direct + fabric


@dataclass(frozen=True)
class MemoryUsage:
    total: int
    used: int
    free: int


def read_memory() -> dict[str, MemoryUsage]:
    """Current memory use per GPU UUID (GPUs that do not answer are left out)."""
    return {
        uuid: MemoryUsage(total=int(m.total), used=int(m.used), free=int(m.free))
        for _, uuid, m in query_gpus("memory", pynvml.nvmlDeviceGetMemoryInfo)
    }
