"""Replay a trace against one strategy, tick by tick.

Time advances in fixed ticks (the trace's tick_s, 30 s by default: the agent's
default waitTimeout, so a burst that waits is retried exactly once). Each tick:
arrivals join the admission queue; finished pods leave; the idle reaper runs
(gpufrac); queued pods are admitted where their reservation fits; every running
pod's demand is sampled from the trace; then each GPU applies the tick's frees
first and its allocations second, where the strategy's isolation model decides
what happens to an allocation that does not fit.

One file though over 500 lines: one tick loop (Replay) whose steps all read and change
the same replay state (queue, GPUs, running pods); apart, each step would take it whole.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from bench.packing.strategies import Strategy
from bench.packing.trace import HOUR_S, PodSpec, Trace

# Pods that wait longer than this in the admission queue are not served.
MAX_QUEUE_WAIT_S = 3600.0
# Batch jobs checkpoint this often (seconds of work); a crash loses work since the last one.
CHECKPOINT_S = 1800.0
# CrashLoopBackOff: 10 s doubling to 5 min, reset after 10 min of running.
BACKOFF_BASE_S, BACKOFF_MAX_S, BACKOFF_RESET_S = 10.0, 300.0, 600.0
_EPS = 1e-6


@dataclass
class Running:
    """A pod admitted to a GPU, and what it holds there now."""

    spec: PodSpec
    gpu: int
    reserved: float  # GiB of the GPU's allocatable it has a claim on (its request)
    limit: float
    admitted_tick: int
    held: float = 0.0  # GiB in GPU memory now
    swapped: float = 0.0  # GiB moved to host RAM
    target: float = 0.0  # what it wants on the GPU this tick (demand, capped at limit)
    demand: float = 0.0  # what it wants this tick, wherever its memory lives
    active: bool = True
    idle_ticks: int = 0
    down_until: int = -1  # crashed or evicted: restarting until this tick
    up_since: int = 0
    backoff_n: int = 0
    # A killed notebook kernel holds nothing until its user comes back (next active stretch).
    lost_state: bool = False
    was_active: bool = True
    waiting: bool = False  # a burst is blocked in the wait resolver
    starved: bool = False  # its bursts have been failing since it last got all it wanted
    progress_s: float = 0.0  # batch: work done
    checkpoint_s: float = 0.0
    disrupted: bool = False

    @property
    def down(self) -> bool:
        return self.down_until >= 0

    @property
    def claim(self) -> float:
        """What the pod takes out of a GPU's burst pool: its guarantee, or more if bursting."""
        return max(self.reserved, self.held)

    @property
    def burst(self) -> float:
        return max(0.0, self.held - self.reserved)


class Event(NamedTuple):
    """Something that happened to a pod; `gib` is the burst it held when evicted or swapped."""

    tick: int
    what: str
    pod: str
    by: str = ""
    gib: float = 0.0


