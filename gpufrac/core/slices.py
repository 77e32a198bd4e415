"""Device IDs of the two gpufrac resources: slices of one GPU's allocatable memory.

`<gpu-uuid>::fNN`  gpufrac.dev/gpu-fraction, 100 per GPU, each 1 % of the GPU
`<gpu-uuid>::mNNN` gpufrac.dev/gpu-memory, allocatable // memoryUnit per GPU

Both resources draw on the same memory, so the bytes a set of slices requests is
what the ledger books; the kubelet only ever sees slice counts.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

from gpufrac.core.config import Config
from gpufrac.core.gpus import Inventory

FRACTION = "gpufrac.dev/gpu-fraction"
MEMORY = "gpufrac.dev/gpu-memory"
RESOURCES = (FRACTION, MEMORY)
# Socket file names in the kubelet's device-plugin directory, per resource.
SOCKETS = {FRACTION: "gpufrac-fraction.sock", MEMORY: "gpufrac-memory.sock"}
FRACTION_SLICES = 100
_KIND = {FRACTION: "f", MEMORY: "m"}
_RESOURCE_OF = {v: k for k, v in _KIND.items()}
_WIDTH = {"f": 2, "m": 3}


@dataclass(frozen=True)
class SliceId:
    gpu_uuid: str
    resource: str
    number: int

    def __str__(self) -> str:
        kind = _KIND[self.resource]
        return f"{self.gpu_uuid}::{kind}{self.number:0{_WIDTH[kind]}d}"


def device_id(gpu_uuid: str, resource: str, number: int) -> str:
    return str(SliceId(gpu_uuid, resource, number))


# The kubelet sends every available ID with each GetPreferredAllocation (~1,400 on an
# 8-GPU node); a node has few distinct IDs, so parsing each once keeps that call cheap.
@functools.lru_cache(maxsize=16384)
def parse(device: str) -> SliceId:
    """Parse a device ID; ValueError names the ID when it is not one of ours."""
    uuid, sep, tail = device.rpartition("::")
    if not sep or not uuid or len(tail) < 2 or tail[0] not in _RESOURCE_OF or not tail[1:].isdigit():
        raise ValueError(f"{device!r} is not a gpufrac device ID (<gpu-uuid>::fNN or <gpu-uuid>::mNNN)")
    s = SliceId(uuid, _RESOURCE_OF[tail[0]], int(tail[1:]))
    if str(s) != device:  # one spelling per slice, or "::f1" and "::f01" could both be booked
        raise ValueError(f"{device!r} is not a gpufrac device ID as advertised (that slice is {str(s)!r})")
    return s


def sort_key(device: str) -> tuple[str, str, int]:
    s = parse(device)
    return (s.gpu_uuid, s.resource, s.number)


@dataclass(frozen=True)
class GpuGeometry:
    """How one GPU is cut into slices."""

    uuid: str
    index: int
    numa_node: int | None
    allocatable: int  # bytes: NVML total - reserved_per_gpu
    memory_unit: int
    memory_slices: int

    def slices(self, resource: str) -> int:
        return FRACTION_SLICES if resource == FRACTION else self.memory_slices

    def request_bytes(self, resource: str, count: int) -> int:
        """Bytes that `count` slices of `resource` on this GPU guarantee."""
        if resource == FRACTION:
            return self.allocatable * count // FRACTION_SLICES
        return count * self.memory_unit

    def slices_fitting(self, resource: str, free_bytes: int) -> int:
        """The largest slice count whose request_bytes fits in free_bytes."""
        if free_bytes < 0:
            return 0
        if resource == FRACTION:
            # allocatable*n//100 <= free  <=>  n <= ((free+1)*100 - 1) // allocatable
            n = ((free_bytes + 1) * FRACTION_SLICES - 1) // max(self.allocatable, 1)
        else:
            n = free_bytes // self.memory_unit
        return min(n, self.slices(resource))


@dataclass(frozen=True)
class ContainerDevices:
    """One container's devices of one resource, as the kubelet lists them (pod-resources)."""

    namespace: str
    pod: str
    container: str
    resource: str
    device_ids: tuple[str, ...]


def container_key(resource: str, device_ids: Iterable[str]) -> str:
    """Stable, unique-per-device-set key: the kubelet tells Allocate nothing else."""
    return _container_key(resource, tuple(device_ids))


@functools.lru_cache(maxsize=4096)
def _container_key(resource: str, device_ids: tuple[str, ...]) -> str:
    # Cached: every reconcile keys every container pod-resources lists, in the same order
    # each time, and Allocate/PreStartContainer key theirs on the kubelet's critical path.
    ids = sorted(device_ids, key=sort_key)
    digest = hashlib.sha256((resource + "\n" + "\n".join(ids)).encode()).hexdigest()[:20]
    return ("f-" if resource == FRACTION else "m-") + digest


def geometry(config: Config, inventory: Inventory) -> dict[str, GpuGeometry]:
    """Slice geometry of every GPU in the inventory, keyed by UUID (inventory order)."""
    out: dict[str, GpuGeometry] = {}
    for gpu in inventory.gpus:
        allocatable = max(0, gpu.memory_total - config.reserved_per_gpu)
        out[gpu.uuid] = GpuGeometry(
            uuid=gpu.uuid,
            index=gpu.index,
            numa_node=gpu.numa_node,
            allocatable=allocatable,
            memory_unit=config.memory_unit,
            memory_slices=allocatable // config.memory_unit,
        )
    return out
