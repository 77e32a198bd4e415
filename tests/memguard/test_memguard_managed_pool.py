"""memguard: a managed memory pool counts, whatever location it prefers.

CUDA 13 memory pools can hand out managed memory (allocation type MANAGED). Their
location is only a preference: the pages move onto the GPU that touches them, as
cuMemAllocManaged's do, so a managed pool on a host location is GPU memory for
the container, unlike a pinned host pool (host RAM, never counted). Left
uncounted, such a pool would let a tenant past its limit unseen by its count.

Real processes under the real shim on a simulated node, release and ASan+UBSan builds.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.fixtures.memguard import NVML, Container, MiB, Shim

OOM = 2

BODY = (
    NVML
    + """
props = cu.CUmemPoolProps()
props.allocType = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_MANAGED
props.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_{where}
props.location.id = 0
pool = chk(cu.cuMemPoolCreate(props))
s = chk(cu.cuStreamCreate(1))
p = chk(cu.cuMemAllocFromPoolAsync(64 * 2**20, pool, s))
chk(cu.cuStreamSynchronize(s))
out["held"] = [used(), nvml()]
out["past_limit"] = rc(cu.cuMemAllocFromPoolAsync(64 * 2**20, pool, s))
chk(cu.cuMemFreeAsync(p, s))
chk(cu.cuStreamSynchronize(s))
chk(cu.cuMemPoolDestroy(pool))
out["after"] = [used(), nvml()]
"""
)


@pytest.mark.parametrize("where", ["HOST", "HOST_NUMA", "INVALID"])  # 0: NONE, no preference
def test_a_managed_pool_on_a_host_location_is_counted(
    shim: Shim, container: Callable[..., Container], where: str
) -> None:
    """64 MiB from a managed pool preferring host memory (or nothing) are counted (what NVML
    shows for the process), a second 64 MiB does not fit a 96 MiB container, and
    nothing stays counted once the pool is gone."""
    out = shim.python(container(request=96 * MiB, limit=96 * MiB), BODY.replace("{where}", where))
    held = out["held"][1]
    assert held >= 64 * MiB
    assert out == {"held": [held, held], "past_limit": OOM, "after": [0, 0]}
