"""What the idle reaper does to a pod once its grace period is over (gpufrac.agent.idle.reaper).

`idle.action`: notify (an Event only), swap (the swap resolver moves the pod's GPU memory
to host RAM; unavailable -> said in the Event, notify instead), evict (the Eviction API, so
PodDisruptionBudgets hold; a refusal is reported and retried with back-off, never forced).
`idle.dryRun` records what would be done. Every action is recorded: an Event naming the
policy and its source, a count in gpufrac_idle_reaps_total{reason, action}.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

from gpufrac.agent.booking.ledger import ContainerAlloc
from gpufrac.agent.gpu.activity import Clock
from gpufrac.agent.idle.view import (
    MAX_RUNTIME,
    Identity,
    Pending,
    PodView,
    action_reason,
    action_words,
    policy_words,
    state_words,
)
from gpufrac.agent.kube import events
from gpufrac.agent.kube.evict import EvictOutcome, EvictResult
from gpufrac.agent.kube.objref import ObjectRef
from gpufrac.core.config import Config
from gpufrac.core.units import format_duration

log = logging.getLogger("gpufrac.agent.idle.reaper")

REASON_BLOCKED = events.REASON_IDLE_BLOCKED
REASON_FAILED = events.REASON_IDLE_FAILED
# Eviction retries: first after BACKOFF_MIN (or the interval, if longer), doubling up to BACKOFF_MAX.
BACKOFF_MIN = 0.5
BACKOFF_MAX = 300.0


class Evictor(Protocol):
    """How the reaper ends a pod (gpufrac.agent.kube.PodEvictor)."""

    async def evict(self, namespace: str, name: str, uid: str) -> EvictOutcome: ...


# Swap one container, saying why (for its Event): returns (done, what happened in words);
# raises SwapUnavailable when swapping cannot be had on this node at all.
Swapper = Callable[[ContainerAlloc, str], Awaitable[tuple[bool, str]]]


class SwapUnavailable(Exception):
    """Swapping to host RAM cannot be had on this node; the message says why."""


class SwapSupport(Protocol):
    @property
    def available(self) -> bool: ...
    @property
    def reason(self) -> str: ...


class SwapOut(Protocol):
    """What the reaper needs of the swap resolver (gpufrac.agent.arbiter.swap.resolver.SwapResolver)."""

    @property
    def in_chain(self) -> bool: ...
    async def detect(self) -> SwapSupport: ...
    async def swap_out(self, alloc: ContainerAlloc, reason: str) -> tuple[bool, str]: ...


class SwapProvider(Protocol):
    """The burst arbiter, as far as the reaper swaps through it: its swap resolver, if its
    resolvers list names one."""

    @property
    def swap(self) -> SwapOut | None: ...


class ReapCounter(Protocol):
    """Where the reaper's actions are counted (gpufrac.agent.metrics.Metrics)."""

    def count_reap(self, action: str, reason: str = "idle") -> None: ...


