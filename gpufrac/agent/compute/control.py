"""The compute controller: from each container's measured use of its GPU, the launch paces that
hold every container to its share (docs/compute.md).

Pure: no I/O, no clock. Once a control period, per GPU, `step` takes the containers on it
(share, mode), what the driver measured each using in the period (the share of the period
its work ran on the GPU), and the controller's memory of each (`Paced`), and decides:

1. **What each may use** (`allocate`): the GPU's whole time divided by weighted max-min
   fairness (water-filling) over the containers' shares, each capped by what it wants. A
   container held back by a pace wants more than it gets. One that is not wants what it used
   and a little more (HEADROOM) while the GPU has time to spare; once the GPU is saturated, the
   others' time slices may hold it back: it wants all its weighted part, unless it has been
   seen to want less with time to spare (`free_use`) and uses no more than that now. In strict
   mode the share is also the cap. So in fair mode compute nobody uses goes to the busy in proportion to
   their shares, a container alone gets the whole GPU, and under contention each gets at least
   its share; in strict mode no one gets more than its share.
2. **The pace** that holds a container to what it may use: none while it uses no more (never
   a pace while the GPU is not contended, in fair mode); in fair mode a pace is only begun
   while another container, not paced itself, gets less than it may use (someone the pace
   protects: a paced neighbour under its target is held back by its own pace, which the next
   period loosens). The pace begins at what one of its launches costs the GPU (driver-measured
   time over counted launches, the last second) over its target, then follows new targets at
   once and the driver's figures by a correction (`_next_pace`). Nothing here depends on the
   GPU's size: the loop closes on the driver's measured time, whatever a launch costs
   (HAMi-core's grid-size tokens did not).
3. **Unheld**: a container paced to the slowest pace that still uses more than it may is not
   held by the shim (it bypasses it, or launches work no pace can hold): the agent says so, and
   from then on holds it from outside (gpufrac.agent.compute.hold: its GPU processes stopped
   for `hold` of each period), `hold` following its measured use as the pace would: up by the
   share of the period it is over, down while it is under.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

SATURATED = 0.9  # the GPU busy this much of a period: contended (hosts leave gaps between launches)
SPARE = 0.8  # the GPU busy less than this: time to spare, what a container uses is what it wants
FULL = 0.97  # a container that may use this much of the GPU is not paced at all
HEADROOM = 0.03  # an unpaced container's want is its use and this much (room to grow)
TOLERANCE = 0.02  # an unpaced container up to this much over what it may use is left alone
K_GAIN = 0.5  # how much of the measured error the correction takes in per period (lag, noise)
K_STEP = 1.5  # the correction moves at most this factor in one period
K_RANGE = 16.0  # and stays within this factor of 1 (a launch count 16 times off still converges)
MIN_PACE_NS = 1_000  # a pace under 1 us holds nothing back: lifted
MAX_PACE_NS = 4_000_000_000  # at most 4 s between a container's launches (the config holds a u32 of ns)
FIRST_PACE_NS = 1_000_000  # the first pace when the period's launches are not known
UNHELD_PERIODS = 10  # at the slowest pace and still over for this many periods: not held
MAX_HOLD = 0.9  # an unheld container's processes are stopped at most this much of a period
RECENT = 50  # periods of launches and use kept for a launch's cost
COST_SPAN_S = 1.0  # a launch's cost is taken over at least this much of the latest periods...
COST_LAUNCHES = 20  # ...and at least this many launches (long kernels: more periods, up to RECENT)
LOOSE = 0.5  # a paced container whose launches used less than this of its slots is not held by them


@dataclass(frozen=True)
class Tenant:
    """A container on a GPU, as the controller sees it."""

    key: str
    share: float  # of the GPU's compute, 0..1
    strict: bool  # the share is also a cap


@dataclass
class Paced:
    """The controller's memory of one container."""

    pace_ns: int = 0  # 0: its launches are not held
    # What it used, smoothed, in periods the GPU had time to spare and it was not paced: what it
    # wants when nobody holds it back. None: not seen so (new, or paced since).
    free_use: float | None = None
    last_used: float = 0.0  # what it used the period before (a one-period dip is not a drop in want)
    recent: list[tuple[int, float, float]] = field(default_factory=list)  # (launches, used, period s)
    begun: bool = False  # its pace began last period: the period measured it only in part
    k: float = 1.0  # the pace's correction from the driver's measured use (see _next_pace)
    aimed: float | None = None  # the target its pace was last set for
    at_max: int = 0  # periods in a row paced to the slowest and still over what it may use
    paced_s: float = 0.0  # time a pace was in force (its throttled time)
    unheld: bool = False  # over what it may use though paced to the slowest (see the module doc)
    hold: float = 0.0  # share of each period its processes are stopped (unheld containers only)


