"""Collision resolvers: what the arbiter does when a burst needs more than is free.

The node config orders them (`resolvers: [swap, evict, wait]`); each one in the
list is on, each one left out is off. The chain asks them in order and stops as
soon as the need is met: after each resolver (and before the first) the arbiter
tries to grant, so memory freed by any means ends the chain.

Interface (for every resolver, gpufrac/agent/arbiter/swap/resolver.py included):

    class Resolver(Protocol):
        name: str
        async def resolve(self, need: Need) -> Outcome

`resolve` runs on the agent's event loop; blocking work goes to a thread. It
returns when it has done what it can (freed bytes, or nothing). Grants come only
from `need.try_grant()`, which grants only if the memory is really there (ledger
and NVML) and no request ranks ahead of it on the GPU (a waiter of higher
priority, or of equal priority that came first); the chain calls it before each
resolver and after the last. A resolver that frees memory for the need (evict,
swap) does so under `ctx.claim(need)` and calls `need.try_grant()` before the
claim ends: what it won goes to the requester that caused it first, then to the
queue. A resolver that cannot work on this node (no checkpoint API) returns
Outcome(available=False, ...) and the chain moves on; it should log that once,
not per request. A resolver that waits must honour `need.deadline` (loop time)
and give up by then.

What resolvers may ask of the arbiter is `ResolverContext` below (the resolution context,
arbiter/context.py, implements it and runs the chains until a need's deadline: `resolve_until`);
the chain the node config names is built by gpufrac.agent.arbiter.chain.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Protocol

from gpufrac.agent.arbiter.grants import ungranted
from gpufrac.agent.booking.ledger import ContainerAlloc
from gpufrac.agent.kube.events import (
    CONDITION_GPU_MEMORY_RECLAIMED,
    NORMAL,
    REASON_EVICTED,
    REASON_PREEMPTED,
    WARNING,
    Booked,
    container_name,
)
from gpufrac.agent.processes.kill import KillFailed
from gpufrac.core.units import format_bytes
from gpufrac.memguard.abi import FLAG_PREEMPTIBLE

log = logging.getLogger(__name__)


class Terms(Protocol):
    """How a kind of need is granted, and what others may be made to free for it
    (arbiter/context.py has one for bursts, swap-ins and reclaims)."""

    def try_grant(self, need: Need) -> bool: ...
    def shortfall(self, need: Need) -> int: ...


@dataclass
class Need:
    """A request the arbiter could not satisfy from free memory.

    `try_grant()` re-checks free memory and, if it now suffices, publishes the grant
    and returns True (idempotent once granted). `shortfall()` is how many more bytes
    resolvers may free on `gpu` by evicting or swapping others for that to happen (0 when
    it would fit now): what is missing less what hidden processes hold there
    (arbiter/context.py Resolution.coverable), which only their death frees. Both are its
    `terms`', which the context's need_* builders choose by kind."""

    requester: ContainerAlloc
    gpu: str
    bytes: int  # bytes the requester asked for beyond what it holds
    priority: int
    deadline: float  # loop.time() by which the requester gets an answer
    kind: str  # "burst", "reclaim" (an owner taking its lent guarantee back) or "swap-in"
    terms: Terms
    seq: int = 0  # arrival order (FIFO among equal priorities)
    # time.monotonic() when it came: how long it has been held back by requests ahead of it
    # (gpufrac.agent.arbiter.queue, the head-of-line bound)
    arrived: float = field(default_factory=time.monotonic)
    granted: bool = False
    notes: list[str] = field(default_factory=list)

    def try_grant(self) -> bool:
        return self.terms.try_grant(self)

    def shortfall(self) -> int:
        return self.terms.shortfall(self)

    def who(self) -> str:
        return self.requester.who()

    @property
    def order(self) -> tuple[int, int]:
        """Who is served first on a GPU: higher priority, then earlier arrival."""
        return (-self.priority, self.seq)


@dataclass
class Outcome:
    freed: int = 0  # bytes this resolver made free (estimate)
    satisfied: bool = False  # the need was granted while (or because) it ran
    available: bool = True  # False: the resolver cannot work here (chain moves on)
    detail: str = ""


class Resolver(Protocol):
    name: str

    async def resolve(self, need: Need) -> Outcome: ...


@dataclass(frozen=True)
class Holding:
    """A container's use of one GPU, as the arbiter sees it now."""

    alloc: ContainerAlloc
    used: int  # bytes the container's processes hold (usage file)
    request: int
    grant: int
    burst: int  # bytes held above the request: max(grant, used - request, 0)
    priority: int
    flags: int
    idle_s: float  # seconds since the container's last kernel launch
    # What the driver counted for it in both of its last two distinct readings (the smaller;
    # gpufrac.agent.arbiter.readings.DriverReadings.steady_used), 0 without two: what holding
    # memory above the request without a grant is judged on.
    steady: int = 0

    @property
    def preemptible(self) -> bool:
        return bool(self.flags & FLAG_PREEMPTIBLE)