@dataclass
class Result:
    """Counters for one strategy; to_json() gives the report's keys."""

    strategy: str
    pods_submitted: int = 0
    pods_served: int = 0
    queue_delay_s: list[float] = field(default_factory=list)
    oom_crashes: int = 0
    pods_disrupted: int = 0
    waits: int = 0
    waits_granted: int = 0
    burst_denied: int = 0
    evictions: int = 0
    evictions_for_guarantee: int = 0
    swaps: int = 0
    swap_ins: int = 0
    idle_reaped: int = 0
    resubmitted: int = 0
    batch_completed: int = 0
    batch_work_lost_s: float = 0.0
    queued_at_end: int = 0
    used_gib_s: float = 0.0
    active_used_gib_s: float = 0.0  # held by pods doing GPU work (not idle notebooks)
    demand_gib_s: float = 0.0
    unmet_gib_s: float = 0.0
    peak_running: int = 0
    horizon_s: float = 0.0
    total_gib: float = 0.0
    hourly_used_gib: list[float] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)

    def to_json(self) -> dict[str, object]:
        delays = self.queue_delay_s
        return {
            "pods_submitted": self.pods_submitted,
            "pods_served": self.pods_served,
            "pods_not_served": self.pods_submitted - self.pods_served,
            "memory_utilisation": round(self.used_gib_s / (self.total_gib * self.horizon_s), 4),
            "active_memory_utilisation": round(self.active_used_gib_s / (self.total_gib * self.horizon_s), 4),
            "peak_hour_utilisation": round(max(self.hourly_used_gib, default=0.0) / self.total_gib, 4),
            "demand_met": round(1 - self.unmet_gib_s / self.demand_gib_s, 4) if self.demand_gib_s else 1.0,
            "oom_crashes": self.oom_crashes,
            "pods_disrupted": self.pods_disrupted,
            "waits": self.waits,
            "waits_granted": self.waits_granted,
            "burst_denied": self.burst_denied,
            "evictions": self.evictions,
            "evictions_for_guarantee": self.evictions_for_guarantee,
            "swaps": self.swaps,
            "swap_ins": self.swap_ins,
            "idle_reaped": self.idle_reaped,
            "resubmitted": self.resubmitted,
            "batch_completed": self.batch_completed,
            "batch_work_lost_h": round(self.batch_work_lost_s / HOUR_S, 2),
            "mean_queue_delay_min": round(sum(delays) / len(delays) / 60, 1) if delays else 0.0,
            "max_queue_delay_min": round(max(delays) / 60, 1) if delays else 0.0,
            "queued_at_end": self.queued_at_end,
            "peak_running_pods": self.peak_running,
            "hourly_used_gib": [round(x, 1) for x in self.hourly_used_gib],
        }


Observer = Callable[[int, "Replay"], None]