@dataclass(frozen=True)
class Decision:
    """One container's period: what it may use, what it used, the pace that follows."""

    key: str
    share: float
    strict: bool
    target: float
    used: float
    pace_ns: int
    unheld: bool
    hold: float  # share of the period its GPU processes are to be stopped


def water_fill(capacity: float, weights: Mapping[str, float], caps: Mapping[str, float]) -> dict[str, float]:
    """Weighted max-min fair division of `capacity`: each gets capacity x its weight over the
    weights of those not yet served, unless its cap is lower; what the capped leave goes to the
    rest, in proportion to their weights."""
    out: dict[str, float] = {}
    active = {k for k in weights if weights[k] > 0}
    out.update(dict.fromkeys(set(weights) - active, 0.0))
    left = capacity
    while active:
        total = sum(weights[k] for k in active)
        fair = {k: left * weights[k] / total for k in active}
        capped = {k for k in active if caps[k] <= fair[k]}
        if not capped:
            out.update(fair)
            break
        for k in capped:
            out[k] = max(0.0, caps[k])
            left -= out[k]
            active.discard(k)
        left = max(0.0, left)
    return out


def allocate(
    tenants: Sequence[Tenant], used: Mapping[str, float], paced: Mapping[str, Paced]
) -> dict[str, float]:
    """What each container may use of the GPU this period (see the module doc)."""
    busy = sum(used.get(t.key, 0.0) for t in tenants)
    want: dict[str, float] = {}
    for t in tenants:
        p = paced.get(t.key)
        u = max(used.get(t.key, 0.0), p.last_used if p is not None else 0.0)
        free = p.free_use if p is not None else None
        if u == 0:
            w = 0.0  # idle: nothing set aside (its time slices serve it at once when it wakes)
        elif p is not None and p.pace_ns > 0:
            w = math.inf  # held back: it wants more than it gets
        elif busy < SATURATED:
            w = u + HEADROOM  # the GPU has time to spare: what it uses is what it wants
        elif free is None or u > free + HEADROOM / 2:
            # Never seen with time to spare, or using more than it did then: the others' time
            # slices may hold it back; it wants what its share of the GPU would give it.
            w = math.inf
        else:
            w = max(u, free) + HEADROOM
        want[t.key] = min(w, t.share) if t.strict else w
    return water_fill(1.0, {t.key: t.share for t in tenants}, want)


def _cost_ns(p: Paced) -> float | None:
    """GPU time one of its launches takes (ns), over its recent periods: what the driver measured
    it using, over the launches its usage file counted. None before any launch was counted while
    it used the GPU. The count is the tenant's word: it shapes only the tenant's own pace, and the
    correction (`k`) follows the driver's figures wherever the count is wrong."""
    span = gpu_s = 0.0
    launches = 0
    for n, u, dt in reversed(p.recent):
        span, gpu_s, launches = span + dt, gpu_s + u * dt, launches + n
        if span >= COST_SPAN_S and launches >= COST_LAUNCHES:
            break
    if span <= 0 or gpu_s <= 0:
        return None
    return gpu_s * 1e9 / max(1, launches)  # none counted: one kernel longer than the window