class ResolverMetrics(Protocol):
    """Where resolvers count what they did (gpufrac.agent.metrics)."""

    def count_wait(self, container: ContainerAlloc, seconds: float) -> None: ...
    def count_eviction(self, container: ContainerAlloc) -> None: ...


class ResolverContext(Protocol):
    """What the arbiter offers resolvers (its resolution context, arbiter/context.py Resolution)."""

    evict_idle_threshold: float

    @property
    def metrics(self) -> ResolverMetrics: ...

    def holdings(self, gpu: str) -> list[Holding]: ...
    def claim(self, need: Need) -> AbstractContextManager[None]: ...
    async def wait_turn(self, need: Need) -> bool: ...
    async def second_reading(self) -> None: ...
    # How many processes were killed; KillFailed (with how many were) when its memory is not
    # known to be free (gpufrac.agent.processes.kill.kill_container).
    async def kill_container(self, alloc: ContainerAlloc) -> int: ...
    def revoke_burst(self, alloc: ContainerAlloc) -> None: ...
    def event(self, alloc: Booked, type_: str, reason: str, message: str) -> None: ...
    def disrupted(self, alloc: ContainerAlloc, reason: str, message: str) -> None: ...


class Chain:
    """The configured resolvers, in order."""

    def __init__(self, resolvers: Sequence[Resolver]) -> None:
        self.resolvers = list(resolvers)
        self._unavailable_logged: set[str] = set()

    @property
    def names(self) -> list[str]:
        return [r.name for r in self.resolvers]

    async def resolve(self, need: Need) -> bool:
        """True once the need was granted (by any resolver's effect)."""
        for r in self.resolvers:
            if need.granted or need.try_grant():
                return True
            if asyncio.get_running_loop().time() >= need.deadline:
                break
            try:
                out = await r.resolve(need)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("resolver %s failed on %s for %s", r.name, need.kind, need.who())
                continue
            if not out.available and r.name not in self._unavailable_logged:
                self._unavailable_logged.add(r.name)
                log.warning("resolver %s is unavailable on this node: %s", r.name, out.detail)
            if out.detail:
                need.notes.append(f"{r.name}: {out.detail}")
        return need.granted or need.try_grant()


class WaitResolver:
    """Blocks the request until enough is freed (the arbiter wakes waiters on every
    release, in priority then arrival order) or until its deadline."""

    name = "wait"

    def __init__(self, ctx: ResolverContext) -> None:
        self.ctx = ctx

    async def resolve(self, need: Need) -> Outcome:
        started = time.monotonic()
        ok = await self.ctx.wait_turn(need)
        self.ctx.metrics.count_wait(need.requester, time.monotonic() - started)
        return Outcome(satisfied=ok, detail="" if ok else "timed out waiting for memory to be freed")


