"""GetPreferredAllocation: which slices the kubelet should pick for one container.

A share (fraction <= 100, any memory request) comes from one GPU: `binpack` picks
the GPU that fits with the least left over, `spread` the one with the most.
Whole GPUs (fraction 200, 300, …) get the best-connected set of fully free GPUs:
inside one NUMA node when possible, then most NVLinks, then the closest PCIe path.

The kubelet intersects the answer with what is available and fills any shortfall
itself, so when nothing fits we still answer (best effort) and let Allocate
explain the refusal.
"""

from __future__ import annotations

import itertools
from collections.abc import Container, Mapping, Sequence

from gpufrac.core import slices
from gpufrac.core.gpus import Inventory
from gpufrac.core.slices import FRACTION, FRACTION_SLICES, GpuGeometry

# Above this many candidate sets, whole GPUs are chosen greedily instead.
_MAX_COMBINATIONS = 20000


def _by_gpu(ids: Sequence[str], geometry: Mapping[str, GpuGeometry]) -> dict[str, list[str]]:
    """Our IDs by GPU, in the order given: only the chosen GPUs' slices need sorting."""
    out: dict[str, list[str]] = {}
    for dev in ids:
        try:
            s = slices.parse(dev)
        except ValueError:
            continue
        if s.gpu_uuid in geometry:
            out.setdefault(s.gpu_uuid, []).append(dev)
    return out


def _ordered(devs: Sequence[str], booked: Container[str], released: Mapping[str, int]) -> list[str]:
    """One GPU's slices in the order to hand them out. Stable sorts: booked slices last; before
    them, the longest released first, each part in slice order."""
    out = sorted(devs, key=slices.sort_key)
    if released:
        never = -1
        out.sort(key=lambda d: released.get(d, never))
    if booked:
        out.sort(key=booked.__contains__)
    return out


def preferred(
    resource: str,
    available: Sequence[str],
    must_include: Sequence[str],
    size: int,
    geometry: Mapping[str, GpuGeometry],
    inventory: Inventory,
    policy: str = "binpack",
    booked: Container[str] = frozenset(),
    released: Mapping[str, int] = {},
) -> list[str]:
    """The device IDs to prefer (at most `size`), must_include first.

    `booked`: slices the agent still books for a container the kubelet has let go of (it
    reuses a deleted pod's slices before the agent's next reconcile). On the chosen GPU they
    come last: an Allocate of slices still booked must first ask pod-resources who holds
    them, a round trip on the kubelet's critical path, and would reuse that container's
    directory name.
    `released`: when each slice was last released (higher: later). On the chosen GPU the
    slices released longest ago come first (slices of one GPU are interchangeable): the
    slices a container just let go of make the same container key again, and Allocate would
    wait for the deletion of that container's directory before writing the new one."""
    if size <= 0:
        return []
    must = list(dict.fromkeys(must_include))
    pool = list(dict.fromkeys([*must, *available]))
    free = _by_gpu(pool, geometry)
    if resource == FRACTION and size > FRACTION_SLICES and size % FRACTION_SLICES == 0:
        gpus = _whole_gpus(size // FRACTION_SLICES, free, must, geometry, inventory)
        if gpus is not None:
            return [d for u in gpus for d in _ordered(free[u], booked, released)][:size]
    home = _share_home(size, free, must, geometry, policy, booked)
    if home is None:
        return list(must)[:size]
    mine = set(free[home])
    chosen = [d for d in must if d in mine]
    taken = set(chosen)
    rest = [d for d in _ordered(free[home], booked, released) if d not in taken]
    return (chosen + rest)[:size]


def _share_home(
    size: int,
    free: Mapping[str, list[str]],
    must: Sequence[str],
    geometry: Mapping[str, GpuGeometry],
    policy: str,
    booked: Container[str],
) -> str | None:
    """The GPU a share comes from (None: no free slice at all)."""
    known = {x for v in free.values() for x in v} if must else set()
    must_gpus = {slices.parse(d).gpu_uuid for d in must if d in known}
    homes = [u for u in geometry if must_gpus <= {u}]
    # binpack: least left over; spread: most left over; ties -> lowest GPU index. Slices still
    # booked count as room only when no GPU fits without them: counted, they make the GPU
    # they sit on look tightest, and binpack would pick exactly them.
    sign = 1 if policy == "binpack" else -1
    rooms = [{u: sum(d not in booked or d in must for d in free.get(u, ())) for u in homes}]
    if booked:
        rooms.append({u: len(free.get(u, ())) for u in homes})
    for room in rooms:
        candidates = [u for u in homes if room[u] >= size]
        if candidates:
            return min(candidates, key=lambda u: (sign * (room[u] - size), geometry[u].index))
    # Nothing fits on one GPU: best effort from the GPU with the most room (Allocate
    # will refuse with the reason if the kubelet insists on spanning GPUs).
    if not free:
        return None
    return next(iter(must_gpus)) if len(must_gpus) == 1 else max(free, key=lambda u: len(free[u]))


def _whole_gpus(
    count: int,
    free: Mapping[str, list[str]],
    must: Sequence[str],
    geometry: Mapping[str, GpuGeometry],
    inventory: Inventory,
) -> list[str] | None:
    full = [u for u in geometry if len(free.get(u, ())) == FRACTION_SLICES]
    must_gpus = {slices.parse(d).gpu_uuid for d in must if slices.parse(d).gpu_uuid in geometry}
    if len(full) < count or not must_gpus <= set(full):
        return None
    idx = {u: geometry[u].index for u in full}

    def score(group: Sequence[str]) -> tuple[int, int, int, tuple[int, ...]]:
        numa = {geometry[u].numa_node for u in group}
        nvlinks = pcie = 0
        for a, b in itertools.combinations(group, 2):
            link = inventory.link(idx[a], idx[b])
            nvlinks += link.nvlinks
            pcie += link.pcie.rank
        # Smaller is better: one NUMA node, more NVLinks, nearer PCIe, lower indices.
        return (0 if len(numa) == 1 else 1, -nvlinks, pcie, tuple(idx[u] for u in group))

    others = [u for u in full if u not in must_gpus]
    need = count - len(must_gpus)
    base = sorted(must_gpus, key=lambda u: idx[u])
    n_comb = 1
    for i in range(need):
        n_comb = n_comb * (len(others) - i) // (i + 1)
    if n_comb <= _MAX_COMBINATIONS:
        best = min((base + list(c) for c in itertools.combinations(others, need)), key=score, default=None)
    else:  # greedy: grow the set by the GPU that scores best with it
        best = list(base)
        pool = list(others)
        if not best:
            best.append(pool.pop(0))
        while len(best) < count:
            nxt = min(pool, key=lambda u: score([*best, u]))
            pool.remove(nxt)
            best.append(nxt)
    return sorted(best, key=lambda u: idx[u]) if best is not None else None