def _next_pace(p: Paced, used: float, target: float, protects: bool) -> int:
    """The pace that gives a container `target`. It begins at what one of its launches costs the
    GPU (measured before, unpaced: its launches and the work they queue then go at one rate) over
    the target: launches that far apart use that share of it. Then each period it follows a new
    target at once (a pace is inversely what it allows) and closes the loop on the driver's
    figure: by part of the gap between what it used and what the last pace aimed at (`K_GAIN`,
    at most `K_STEP` a period: the GPU's queue makes use lag the pace). `k` is that correction,
    all periods together: at `K_RANGE` the pace is not what holds the container."""
    pace = p.pace_ns
    if target >= FULL or (pace and used == 0 and p.last_used == 0):
        return 0  # nothing to hold back: the whole GPU is its to use, or it is idle
    if pace == 0:
        if used <= target + TOLERANCE or not protects:
            return 0
        p.k, p.aimed = 1.0, target
        cost = _cost_ns(p)
        if cost is None:
            return FIRST_PACE_NS
        return int(min(MAX_PACE_NS, max(MIN_PACE_NS, cost / max(target, 1e-3))))
    aimed, p.aimed = p.aimed or target, target
    if p.begun:  # the period just measured ran partly without it: judge it on the next
        return int(min(MAX_PACE_NS, pace * aimed / max(target, 1e-3)))
    launches, period_s = (p.recent[-1][0], p.recent[-1][2]) if p.recent else (0, 0.0)
    if used < target - TOLERANCE and launches > 0 and launches * pace < LOOSE * period_s * 1e9:
        return 0  # it launches far slower than its pace allows: the pace holds nothing back
    nxt = pace * aimed / max(target, 1e-3)
    if abs(used - aimed) > TOLERANCE / 2 and aimed > 0:
        step = min(K_STEP, max(1 / K_STEP, (used / aimed) ** K_GAIN))
        if 1 / K_RANGE <= p.k * step <= K_RANGE:
            p.k *= step
            nxt *= step
        else:
            p.k = min(K_RANGE, max(1 / K_RANGE, p.k * step))
    if nxt < MIN_PACE_NS:
        return 0  # it no longer needs holding back
    return int(min(MAX_PACE_NS, nxt))


def step(
    tenants: Sequence[Tenant],
    used: Mapping[str, float],
    launches: Mapping[str, int],
    period_s: float,
    state: dict[str, Paced],
) -> list[Decision]:
    """One control period on one GPU: the decisions, and `state` moved on (entries for
    containers no longer on the GPU are the caller's to drop)."""
    targets = allocate(tenants, used, state)
    spare = sum(used.get(t.key, 0.0) for t in tenants) < SPARE
    # Containers a pace would protect: not paced, and getting less than they may use.
    short = {
        t.key
        for t in tenants
        if state.get(t.key, Paced()).pace_ns == 0 and used.get(t.key, 0.0) < targets[t.key] - TOLERANCE
    }
    out = []
    for t in tenants:
        p = state.setdefault(t.key, Paced())
        u = used.get(t.key, 0.0)
        target = targets[t.key]
        if p.pace_ns > 0:
            p.paced_s += period_s
        n = launches.get(t.key)
        if n is not None:  # a period whose launches are not known (its first) seeds nothing
            p.recent = [*p.recent[-(RECENT - 1) :], (n, u, period_s)]
        if p.pace_ns == 0 and spare:
            p.free_use = u if p.free_use is None else (p.free_use + u) / 2
        was = p.pace_ns
        p.pace_ns = _next_pace(p, u, target, t.strict or bool(short - {t.key}))
        p.begun = was == 0 and p.pace_ns > 0
        p.last_used = u
        if p.pace_ns > 0:
            p.free_use = None
        over = u > target + TOLERANCE
        # As slow as the pace goes (or its correction as far as it goes) and still over.
        spent = p.pace_ns >= MAX_PACE_NS or (p.pace_ns > 0 and p.k >= K_RANGE)
        p.at_max = p.at_max + 1 if spent and over else 0
        if p.unheld:  # for good: it has been seen to launch past the shim
            if over:
                p.hold = min(MAX_HOLD, p.hold + (1 - p.hold) * (1 - target / u))
            elif u < target - TOLERANCE:
                p.hold *= 0.8
        elif p.at_max >= UNHELD_PERIODS:
            p.unheld = True
            p.hold = min(MAX_HOLD, 1 - target / u) if u > 0 else 0.0
        out.append(Decision(t.key, t.share, t.strict, target, u, p.pace_ns, p.unheld, p.hold))
    return out


def overcommitted(tenants: Sequence[Tenant]) -> float:
    """The sum of the shares on a GPU when they cannot all be met under contention (above the
    whole GPU: annotations asked more than the memory shares, which never sum past it); 0 when
    they can. Water-filling then gives each its share scaled down in proportion."""
    total = sum(t.share for t in tenants)
    return total if total > 1.0 + 1e-9 else 0.0
