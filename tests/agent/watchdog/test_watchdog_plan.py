"""The watchdog's decision: which containers are over limit + one allowance, and whom to kill."""

from __future__ import annotations

import pytest

from gpufrac.agent.booking.ledger import ContainerAlloc
from gpufrac.agent.gpu.processes import GpuProcess
from gpufrac.agent.processes.callers import ContainerOwner
from gpufrac.agent.watchdog.service import plan
from gpufrac.memguard.abi import FLAG_WHOLE_GPU, ContainerConfig

pytestmark = pytest.mark.unit

GiB = 1 << 30
MiB = 1 << 20
GPU0, GPU1 = "GPU-0", "GPU-1"
TOL = 256 * MiB


def booking(key: str, limit: int, gpus: tuple[str, ...] = (GPU0,), flags: int = 0) -> ContainerAlloc:
    cfg = ContainerConfig(gpu_uuid=gpus[0], request_bytes=min(limit, GiB), limit_bytes=limit, flags=flags)
    return ContainerAlloc(
        key, "r", (), gpus, cfg.request_bytes, f"/x/{key}", bool(flags & FLAG_WHOLE_GPU), cfg
    )


def alloc(key: str, limit: int, gpus: tuple[str, ...] = (GPU0,), flags: int = 0) -> ContainerOwner:
    """A container holding one allocation."""
    return ContainerOwner(f"uid-{key}", key, (booking(key, limit, gpus, flags),))


def test_within_limit_plus_tolerance_is_left_alone() -> None:
    a = alloc("a", 2 * GiB)
    owned = [(a, GpuProcess(1, GPU0, 2 * GiB)), (a, GpuProcess(2, GPU0, TOL))]
    assert plan(owned, TOL, enforce=True) == []


def test_one_allowance_per_container_whatever_its_process_count() -> None:
    """The tolerance is the container's, once: idle CUDA processes started to gain headroom
    buy none. The newest processes go first, until the rest fits."""
    a = alloc("a", 4 * GiB)
    owned = [(a, GpuProcess(1, GPU0, 4 * GiB, start=100))]
    owned += [(a, GpuProcess(p, GPU0, 100 * MiB, start=100 + p)) for p in (2, 3, 4, 5)]
    # 4 GiB + 400 MiB: four idle processes of 100 MiB would have been 4 tolerances per process.
    (v,) = plan(owned, TOL, enforce=True)
    assert v.allowed == 4 * GiB + TOL
    # Newest first (5, then 4): 4 GiB + 200 MiB fits in 4 GiB + 256 MiB; the oldest stays.
    assert [p.pid for p in v.kill] == [5, 4]
    assert [p.pid for p in v.procs] == [5, 4, 3, 2, 1]


def test_enforce_kills_newest_first_until_the_rest_fits() -> None:
    a = alloc("a", 2 * GiB)
    old, mid, new = (
        GpuProcess(1, GPU0, 3 * GiB, start=10),
        GpuProcess(2, GPU0, GiB, start=20),
        GpuProcess(3, GPU0, 512 * MiB, start=30),
    )
    (v,) = plan([(a, old), (a, new), (a, mid)], TOL, enforce=True)
    assert (v.usage, v.limit, v.allowed) == (4.5 * GiB, 2 * GiB, 2 * GiB + TOL)
    # 4.5 GiB - 512 MiB - 1 GiB = 3 GiB is still over 2 GiB + 256 MiB: all three go.
    assert v.kill == [new, mid, old]
    assert v.procs == [new, mid, old]
    (v,) = plan([(a, GpuProcess(1, GPU0, 2 * GiB, start=10)), (a, new)], TOL, enforce=True)
    assert [p.pid for p in v.kill] == [3]  # the newest alone brings it back within


def test_several_kills_when_one_is_not_enough() -> None:
    a = alloc("a", GiB)
    procs = [GpuProcess(p, GPU0, GiB, start=p) for p in (10, 11, 12)]
    (v,) = plan([(a, p) for p in procs], TOL, enforce=True)
    assert [p.pid for p in v.kill] == [12, 11]


def test_report_mode_kills_nobody() -> None:
    a = alloc("a", GiB)
    (v,) = plan([(a, GpuProcess(1, GPU0, 3 * GiB))], TOL, enforce=False)
    assert v.kill == [] and v.usage == 3 * GiB


def test_containers_are_judged_separately() -> None:
    a, b = alloc("a", GiB), alloc("b", 4 * GiB)
    owned = [(a, GpuProcess(1, GPU0, 2 * GiB)), (b, GpuProcess(2, GPU0, 3 * GiB))]
    (v,) = plan(owned, TOL, enforce=True)
    assert v.owner is a and [p.pid for p in v.kill] == [1]


def test_memory_on_a_gpu_the_container_was_not_given_is_a_breach() -> None:
    a = alloc("a", 8 * GiB)
    (v,) = plan([(a, GpuProcess(1, GPU1, GiB))], TOL, enforce=True)
    assert (v.gpu, v.limit) == (GPU1, 0) and [p.pid for p in v.kill] == [1]