class EvictResolver:
    """Kills the processes of containers that hold burst memory on the GPU, are
    preemptible and rank below the requester (lower priority; or equal priority and
    idle longer than evictIdleThreshold). Guaranteed memory is never counted as won:
    only the victims' burst bytes are (for a reclaim, what a victim holds past its limit
    too: the watchdog leaves it there in report mode).

    A guarantee outranks every burst, whatever its holder declared: for a reclaim (a
    container taking back memory within its request, kind "reclaim") a burst that is not
    preemptible is a victim too, after every preemptible one. `preemptible: "false"` shields
    a burst from other containers' bursts, never from a neighbour's guarantee (a burst is
    borrowed memory: the swap resolver, ahead in the chain when configured, may move a
    swappable one to host RAM first)."""

    name = "evict"

    def __init__(self, ctx: ResolverContext) -> None:
        self.ctx = ctx
        self._evicting: set[asyncio.Task[int | None]] = set()  # per-victim work, run to its end

    def victims(self, need: Need, *, latest: bool = False) -> list[Holding]:
        """Who may be evicted for `need`. A holder without a grant counts only if two distinct
        driver readings both show it above its request (`latest`: on the last reading alone,
        to tell whether a second reading could find more victims)."""
        out = []
        guarantee = need.kind == "reclaim"
        for h in self.ctx.holdings(need.gpu):
            if h.alloc.key == need.requester.key or h.burst <= 0:
                continue
            # No grant, yet above its request within its limit (the driver's count): memory
            # taken without asking is a burst like any other (gpufrac.agent.arbiter.grants), once
            # it has lasted two readings (a lazily loaded module spikes for a moment). Past its
            # limit too, for a guarantee: in report mode the watchdog leaves such memory where
            # it is, and a guarantee is kept in every mode (docs/watchdog.md, "Report mode").
            held = h.used if latest else h.steady
            limit = h.alloc.config.limit_bytes
            past_limit = guarantee and held > limit
            if h.grant <= 0 and ungranted(held, h.request, h.grant, limit) <= 0 and not past_limit:
                continue
            if not h.preemptible and not guarantee:
                continue
            if h.used <= h.request:
                continue  # holds a grant but uses only its guarantee: nothing to win by killing
            lower = h.priority < need.priority
            idle = h.priority == need.priority and h.idle_s >= self.ctx.evict_idle_threshold
            if lower or idle:
                out.append(h)
        # Preemptible ones first, then the lowest priority, the longest idle, the largest burst.
        out.sort(key=lambda h: (not h.preemptible, h.priority, -h.idle_s, -h.burst))
        return out

    async def resolve(self, need: Need) -> Outcome:
        missing = need.shortfall()
        if missing <= 0:
            return Outcome()
        victims = self.victims(need)
        if _won(victims) < missing and len(self.victims(need, latest=True)) > len(victims):
            # Some holder is above its request without a grant on one reading only: judge it
            # on a second, distinct one (the smaller of the two counts).
            await self.ctx.second_reading()
            missing = need.shortfall()
            if missing <= 0:
                return Outcome()  # the chain grants it next
            victims = self.victims(need)
        chosen, won = [], 0
        for h in victims:
            if won >= missing:
                break
            chosen.append(h)
            won += h.burst
        if won < missing:
            # Killing cannot free enough: kill nobody (a partial eviction helps no one).
            return Outcome(detail=f"preemptible lower-priority bursts hold {format_bytes(won)} < "
                                  f"{format_bytes(missing)} needed")  # fmt: skip
        freed, n, unfreed = 0, 0, 0
        # Nobody else is granted on the GPU until the requester has tried (ctx.claim).
        with self.ctx.claim(need):
            for h in chosen:
                # Shielded: a requester cancelled mid-kill (its deadline, a hang-up) must not
                # leave a victim killed but still charged, unreaped and unannounced.
                task = asyncio.ensure_future(self._evict(h, need))
                self._evicting.add(task)
                task.add_done_callback(self._evicting.discard)
                done = await asyncio.shield(task)
                if done is None:
                    break  # nobody was killed: nothing else to win from the others alone
                n += 1
                if done:
                    freed += h.burst
                else:
                    unfreed += 1  # killed, its memory not free yet: the next victim still goes
            satisfied = need.try_grant()
        if not n:
            return Outcome(detail="no victim could be evicted")
        late = f", {unfreed} of them not yet gone (memory not free yet)" if unfreed else ""
        return Outcome(freed=freed, satisfied=satisfied, detail=f"evicted {n} container(s){late}")

    async def _evict(self, h: Holding, need: Need) -> bool | None:
        """Kill one victim, take its burst back, count and announce it: True once its memory is
        free, False when processes were killed but some GPU process of it is not gone yet (slow
        to exit, or the agent unable to tell: announced all the same, for it was disrupted),
        None when nothing was killed (logged)."""
        late = ""
        try:
            killed = await self.ctx.kill_container(h.alloc)
        except KillFailed as e:
            if not e.signalled:
                log.error("evicting %s for %s failed: %s", h.alloc.who(), need.who(), e)
                return None
            killed, late = e.signalled, str(e)
            log.error("evicting %s for %s: %s", h.alloc.who(), need.who(), e)
        except Exception:
            log.exception("evicting %s for %s failed", h.alloc.who(), need.who())
            return None
        self.ctx.revoke_burst(h.alloc)
        self.ctx.metrics.count_eviction(h.alloc)
        if need.kind == "reclaim":
            why = "within its guarantee" + ("" if h.preemptible else ", which outranks any burst")
        elif h.priority < need.priority:
            why = f"priority {h.priority} < {need.priority}"
        else:
            why = f"idle {h.idle_s:.0f}s"
        message = (
            f"{killed} process(es) of container {container_name(h.alloc)} killed to reclaim "
            f"{format_bytes(h.burst)} of burst GPU memory on GPU {need.gpu}: {need.who()} needed "
            f"{format_bytes(need.bytes)} ({why})"
        )
        if late:
            message += f"; its memory is not free yet: {late}"
        self.ctx.event(h.alloc, WARNING, REASON_EVICTED, message)
        self.ctx.disrupted(h.alloc, CONDITION_GPU_MEMORY_RECLAIMED, message)
        self.ctx.event(
            need.requester,
            NORMAL,
            REASON_PREEMPTED,
            f"{format_bytes(h.burst)} of burst GPU memory on GPU {need.gpu} reclaimed from "
            f"{h.alloc.who()} for {format_bytes(need.bytes)} needed by this container ({why})",
        )
        log.warning("evicted %s (burst %s) for %s", h.alloc.who(), format_bytes(h.burst), need.who())
        return not late


def _won(victims: Sequence[Holding]) -> int:
    return sum(h.burst for h in victims)


def guarantee_chain(chain: Chain, ctx: ResolverContext) -> Chain:
    """The chain a guarantee is reclaimed with (gpufrac.agent.arbiter.admission.reclaim_guarantee):
    the configured one, with an evict step before `wait` when the node config left it out.
    `resolvers` says how burst collisions are settled; a guarantee is not a burst, and the
    bursts holding it must come back whatever the node or their holders declare."""
    if any(r.name == EvictResolver.name for r in chain.resolvers):
        return chain
    ahead = [r for r in chain.resolvers if r.name != WaitResolver.name]
    waits = [r for r in chain.resolvers if r.name == WaitResolver.name]
    return Chain([*ahead, EvictResolver(ctx), *waits])
