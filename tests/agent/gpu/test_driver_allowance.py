"""The driver's count less the allowance: one allowance per pod and GPU, none for a container
holding no allocation there (gpufrac.agent.gpu.truth.DriverUsage.less_allowance).

A victim's count is taken less the allowance (docs/watchdog.md): were that one per container, a
pod would hide an allowance's worth of memory from every reclaim with each container it runs."""

from __future__ import annotations

import pytest

from gpufrac.agent.booking.ledger import ContainerAlloc
from gpufrac.agent.gpu.processes import GpuProcess
from gpufrac.agent.gpu.truth import tally
from gpufrac.agent.processes.callers import ContainerOwner
from gpufrac.memguard.abi import ContainerConfig

pytestmark = pytest.mark.unit

MiB = 1 << 20
GPU0, GPU1 = "GPU-0", "GPU-1"
TOL = 256 * MiB


def member(pod: str, name: str) -> ContainerOwner:
    """Container `name` of pod `pod`, holding one allocation on GPU 0."""
    cfg = ContainerConfig(gpu_uuid=GPU0, request_bytes=512 * MiB, limit_bytes=1 << 30)
    key = f"{pod}-{name}"
    booked = ContainerAlloc(key, "r", (), (GPU0,), cfg.request_bytes, f"/x/{key}", False, cfg)
    return ContainerOwner(f"uid-{pod}", name, (booked,))


def test_a_pods_containers_share_one_allowance_on_a_gpu() -> None:
    a, b, c = member("p", "a"), member("p", "b"), member("q", "c")
    usage = tally(
        [
            (a, GpuProcess(1, GPU0, 100 * MiB)),
            (b, GpuProcess(2, GPU0, 300 * MiB)),
            (c, GpuProcess(3, GPU0, 300 * MiB)),
        ]
    )
    # p's allowance covers a's 100 MiB whole (the smaller first), then 156 MiB of b's.
    assert usage.less_allowance(a.key, GPU0, TOL) == 0
    assert usage.less_allowance(b.key, GPU0, TOL) == 144 * MiB
    # Another pod has its own.
    assert usage.less_allowance(c.key, GPU0, TOL) == 44 * MiB
    # The whole counts are untouched.
    assert usage.bytes_of(b.key, GPU0) == 300 * MiB


def test_a_container_holding_no_allocation_on_a_gpu_has_no_allowance_there() -> None:
    a = member("p", "a")
    sidecar = ContainerOwner("uid-p", "sidecar", ())
    usage = tally([(a, GpuProcess(1, GPU0, 10 * MiB)), (sidecar, GpuProcess(2, GPU0, 200 * MiB))])
    assert usage.less_allowance(sidecar.key, GPU0, TOL) == 200 * MiB
    assert usage.less_allowance(a.key, GPU0, TOL) == 0
    # a's allocation is on GPU 0: on GPU 1 it has none either.
    usage = tally([(a, GpuProcess(1, GPU1, 200 * MiB))])
    assert usage.less_allowance(a.key, GPU1, TOL) == 200 * MiB