def test_whole_gpu_containers_are_accounted_never_limited() -> None:
    w = alloc("w", GiB, gpus=(GPU0, GPU1), flags=FLAG_WHOLE_GPU)
    assert plan([(w, GpuProcess(1, GPU0, 70 * GiB)), (w, GpuProcess(1, GPU1, 70 * GiB))], TOL, True) == []


def test_a_whole_gpu_container_is_limited_on_a_gpu_it_was_not_given() -> None:
    """Whole GPUs are its own to fill; a shared GPU it can see (NVIDIA_VISIBLE_DEVICES=all)
    is not: there its limit is 0, as any container's."""
    w = alloc("w", GiB, gpus=(GPU0,), flags=FLAG_WHOLE_GPU)
    (v,) = plan([(w, GpuProcess(1, GPU0, 70 * GiB)), (w, GpuProcess(2, GPU1, GiB))], TOL, enforce=True)
    assert (v.gpu, v.limit) == (GPU1, 0) and [p.pid for p in v.kill] == [2]


def test_a_container_with_two_allocations_on_a_gpu_is_held_to_their_limits_summed() -> None:
    """A container that asked for both resources holds two allocations: it is judged once per
    GPU, against both limits, and killed past them."""
    two = ContainerOwner("uid-t", "main", (booking("mem", GiB), booking("frac", 2 * GiB)))
    assert two.key == "uid-t/main"
    assert plan([(two, GpuProcess(1, GPU0, 3 * GiB))], TOL, enforce=True) == []
    (v,) = plan([(two, GpuProcess(1, GPU0, 4 * GiB))], TOL, enforce=True)
    assert (v.limit, v.allowed) == (3 * GiB, 3 * GiB + TOL) and [p.pid for p in v.kill] == [1]


def test_a_container_of_a_gpufrac_pod_without_an_allocation_has_a_limit_of_0() -> None:
    sidecar = ContainerOwner("uid-p", "sidecar", ())
    (v,) = plan([(sidecar, GpuProcess(7, GPU0, TOL + 1))], TOL, enforce=True)
    assert (v.limit, [p.pid for p in v.kill]) == (0, [7])
    # Not while a booking on that GPU is not yet tied to its container: it may be this one's.
    assert plan([(sidecar, GpuProcess(7, GPU0, GiB))], TOL, enforce=True, unsettled={GPU0}) == []
    (v,) = plan([(sidecar, GpuProcess(7, GPU1, GiB))], TOL, enforce=True, unsettled={GPU0})
    assert v.gpu == GPU1


def test_a_container_holding_no_allocation_on_a_gpu_has_no_allowance_there() -> None:
    """A sidecar that holds no allocation buys no allowance: three of them, each within what
    an allowance per container gave, are each a breach (their memory is booked to nobody)."""
    main = alloc("main", GiB)
    sidecars = [ContainerOwner("uid-main", f"side{i}", ()) for i in range(3)]
    owned = [(main, GpuProcess(1, GPU0, GiB))]
    owned += [(s, GpuProcess(10 + i, GPU0, TOL - MiB, start=10 + i)) for i, s in enumerate(sidecars)]
    verdicts = plan(owned, TOL, enforce=True)
    assert sorted(v.owner.container for v in verdicts) == ["side0", "side1", "side2"]
    assert all((v.limit, v.allowed) == (0, 0) and len(v.kill) == 1 for v in verdicts)
    # A container with an allocation on GPU 0 has none on GPU 1 either.
    (v,) = plan([(main, GpuProcess(1, GPU1, MiB))], TOL, enforce=True)
    assert (v.gpu, v.allowed, [p.pid for p in v.kill]) == (GPU1, 0, [1])


def test_one_allowance_per_pod_and_gpu_whatever_its_container_count() -> None:
    """A pod's containers that hold allocations on a GPU share one allowance there: the least
    over are covered first, and the one it cannot cover is held to what is left of it."""

    def member(name: str, limit: int) -> ContainerOwner:
        return ContainerOwner("uid-pod", name, (booking(f"pod-{name}", limit),))

    a, b, c = member("a", GiB), member("b", GiB), member("c", GiB)
    owned = [
        (a, GpuProcess(1, GPU0, GiB + 100 * MiB, start=1)),
        (b, GpuProcess(2, GPU0, GiB + 100 * MiB, start=2)),
        (c, GpuProcess(3, GPU0, GiB + 40 * MiB, start=3)),
    ]
    # 240 MiB over in all, within one allowance of 256 MiB: nobody is judged.
    assert plan(owned, TOL, enforce=True) == []
    owned.append((b, GpuProcess(4, GPU0, 20 * MiB, start=4)))
    # 260 MiB over: c (40) and a (100) are covered first, b holds the 116 MiB left.
    (v,) = plan(owned, TOL, enforce=True)
    assert (v.owner.container, v.allowed) == ("b", GiB + 116 * MiB)
    assert [p.pid for p in v.kill] == [4]  # its newest process alone brings it back within
    # Containers of different pods each have their pod's.
    other = ContainerOwner("uid-other", "d", (booking("other-d", GiB),))
    assert plan([*owned[:3], (other, GpuProcess(5, GPU0, GiB + 200 * MiB))], TOL, enforce=True) == []
