"""The compute controller: from each container's measured use of its GPU, the launch paces that
hold every container to its share (docs/compute.md).

Pure: no I/O, no clock. Once a control period, per GPU, `step` takes the containers on it
(share, mode), what the driver measured each using in the period (the share of the period
its work ran on the GPU), and the controller's memory of each (`Paced`), and decides:

1. **What each may use** (`allocate`): the GPU's whole time divided by weighted max-min
   fairness (water-filling) over the containers' shares, each capped by what it wants. A
   container held back by a pace wants more than it gets. One that is not wants what it used
   and a little more (HEADROOM) while the GPU has time to spare; once the GPU is saturated,
   one under its share may be held back by the others' time slices: it wants its whole share
   unless it has been seen to want less with time to spare (`free_use`) and uses no more now,
   and it wants more (twice, up to its share) when it uses more than that. In strict mode the
   share is also the cap. So in fair mode compute nobody uses goes to the busy in proportion to
   their shares, a container alone gets the whole GPU, and under contention each gets at least
   its share; in strict mode no one gets more than its share.
2. **The pace** that holds a container to what it may use: none while it uses no more (never
   a pace while the GPU is not contended, in fair mode); a first pace from its recent launches
   (the spacing that would have given its target), then multiplied each period by
   (used / target) ** GAIN. Nothing here depends on the GPU's size: the loop closes on the
   driver's measured time, whatever a launch costs (HAMi-core's grid-size tokens did not).
3. **Unheld**: a container paced to the slowest pace that still uses more than it may is not
   held by the shim (it bypasses it, or launches work no pace can hold): the agent says so.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

SATURATED = 0.95  # the GPU busy this much of a period: contended
FULL = 0.97  # a container that may use this much of the GPU is not paced at all
HEADROOM = 0.03  # an unpaced container's want is its use and this much (room to grow)
TOLERANCE = 0.02  # an unpaced container up to this much over what it may use is left alone
GAIN = 0.8  # how much of the measured error a pace corrects per period (below 1: lag, noise)
MAX_STEP = 4.0  # a pace moves at most this factor in one period
MIN_PACE_NS = 1_000  # a pace under 1 us holds nothing back: lifted
MAX_PACE_NS = 4_000_000_000  # at most 4 s between a container's launches (the config holds a u32 of ns)
FIRST_PACE_NS = 1_000_000  # the first pace when the period's launches are not known
UNHELD_PERIODS = 10  # at the slowest pace and still over for this many periods: not held
RECENT = 10  # periods of launches a first pace is seeded from
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
    recent: list[tuple[int, float, float]] = field(default_factory=list)  # (launches, used, period s)
    at_max: int = 0  # periods in a row at MAX_PACE_NS and still over what it may use
    paced_s: float = 0.0  # time a pace was in force (its throttled time)
    unheld: bool = False  # over what it may use though paced to the slowest (see the module doc)


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
        u = used.get(t.key, 0.0)
        p = paced.get(t.key)
        free = p.free_use if p is not None else None
        if p is not None and p.pace_ns > 0:
            w = math.inf  # held back: it wants more than it gets
        elif busy < SATURATED or u >= t.share:
            w = u + HEADROOM
        elif free is None:
            w = t.share  # never seen with time to spare: maybe held back by the others' slices
        elif u > free + HEADROOM / 2:
            w = min(t.share, max(2 * u, u + HEADROOM))  # using more than it did: let it grow
        else:
            w = max(u, free) + HEADROOM
        want[t.key] = min(w, t.share) if t.strict else w
    return water_fill(1.0, {t.key: t.share for t in tenants}, want)


def _next_pace(p: Paced, used: float, target: float) -> int:
    pace = p.pace_ns
    if target >= FULL:
        return 0
    if pace == 0:
        if used <= target + TOLERANCE:
            return 0
        span = sum(dt for _, _, dt in p.recent)
        if span <= 0:
            return FIRST_PACE_NS
        # The spacing its recent launches had, stretched to the target. No launch counted while
        # it used the GPU: kernels longer than the window, one at most in it.
        launches = max(1, sum(n for n, _, _ in p.recent))
        mean_use = sum(u * dt for _, u, dt in p.recent) / span
        first = span * 1e9 / launches * mean_use / max(target, 1e-3)
        return int(min(MAX_PACE_NS, max(MIN_PACE_NS, first)))
    launches, period_s = (p.recent[-1][0], p.recent[-1][2]) if p.recent else (0, 0.0)
    if used < target - TOLERANCE and launches > 0 and launches * pace < LOOSE * period_s * 1e9:
        return 0  # it launches far slower than its pace allows: the pace holds nothing back
    ratio = (used / target) if target > 0 else MAX_STEP
    # Slower (over its target): a part of the error, as the use lags the pace. Faster: all of it,
    # as a pace that no longer binds changes nothing.
    step = min(MAX_STEP, max(1 / MAX_STEP, ratio**GAIN if ratio > 1 else ratio))
    nxt = pace * step
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
    spare = sum(used.get(t.key, 0.0) for t in tenants) < SATURATED
    out = []
    for t in tenants:
        p = state.setdefault(t.key, Paced())
        u = used.get(t.key, 0.0)
        target = targets[t.key]
        if p.pace_ns > 0:
            p.paced_s += period_s
        p.recent = [*p.recent[-(RECENT - 1) :], (launches.get(t.key, 0), u, period_s)]
        if p.pace_ns == 0 and spare:
            p.free_use = u if p.free_use is None else (p.free_use + u) / 2
        p.pace_ns = _next_pace(p, u, target)
        if p.pace_ns > 0:
            p.free_use = None
        over = u > target + TOLERANCE
        p.at_max = p.at_max + 1 if p.pace_ns >= MAX_PACE_NS and over else 0
        p.unheld = p.at_max >= UNHELD_PERIODS
        out.append(Decision(t.key, t.share, t.strict, target, u, p.pace_ns, p.unheld))
    return out


def overcommitted(tenants: Sequence[Tenant]) -> float:
    """The sum of the shares on a GPU when they cannot all be met under contention (above the
    whole GPU: annotations asked more than the memory shares, which never sum past it); 0 when
    they can. Water-filling then gives each its share scaled down in proportion."""
    total = sum(t.share for t in tenants)
    return total if total > 1.0 + 1e-9 else 0.0
