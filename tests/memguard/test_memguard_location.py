"""memguard: only device memory counts — host-located cuMem buffers and pools do not,
and mipmapped arrays do.

NCCL allocates host-side buffers with cuMemCreate on a HOST / HOST_NUMA /
HOST_NUMA_CURRENT location (on by default with recent drivers), and a pool may be
created on a host location: that is host RAM the GPU reaches over the bus, never
GPU memory, so charging it against the container's GPU limit would fail NCCL's init
with a false OOM. A mipmapped array is device memory like any array: counted, and
refused past the limit.

Real processes under the real shim on a simulated node, release and ASan+UBSan builds.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.fixtures.memguard import NVML, Container, MiB, Shim

OOM = 2


@pytest.mark.parametrize("where", ["HOST", "HOST_NUMA", "HOST_NUMA_CURRENT"])
def test_host_located_cumem_buffers_do_not_count(
    shim: Shim, container: Callable[..., Container], where: str
) -> None:
    """A 256 MiB host-located cuMemCreate buffer in a 96 MiB container is created,
    mapped and usable, and the container is charged nothing for it (NVML shows no
    GPU memory either); a device-located one next to it is counted as before."""
    out = shim.python(
        container(request=96 * MiB, limit=96 * MiB),
        NVML
        + f"""
def prop(loc):
    p = cu.CUmemAllocationProp()
    p.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    p.location.type = loc
    p.location.id = 0
    return p
host = chk(cu.cuMemCreate(256 * 2**20, prop(cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_{where}), 0))
out["host"] = [used(), nvml()]
va = chk(cu.cuMemAddressReserve(256 * 2**20, 0, 0, 0))
chk(cu.cuMemMap(va, 256 * 2**20, 0, host, 0))
acc = cu.CUmemAccessDesc()
acc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
acc.location.id = 0
acc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
chk(cu.cuMemSetAccess(va, 256 * 2**20, [acc], 1))
chk(cu.cuMemsetD32(va, 5, 1024))
dev_h = chk(cu.cuMemCreate(64 * 2**20, prop(cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE), 0))
out["device"] = [used(), nvml()]
big = cu.cuMemCreate(64 * 2**20, prop(cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE), 0)
out["past_limit"] = rc(big)
chk(cu.cuMemUnmap(va, 256 * 2**20))
chk(cu.cuMemRelease(host))
chk(cu.cuMemRelease(dev_h))
out["released"] = used()
""",
    )
    assert out == {"host": [0, 0], "device": [64 * MiB, 64 * MiB], "past_limit": OOM, "released": 0}


def test_a_host_located_pool_does_not_count(shim: Shim, container: Callable[..., Container]) -> None:
    """Allocations from a pool created on a host NUMA node pass uncounted, however
    large; the device's pool next to it is still held to the limit."""
    out = shim.python(
        container(request=96 * MiB, limit=96 * MiB),
        NVML
        + """
props = cu.CUmemPoolProps()
props.allocType = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
props.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST_NUMA
props.location.id = 0
pool = chk(cu.cuMemPoolCreate(props))
s = chk(cu.cuStreamCreate(1))
p = chk(cu.cuMemAllocFromPoolAsync(192 * 2**20, pool, s))
chk(cu.cuStreamSynchronize(s))
out["host_pool"] = [used(), nvml()]
out["device_pool"] = rc(cu.cuMemAllocAsync(128 * 2**20, s))
chk(cu.cuMemFreeAsync(p, s))
chk(cu.cuStreamSynchronize(s))
chk(cu.cuMemPoolDestroy(pool))
out["after"] = used()
""",
    )
    assert out == {"host_pool": [0, 0], "device_pool": OOM, "after": 0}


def test_mipmapped_arrays_are_counted(shim: Shim, container: Callable[..., Container]) -> None:
    """A mipmapped array is charged for all its levels (what NVML shows for the
    process), uncounted when destroyed; one past the limit fails with OUT_OF_MEMORY."""
    out = shim.python(
        container(request=96 * MiB, limit=96 * MiB),
        NVML
        + """
def desc(side):
    d = cu.CUDA_ARRAY3D_DESCRIPTOR()
    d.Width = side
    d.Height = side
    d.Depth = 0
    d.Format = cu.CUarray_format.CU_AD_FORMAT_FLOAT
    d.NumChannels = 1
    return d
m = chk(cu.cuMipmappedArrayCreate(desc(2048), 12))
out["created"] = [used(), nvml()]
out["too_big"] = rc(cu.cuMipmappedArrayCreate(desc(8192), 14))
chk(cu.cuMipmappedArrayDestroy(m))
out["destroyed"] = [used(), nvml()]
""",
    )
    levels = sum(-(-((2048 >> lv) ** 2 * 4) // 512) * 512 for lv in range(12))
    assert out == {"created": [levels, levels], "too_big": OOM, "destroyed": [0, 0]}
