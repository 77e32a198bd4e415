"""GetPreferredAllocation: binpack vs spread, mustInclude, topology-aware whole GPUs."""

from __future__ import annotations

import pytest

from gpufrac.agent.booking.placement import preferred
from gpufrac.core import slices
from gpufrac.core.config import Config, GiB
from gpufrac.core.gpus import Gpu, Inventory, Link, PcieLink
from gpufrac.core.slices import FRACTION, MEMORY, device_id

pytestmark = pytest.mark.unit


def node(numa: list[int], nvlink_pairs: dict[tuple[int, int], int] | None = None) -> Inventory:
    n = len(numa)
    gpus = [Gpu(i, f"GPU-{i}", "Sim", 17 * GiB, f"0000:{i:02x}:00.0", numa[i], (), i) for i in range(n)]
    links = {}
    for a in range(n):
        for b in range(n):
            if a != b:
                nv = (nvlink_pairs or {}).get((min(a, b), max(a, b)), 0)
                links[(a, b)] = Link(nv, PcieLink.NUMA if numa[a] == numa[b] else PcieLink.SYSTEM)
    return Inventory(gpus=gpus, links=links)


def free(inv: Inventory, resource: str, per_gpu: dict[int, int]) -> list[str]:
    return [device_id(inv.gpus[g].uuid, resource, k) for g, count in per_gpu.items() for k in range(count)]


def gpus_of(ids: list[str]) -> set[str]:
    return {slices.parse(d).gpu_uuid for d in ids}


def pick(
    inv: Inventory,
    resource: str,
    avail: list[str],
    size: int,
    policy: str = "binpack",
    must=(),
    booked: frozenset[str] = frozenset(),
    released: dict[str, int] | None = None,
) -> list[str]:
    geo = slices.geometry(Config(), inv)
    return preferred(resource, avail, list(must), size, geo, inv, policy, booked, released or {})


def test_binpack_picks_the_gpu_left_fullest() -> None:
    inv = node([0, 0, 0])
    avail = free(inv, MEMORY, {0: 16, 1: 5, 2: 9})
    got = pick(inv, MEMORY, avail, 4)
    assert len(got) == 4 and gpus_of(got) == {"GPU-1"}  # 1 left over beats 5 and 12


def test_spread_picks_the_emptiest_gpu() -> None:
    inv = node([0, 0, 0])
    avail = free(inv, FRACTION, {0: 40, 1: 100, 2: 70})
    got = pick(inv, FRACTION, avail, 25, "spread")
    assert len(got) == 25 and gpus_of(got) == {"GPU-1"}


def test_gpu_too_small_is_skipped() -> None:
    inv = node([0, 0])
    avail = free(inv, FRACTION, {0: 10, 1: 60})
    assert gpus_of(pick(inv, FRACTION, avail, 30)) == {"GPU-1"}


def test_must_include_is_kept_and_pins_the_gpu() -> None:
    inv = node([0, 0])
    avail = free(inv, MEMORY, {0: 3, 1: 16})
    must = [device_id("GPU-1", MEMORY, 7)]
    got = pick(inv, MEMORY, avail, 3, must=must)
    assert must[0] in got and gpus_of(got) == {"GPU-1"}


def test_whole_gpus_prefer_one_numa_node_then_nvlink() -> None:
    # GPUs 0-3 on NUMA 0, 4-7 on NUMA 1; only 2-3 are NVLink peers on NUMA 0.
    inv = node([0, 0, 0, 0, 1, 1, 1, 1], {(2, 3): 12, (0, 5): 18})
    avail = free(inv, FRACTION, dict.fromkeys(range(8), 100))
    got = pick(inv, FRACTION, avail, 200)
    assert len(got) == 200 and gpus_of(got) == {"GPU-2", "GPU-3"}


def test_whole_gpus_skip_partly_used_gpus() -> None:
    inv = node([0, 0, 0, 1], {(0, 1): 4, (1, 2): 4, (0, 2): 4})
    avail = free(inv, FRACTION, {0: 100, 1: 99, 2: 100, 3: 100})
    assert gpus_of(pick(inv, FRACTION, avail, 200)) == {"GPU-0", "GPU-2"}


def test_nothing_fits_on_one_gpu_still_answers_best_effort() -> None:
    inv = node([0, 0])
    avail = free(inv, FRACTION, {0: 20, 1: 30})
    got = pick(inv, FRACTION, avail, 40)
    assert gpus_of(got) == {"GPU-1"} and len(got) == 30  # the kubelet fills the rest; Allocate explains


def test_slices_still_booked_come_last_on_the_chosen_gpu() -> None:
    inv = node([0, 0])
    avail = free(inv, MEMORY, {0: 10})
    booked = frozenset(avail[:4])  # a deleted pod's slices, not yet released by the agent
    assert pick(inv, MEMORY, avail, 6, booked=booked) == avail[4:10]


def test_binpack_does_not_count_slices_still_booked_as_room() -> None:
    inv = node([0, 0])
    # GPU-0 shows 4 free slices, all still booked: counted, it would look the tightest fit.
    avail = free(inv, MEMORY, {0: 4, 1: 9})
    booked = frozenset(avail[:4])
    assert gpus_of(pick(inv, MEMORY, avail, 4, booked=booked)) == {"GPU-1"}
    # When only they fit, they are chosen (Allocate then asks pod-resources who holds them).
    assert pick(inv, MEMORY, avail, 4, booked=booked | frozenset(avail[4:10])) == avail[:4]


def test_slices_released_last_come_last_on_the_chosen_gpu() -> None:
    inv = node([0, 0])
    avail = free(inv, MEMORY, {0: 6, 1: 9})
    # GPU-0 is still the binpack choice; on it, the slices released longest ago (or never) first.
    released = {avail[0]: 7, avail[1]: 7, avail[2]: 3}
    assert pick(inv, MEMORY, avail, 4, released=released) == [avail[3], avail[4], avail[5], avail[2]]
    # Still booked comes after released, and must_include before all.
    got = pick(inv, MEMORY, avail, 5, must=[avail[1]], booked=frozenset(avail[3:5]), released=released)
    assert got == [avail[1], avail[5], avail[2], avail[0], avail[3]]