class Replay:
    """One strategy replaying one trace. Call run() once."""

    def __init__(
        self,
        trace: Trace,
        strategy: Strategy,
        *,
        max_queue_wait_s: float = MAX_QUEUE_WAIT_S,
        observer: Observer | None = None,
    ) -> None:
        self.trace = trace
        self.strategy = strategy
        self.node = trace.node
        self.tick = trace.tick_s
        self.max_queue_wait_s = max_queue_wait_s
        self.observer = observer
        self.gpus: list[list[Running]] = [[] for _ in range(self.node.gpus)]
        self.host_swapped_gib = 0.0
        self.result = Result(strategy.name, horizon_s=trace.horizon_s, total_gib=self.node.total_gib)
        # Time-slicing's allocation order within a tick is arbitrary; seed it so replays repeat.
        self._rng = random.Random(trace.seed)
        self._future: list[tuple[float, int, PodSpec]] = [
            (p.arrival_s, i, p) for i, p in enumerate(trace.pods)
        ]
        heapq.heapify(self._future)
        self._seq = len(trace.pods)
        self._queue: list[tuple[float, int, PodSpec]] = []
        self._disrupted: set[str] = set()
        self.k = 0

    # ---- public -------------------------------------------------------------------------------
    def run(self) -> Result:
        r = self.result
        r.pods_submitted = sum(1 for p in self.trace.pods if not p.origin)
        hour_ticks = max(1, round(HOUR_S / self.tick))
        bucket = 0.0
        for k in range(self.trace.ticks):
            self.k = k
            self._arrivals()
            self._departures()
            if self.strategy.idle_reaping:
                self._reap_idle()
            self._admit()
            self._sample()
            for g in range(self.node.gpus):
                if self.strategy.isolated:
                    self._allocate_isolated(g)
                else:
                    self._allocate_blind(g)
            self._progress()
            used = sum(p.held for pods in self.gpus for p in pods)
            r.used_gib_s += used * self.tick
            r.active_used_gib_s += sum(p.held for pods in self.gpus for p in pods if p.active) * self.tick
            r.peak_running = max(r.peak_running, sum(len(pods) for pods in self.gpus))
            bucket += used
            if (k + 1) % hour_ticks == 0:
                r.hourly_used_gib.append(bucket / hour_ticks)
                bucket = 0.0
            if self.observer is not None:
                self.observer(k, self)
        r.queued_at_end = len(self._queue) + sum(1 for _, _, p in self._future if not p.origin)
        r.pods_disrupted = len(self._disrupted)
        return r

    def running(self) -> list[Running]:
        return [p for pods in self.gpus for p in pods]

    # ---- queue ----------------------------------------------------------------------------------
    def _now(self) -> float:
        return self.k * self.tick

    def _arrivals(self) -> None:
        while self._future and self._future[0][0] <= self._now() + _EPS:
            heapq.heappush(self._queue, heapq.heappop(self._future))

    def _place(self, spec: PodSpec) -> int | None:
        s, node = self.strategy, self.node
        want = s.reservation(spec, node)
        best: tuple[float, int] | None = None
        for g, pods in enumerate(self.gpus):
            if s.slots_per_gpu is not None and len(pods) >= s.slots_per_gpu:
                continue
            left = node.allocatable_gib - sum(self._admission_claim(p) for p in pods) - want
            if left < -_EPS:
                continue
            # Binpack (the agent's default policy) keeps big holes for big pods; spread
            # leaves every GPU room to burst. Time-slicing knows no memory: it spreads by count.
            if not s.isolated:
                key = (float(len(pods)), g)
            elif s.allocation_policy == "spread":
                key = (-left, g)
            else:
                key = (left, g)
            if best is None or key < best:
                best = key
        return None if best is None else best[1]

    @staticmethod
    def _admission_claim(p: Running) -> float:
        """What an admitted pod takes from a GPU's admittable memory. Burst memory of a pod
        that cannot be evicted (swap takes only idle pods) cannot be reclaimed for a
        newcomer's guarantee, so it counts as claimed until released."""
        if p.spec.preemptible:
            return p.reserved
        return p.claim

    def _admit(self) -> None:
        now, kept = self._now(), []
        # FIFO, but a pod that does not fit does not block the ones behind it (as the
        # kube-scheduler retries every pending pod).
        while self._queue:
            item = heapq.heappop(self._queue)
            arrival, _, spec = item
            if now - arrival > self.max_queue_wait_s + _EPS:
                self._event("not_served", spec.name)
                continue
            g = self._place(spec)
            if g is None:
                kept.append(item)
                continue
            pod = Running(
                spec,
                g,
                self.strategy.reservation(spec, self.node),
                self.strategy.limit(spec),
                self.k,
                up_since=self.k,
            )
            self.gpus[g].append(pod)
            self._event("admit", spec.name, f"gpu{g}")
            # Bursts may not live on a newcomer's guarantee (lendUnusedRequests off): take it back now.
            short = -self._burst_free(g)
            if short > _EPS:
                self._reclaim_for_guarantee(g, short, pod)
            if not spec.origin:
                self.result.pods_served += 1
                self.result.queue_delay_s.append(now - arrival)
        for item in kept:
            heapq.heappush(self._queue, item)

    def _departures(self) -> None:
        for pods in self.gpus:
            for p in list(pods):
                if p.spec.kind == "batch":
                    done = p.progress_s >= p.spec.duration_s - _EPS
                else:
                    done = (self.k - p.admitted_tick) * self.tick >= p.spec.duration_s - _EPS
                if done:
                    self._remove(p)
                    if p.spec.kind == "batch":
                        self.result.batch_completed += 1
                    self._event("done", p.spec.name)

    def _remove(self, p: Running) -> None:
        self.gpus[p.gpu].remove(p)
        self.host_swapped_gib -= p.swapped
        p.held = p.swapped = 0.0

    def _reap_idle(self) -> None:
        limit_ticks = self.strategy.idle_timeout_s / self.tick
        for p in self.running():
            if p.spec.kind != "notebook" or p.idle_ticks < limit_ticks:
                continue
            self._remove(p)
            self.result.idle_reaped += 1
            self._event("reaped", p.spec.name)
            self._resubmit(p)

    def _resubmit(self, p: Running) -> None:
        """The reaped notebook's user returns at the session's next active stretch."""
        spec = p.spec
        here = self.k - p.admitted_tick + spec.age_offset_ticks
        end = spec.age_offset_ticks + int(spec.duration_s / self.tick)
        nxt = next((j for j in range(here + 1, min(end, len(spec.active))) if spec.active[j]), None)
        if nxt is None:
            return
        origin = spec.origin or spec.name
        again = replace(
            spec,
            name=f"{origin}~{self._seq}",
            arrival_s=self._now() + (nxt - here) * self.tick,
            duration_s=spec.duration_s - (nxt - spec.age_offset_ticks) * self.tick,
            age_offset_ticks=nxt,
            origin=origin,
        )
        heapq.heappush(self._future, (again.arrival_s, self._seq, again))
        self._seq += 1
        self.result.resubmitted += 1

    # ---- demand -----------------------------------------------------------------------------------
    def _sample(self) -> None:
        r = self.result
        for p in self.running():
            if p.down and self.k >= p.down_until:
                p.down_until, p.up_since = -1, self.k
            age = int(p.progress_s / self.tick) if p.spec.kind == "batch" else self.k - p.admitted_tick
            demand, active = p.spec.sample(self.k, age)
            p.active = active
            p.idle_ticks = 0 if active else p.idle_ticks + 1
            if p.lost_state:
                if active and not p.was_active:
                    p.lost_state = False
                else:
                    demand = 0.0
            p.was_active = active
            p.demand = min(demand, p.limit)
            if p.down:
                p.target = 0.0
            elif p.swapped and not active:
                p.target = 0.0  # stays in host RAM until it does GPU work again
            elif not active:
                p.target = min(p.demand, p.held)  # an idle pod issues no GPU work, so no allocations
            else:
                if p.swapped:
                    self.host_swapped_gib -= p.swapped
                    p.swapped = 0.0
                    r.swap_ins += 1
                    self._event("swap_in", p.spec.name)
                p.target = p.demand
            r.demand_gib_s += p.demand * self.tick

    def _progress(self) -> None:
        r = self.result
        for p in self.running():
            # Memory an idle pod keeps in host RAM is not missing: it needs none on the GPU.
            have = p.held + (p.swapped if not p.active else 0.0)
            r.unmet_gib_s += max(0.0, p.demand - have) * self.tick
            if p.spec.kind == "batch" and not p.down:
                p.progress_s += self.tick
                if p.progress_s - p.checkpoint_s >= CHECKPOINT_S - _EPS:
                    p.checkpoint_s = p.progress_s

    # ---- memory -------------------------------------------------------------------------------------
    def _kill(self, p: Running, why: str, by: str = "") -> None:
        """The pod's processes die (OOM crash or eviction) and the kubelet restarts it."""
        if (self.k - p.up_since) * self.tick >= BACKOFF_RESET_S:
            p.backoff_n = 0
        backoff = min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2**p.backoff_n)
        p.backoff_n += 1
        p.down_until = self.k + max(1, math.ceil(backoff / self.tick))
        gib = p.burst
        p.held, p.target, p.waiting = 0.0, 0.0, False
        self.host_swapped_gib -= p.swapped
        p.swapped = 0.0
        if p.spec.kind == "batch":
            self.result.batch_work_lost_s += p.progress_s - p.checkpoint_s
            p.progress_s = p.checkpoint_s
        if p.spec.kind == "notebook":
            p.lost_state = True
        p.disrupted = True
        self._disrupted.add(p.spec.origin or p.spec.name)
        self._event(why, p.spec.name, by, gib)

    def _allocate_blind(self, g: int) -> None:
        """Time-slicing: no accounting; an allocation that does not fit kills its pod."""
        pods = self.gpus[g]
        for p in pods:
            p.held = min(p.held, p.target)
        growing = [p for p in pods if p.target > p.held + _EPS]
        self._rng.shuffle(growing)
        for p in growing:
            free = self.node.allocatable_gib - sum(q.held for q in pods)
            if p.target - p.held <= free + _EPS:
                p.held = p.target
            else:
                self.result.oom_crashes += 1
                self._kill(p, "oom_crash")

    def _burst_free(self, g: int) -> float:
        return self.node.allocatable_gib - sum(q.claim for q in self.gpus[g])

    def _swap_out(self, g: int, need: float, requester: Running) -> float:
        """Swap idle swappable burst holders to host RAM until `need` GiB of burst is freed."""
        freed = 0.0
        victims = [
            q
            for q in self.gpus[g]
            if q is not requester and not q.active and q.spec.swappable and q.burst > _EPS
        ]
        victims.sort(key=lambda q: (-q.idle_ticks, q.spec.name))
        for q in victims:
            if freed >= need - _EPS:
                break
            if self.host_swapped_gib + q.held > self.strategy.host_ram_budget_gib + _EPS:
                continue
            freed += q.burst
            self._event("swap_out", q.spec.name, requester.spec.name, q.burst)
            self.host_swapped_gib += q.held
            q.swapped, q.held = q.held, 0.0
            self.result.swaps += 1
        return freed

    def _evict(self, g: int, need: float, requester: Running, *, for_guarantee: bool) -> float:
        """Kill burst holders until `need` GiB of burst is freed. A burst may only take from
        lower-priority or long-idle pods; a guarantee outranks every burst."""
        freed = 0.0
        idle_ticks = self.strategy.evict_idle_threshold_s / self.tick
        victims = [
            q
            for q in self.gpus[g]
            if q is not requester
            and q.spec.preemptible
            and q.burst > _EPS
            and (for_guarantee or q.spec.priority < requester.spec.priority or q.idle_ticks > idle_ticks)
        ]
        victims.sort(key=lambda q: (q.spec.priority, -q.idle_ticks, -q.burst, q.spec.name))
        for q in victims:
            if freed >= need - _EPS:
                break
            freed += q.burst  # its request stays claimed: only the burst returns to the pool
            self.result.evictions += 1
            if for_guarantee:
                self.result.evictions_for_guarantee += 1
            self._kill(q, "evicted_for_guarantee" if for_guarantee else "evicted", requester.spec.name)
        return freed

    def _reclaim_for_guarantee(self, g: int, short: float, p: Running) -> None:
        """Burst grants are reclaimable and a guarantee outranks every burst: swap (if
        configured) and then evict burst holders, whatever their priority."""
        if "swap" in self.strategy.resolvers:
            short -= self._swap_out(g, short, p)
        if short > _EPS:
            self._evict(g, short, p, for_guarantee=True)

    def _allocate_isolated(self, g: int) -> None:
        """Accounted memory: guarantees always honoured, bursts only from unclaimed memory."""
        pods = self.gpus[g]
        s, r = self.strategy, self.result
        for p in pods:
            p.held = min(p.held, p.target)
        # A burst blocked in wait since last tick goes first (FIFO), then by priority.
        growing = [p for p in pods if p.target > p.held + _EPS]
        growing.sort(key=lambda p: (not p.waiting, -p.spec.priority, p.spec.name))
        for p in growing:
            if p.down:
                continue  # evicted earlier in this tick
            # The guarantee needs no check: claims never exceed allocatable (admission
            # reclaims, bursts come from unclaimed memory), so the GPU has room for every
            # pod's request beside everyone's use. The tests assert it on every tick.
            p.held = max(p.held, min(p.target, p.reserved))
            need = p.target - p.held
            if need <= _EPS:
                p.waiting = p.starved = False
                continue
            if p.waiting:
                # Its wait timed out: take what was freed meanwhile, else the allocation fails.
                grant = min(need, max(0.0, self._burst_free(g)))
                p.held += grant
                p.waiting = False
                if grant >= need - _EPS:
                    r.waits_granted += 1
                    p.starved = False
                else:
                    self._deny(p)
                continue
            short = need - max(0.0, self._burst_free(g))
            for resolver in s.resolvers:
                if short <= _EPS:
                    break
                if resolver == "swap":
                    short -= self._swap_out(g, short, p)
                elif resolver == "evict":
                    short -= self._evict(g, short, p, for_guarantee=False)
                elif resolver == "wait" and not p.starved:
                    # A pod already short of memory keeps retrying; count each episode once.
                    p.waiting = True
                    r.waits += 1
            p.held += min(need, max(0.0, self._burst_free(g)))
            if short <= _EPS:
                p.starved = False
            elif not p.waiting:
                self._deny(p)

    def _deny(self, p: Running) -> None:
        """CUDA_ERROR_OUT_OF_MEMORY on a burst: the app keeps running with what it holds."""
        if not p.starved:
            self.result.burst_denied += 1
            self._event("burst_denied", p.spec.name)
        p.starved = True

    def _event(self, what: str, pod: str, by: str = "", gib: float = 0.0) -> None:
        self.result.events.append(Event(self.k, what, pod, by, round(gib, 3)))


def replay(trace: Trace, strategy: Strategy, **kw: object) -> Result:
    return Replay(trace, strategy, **kw).run()  # type: ignore[arg-type]