class IdleActions:
    """Carries out the reaper's decisions; `records` counts the action records by Event reason."""

    def __init__(
        self,
        cfg: Config,
        *,
        evictor: Evictor | None = None,
        swapper: Swapper | None = None,
        metrics: ReapCounter,
        clock: Clock,
    ) -> None:
        self.cfg = cfg
        self.evictor = evictor
        self.swapper = swapper
        self.metrics = metrics
        self.clock = clock
        # Counters (tests, status): action records by Event reason.
        self.records: dict[str, int] = {}

    async def act(self, view: PodView, ident: Identity | None, pending: Pending) -> None:
        """Take idle.action on a pod whose grace period is over (or record the dry run)."""
        cfg = self.cfg.idle
        trigger = pending.trigger
        what = state_words(view, trigger)
        if cfg.dry_run:
            text = f"dry run: would {action_words(cfg.action)} ({what}); nothing was changed"
            log.warning("pod %s: %s", view.who(), text)
            self.record(view, ident, trigger, "dry-run", "Normal", text)
            pending.done = True
            return
        if cfg.action == "notify":
            self.record(
                view, ident, trigger, "notify", "Warning", f"{what}; notified only (idle.action notify)"
            )
            pending.done = True
            return
        if cfg.action == "swap":
            await self._swap(view, ident, pending, what)
            return
        await self._evict(view, ident, pending, what)

    async def _swap(self, view: PodView, ident: Identity | None, pending: Pending, what: str) -> None:
        pending.done = True  # once per episode, whatever happens
        if pending.trigger == MAX_RUNTIME:
            why = "swapping does not end a pod's runtime"
        elif self.swapper is None:
            why = "swap to host RAM is unavailable on this node (no swap resolver)"
        else:
            results = []
            try:
                for alloc in view.allocs:
                    try:
                        results.append(await self.swapper(alloc, f"idle reaper, {what}"))
                    except SwapUnavailable:
                        raise
                    except Exception as e:  # the swap resolver failing must not stop the reaper
                        results.append((False, f"{type(e).__name__}: {e}"))
            except SwapUnavailable as e:
                why = f"swap to host RAM is unavailable on this node ({e})"
            else:
                if all(ok for ok, _ in results):
                    done = "; ".join(msg for _, msg in results if msg) or "GPU memory swapped to host RAM"
                    self.record(view, ident, pending.trigger, "swap", "Warning", f"{what}; {done}")
                    return
                why = "swap to host RAM failed: " + "; ".join(msg for ok, msg in results if not ok)
        log.warning("pod %s: %s; notifying instead", view.who(), why)
        self.record(view, ident, pending.trigger, "notify", "Warning", f"{what}; {why}, notified only")

    async def _evict(self, view: PodView, ident: Identity | None, pending: Pending, what: str) -> None:
        now = self.clock.monotonic()
        if self.evictor is None:
            pending.done = True
            self.record(
                view,
                ident,
                pending.trigger,
                "notify",
                "Warning",
                f"{what}; no apiserver to evict through, notified only",
            )
            return
        pending.attempts += 1
        out = await self.evictor.evict(view.key.namespace, view.key.name, view.key.uid)
        if out.result in (EvictResult.EVICTED, EvictResult.DELETED):
            pending.done = pending.ended = True
            done = "evict" if out.result is EvictResult.EVICTED else "delete"
            how = (
                "evicted through the Eviction API"
                if done == "evict"
                else f"deleted ({out.detail}; idle.allowDelete)"
            )
            log.warning("pod %s: %s: %s", view.who(), what, how)
            self.record(view, ident, pending.trigger, done, "Warning", f"{what}; {how}")
            return
        if out.result is EvictResult.GONE:
            pending.done = pending.ended = True
            log.info("pod %s: already gone (%s)", view.who(), out.detail)
            return
        delay = min(BACKOFF_MAX, max(BACKOFF_MIN, self.cfg.idle.interval) * 2 ** (pending.attempts - 1))
        if out.retry_after:
            delay = max(delay, out.retry_after)
        pending.next_try = now + delay
        # Stable messages (no running durations), so the recorder aggregates the retries
        # into one Event's count.
        policy = policy_words(view, pending.trigger)
        if out.result is EvictResult.BLOCKED:
            text = (
                f"eviction refused: {out.detail}; retrying with back-off, never forcing past a "
                f"PodDisruptionBudget ({policy})"
            )
            reason = REASON_BLOCKED
        else:
            hint = (
                "" if out.result is EvictResult.FAILED else "; set idle.allowDelete to delete pods directly"
            )
            text = f"eviction failed: {out.detail}{hint}; retrying with back-off ({policy})"
            reason = REASON_FAILED
        log.warning(
            "pod %s: %s (attempt %d, next in %s)", view.who(), text, pending.attempts, format_duration(delay)
        )
        self.event(view, ident, "Warning", reason, text)

    # -- records ----------------------------------------------------------------------------------

    def record(
        self, view: PodView, ident: Identity | None, trigger: str, done: str, type_: str, text: str
    ) -> None:
        reason = action_reason(trigger, done)
        self.records[reason] = self.records.get(reason, 0) + 1
        self.metrics.count_reap(done.replace("-", "_"), trigger.replace("-", "_"))
        self.event(view, ident, type_, reason, text)

    def event(self, view: PodView, ident: Identity | None, type_: str, reason: str, message: str) -> None:
        sink = ident.events if ident is not None else None
        if sink is None:
            return
        if view.info is not None:
            ref = ObjectRef.pod(view.info)
        else:
            ref = ObjectRef.pod_named(view.key.namespace, view.key.name, view.key.uid)
        sink.record(ref, type_, reason, message)


# -- swapping through the arbiter ------------------------------------------------------------------------


async def swap_via(arbiter: SwapProvider | None, alloc: ContainerAlloc, reason: str) -> tuple[bool, str]:
    """Swap one container out through the arbiter's swap resolver (gpufrac.agent.arbiter.swap.resolver); the
    reaper's Swapper as the composition root wires it."""
    if arbiter is None:
        raise SwapUnavailable("the burst arbiter is not running")
    resolver = arbiter.swap
    if resolver is None or not resolver.in_chain:
        raise SwapUnavailable("the swap resolver is not in the resolvers list")
    support = await resolver.detect()
    if not support.available:
        raise SwapUnavailable(support.reason)
    return await resolver.swap_out(alloc, reason)
