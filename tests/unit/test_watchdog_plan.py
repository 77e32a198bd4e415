"""The watchdog's decision: which containers are over limit + tolerance, and whom to kill."""

from __future__ import annotations

from gpufrac.agent.allocations import ContainerAlloc
from gpufrac.agent.watchdog import GpuProcess, plan
from gpufrac.memguard.formats import FLAG_WHOLE_GPU, ContainerConfig

GiB = 1 << 30
MiB = 1 << 20
GPU0, GPU1 = "GPU-0", "GPU-1"
TOL = 256 * MiB


def alloc(key: str, limit: int, gpus: tuple[str, ...] = (GPU0,), flags: int = 0) -> ContainerAlloc:
    cfg = ContainerConfig(gpu_uuid=gpus[0], request_bytes=min(limit, GiB), limit_bytes=limit, flags=flags)
    return ContainerAlloc(
        key, "r", (), gpus, cfg.request_bytes, f"/x/{key}", bool(flags & FLAG_WHOLE_GPU), cfg
    )


def test_within_limit_plus_tolerance_is_left_alone() -> None:
    a = alloc("a", 2 * GiB)
    owned = [(a, GpuProcess(1, GPU0, 2 * GiB)), (a, GpuProcess(2, GPU0, TOL))]
    assert plan(owned, TOL, enforce=True) == []


def test_each_process_has_its_tolerance_for_the_context_nvml_counts() -> None:
    """Four processes at the limit between them, each with a context the shim does not count:
    not a breach. One process more than its share over is."""
    a = alloc("a", 4 * GiB)
    ctx = 200 * MiB
    owned = [(a, GpuProcess(p, GPU0, GiB + ctx)) for p in (1, 2, 3, 4)]
    assert plan(owned, TOL, enforce=True) == []
    (v,) = plan([*owned, (a, GpuProcess(5, GPU0, GiB))], TOL, enforce=True)
    assert v.allowed == 4 * GiB + 5 * TOL
    # 5 GiB + 800 MiB against 4 GiB + 1280 MiB: one 1.2 GiB process goes; the rest
    # (4 GiB + 600 MiB) fits in 4 GiB + 1 GiB.
    assert [p.pid for p in v.kill] == [1]


def test_enforce_kills_largest_first_until_the_rest_fits() -> None:
    a = alloc("a", 2 * GiB)
    small, big, mid = GpuProcess(1, GPU0, 512 * MiB), GpuProcess(2, GPU0, 3 * GiB), GpuProcess(3, GPU0, GiB)
    (v,) = plan([(a, small), (a, big), (a, mid)], TOL, enforce=True)
    assert (v.usage, v.limit, v.allowed) == (4.5 * GiB, 2 * GiB, 2 * GiB + 3 * TOL)
    # 4.5 GiB - 3 GiB = 1.5 GiB fits: the 1 GiB and 512 MiB processes stay.
    assert v.kill == [big]
    assert v.procs == [big, mid, small]


def test_several_kills_when_one_is_not_enough() -> None:
    a = alloc("a", GiB)
    procs = [GpuProcess(p, GPU0, GiB) for p in (10, 11, 12)]
    (v,) = plan([(a, p) for p in procs], TOL, enforce=True)
    assert [p.pid for p in v.kill] == [10, 11]


def test_report_mode_kills_nobody() -> None:
    a = alloc("a", GiB)
    (v,) = plan([(a, GpuProcess(1, GPU0, 3 * GiB))], TOL, enforce=False)
    assert v.kill == [] and v.usage == 3 * GiB


def test_containers_are_judged_separately() -> None:
    a, b = alloc("a", GiB), alloc("b", 4 * GiB)
    owned = [(a, GpuProcess(1, GPU0, 2 * GiB)), (b, GpuProcess(2, GPU0, 3 * GiB))]
    (v,) = plan(owned, TOL, enforce=True)
    assert v.alloc is a and [p.pid for p in v.kill] == [1]


def test_memory_on_a_gpu_the_container_was_not_given_is_a_breach() -> None:
    a = alloc("a", 8 * GiB)
    (v,) = plan([(a, GpuProcess(1, GPU1, GiB))], TOL, enforce=True)
    assert (v.gpu, v.limit) == (GPU1, 0) and [p.pid for p in v.kill] == [1]


def test_whole_gpu_containers_are_accounted_never_limited() -> None:
    w = alloc("w", GiB, gpus=(GPU0, GPU1), flags=FLAG_WHOLE_GPU)
    assert plan([(w, GpuProcess(1, GPU0, 70 * GiB)), (w, GpuProcess(1, GPU1, 70 * GiB))], TOL, True) == []
