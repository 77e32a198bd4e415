"""The idle reaper: gives the GPU back from interactive pods that hold it doing nothing.

Every `idle.interval` it polls the activity tracker (gpufrac.agent.gpu.activity) and
judges each pod that holds gpufrac devices. Whole pods are judged, since a pod is
what gets evicted: a pod is idle for as long as its least idle container.

Who may be reaped: pods of class `interactive` (gpufrac.dev/workload-class), and
of the classes listed in `idle.reapClasses`; never a pod in `idle.exemptNamespaces`
or annotated gpufrac.dev/idle-exempt: "true"; never a pod whose annotations are not
known yet (its class is unknown). In DRA mode a claim's booking is judged as its first
pod's (its class and timeouts from the claim's parameters), and a claim several pods
share is never reaped.

When, per pod (annotation first, node config second; docs/design.md section 1):
* idle: no GPU work for `idle-timeout` -> Warning Event IdleWarning, then after
  `idle.gracePeriod` the action. GPU work during the grace period cancels it
  (Normal Event IdleCancelled). So an idle pod is acted on after timeout + grace,
  and never before its own timeout.
* max-runtime: allocated longer than `max-runtime` -> Warning Event
  MaxRuntimeWarning `idle.gracePeriod` before the limit, the action AT the limit.
  Work does not cancel it: the limit is on runtime, not idleness. A pod the reaper
  first meets inside that window or past its limit (agent restart, a limit just set
  or lowered) still gets the whole `idle.gracePeriod` between warning and action.
  An action that leaves the pod running (notify, swap, dry run) is taken once per
  limit; from then on the pod is judged for idleness like any other.

Actions (`idle.action`, carried out by gpufrac.agent.idle.actions): notify (an Event
only), swap (the swap resolver moves the pod's GPU memory to host RAM; unavailable -> said
in the Event, notify instead), evict (the Eviction API, so PodDisruptionBudgets hold; a
plain delete only with `idle.allowDelete` and only when the Eviction API itself is
unusable). A refusal by a PodDisruptionBudget (HTTP 429) is reported (IdleEvictionBlocked)
and retried with back-off, never forced. `idle.dryRun` posts the Events and logs what it
would do, and changes nothing.

Every action leaves an Event naming idle time, runtime, the policy and its source,
and the action (reason Idle<Action> / MaxRuntime<Action>), and counts in
gpufrac_idle_reaps_total{reason, action}.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from dataclasses import replace

from gpufrac.agent.booking.ledger import ContainerAlloc, Ledger
from gpufrac.agent.gpu.activity import ActivityTracker, Clock
from gpufrac.agent.idle.actions import Evictor, IdleActions, ReapCounter, Swapper
from gpufrac.agent.idle.view import (
    IDLE,
    MAX_RUNTIME,
    Identity,
    Pending,
    PodKey,
    PodView,
    action_noun,
    action_words,
    policy_words,
)
from gpufrac.agent.kube import events
from gpufrac.core import annotations as annotations_mod
from gpufrac.core.annotations import ContainerPolicy
from gpufrac.core.config import Config
from gpufrac.core.units import format_duration

log = logging.getLogger(__name__)

REASON_WARNING = {IDLE: events.REASON_IDLE_WARNING, MAX_RUNTIME: events.REASON_MAX_RUNTIME_WARNING}
REASON_CANCELLED = events.REASON_IDLE_CANCELLED


def _most_lenient(seconds: Iterable[float]) -> float:
    """The most lenient of some idle-timeouts or max-runtimes: 0 (off) before any limit."""
    values = list(seconds)
    return 0.0 if any(v <= 0 for v in values) else max(values)


class IdleReaper:
    def __init__(
        self,
        cfg: Config,
        ledger: Ledger,
        tracker: ActivityTracker,
        identity: Identity | None,
        *,
        evictor: Evictor | None = None,
        swapper: Swapper | None = None,
        metrics: ReapCounter,
        clock: Clock | None = None,
    ) -> None:
        self.cfg = cfg
        self.ledger = ledger
        self.tracker = tracker
        self.identity = identity
        self.clock = clock or tracker.clock
        self.actions = IdleActions(cfg, evictor=evictor, swapper=swapper, metrics=metrics, clock=self.clock)
        self.pending: dict[PodKey, Pending] = {}
        # Pods a max-runtime action left running (notify, swap, dry run) -> the limit it was for:
        # that limit is not acted on again, and the pod's idleness is judged from then on.
        self.runtime_done: dict[PodKey, float] = {}
        # clock.monotonic() of the latest pass and of the one before it (None: none yet).
        self._last_pass: float | None = None
        self._prev_pass: float | None = None

    @property
    def records(self) -> dict[str, int]:
        """Action records by Event reason (tests, status)."""
        return self.actions.records

    # -- loop -------------------------------------------------------------------------------------

    async def run(self) -> None:
        """Poll and judge every `idle.interval` until cancelled."""
        while True:
            try:
                await self.tick()
            except Exception:
                log.exception("idle reaper pass failed")
            await asyncio.sleep(self.cfg.idle.interval)

    async def tick(self) -> list[PodView]:
        """One pass: refresh activity, judge every pod. Returns the pods judged."""
        allocs = self.ledger.containers()
        await self.tracker.poll(allocs, self.container_ids(allocs))
        self._prev_pass, self._last_pass = self._last_pass, self.clock.monotonic()
        if not self.cfg.idle.enabled:
            self.pending.clear()
            self.runtime_done.clear()
            return []
        ident = self.identity
        views = self.pods(allocs, ident)
        seen = set()
        for view in views:
            seen.add(view.key)
            try:
                await self._judge(view, ident)
            except Exception:
                log.exception("idle reaper: judging pod %s failed", view.who())
        for key in set(self.pending) - seen:
            del self.pending[key]  # the pod is gone (evicted, deleted) or no longer ours
        for key in set(self.runtime_done) - seen:
            del self.runtime_done[key]
        return views

    def container_ids(self, allocs: Iterable[ContainerAlloc]) -> dict[str, frozenset[str]]:
        """Container key -> the container IDs its pod's status names for it (pod cache): the
        tracker credits the driver's samples of a process to a container only if the
        process's cgroup names one of them (gpufrac.agent.gpu.activity)."""
        pods = self.identity.pods if self.identity is not None else None
        out: dict[str, frozenset[str]] = {}
        for a in allocs:
            info = pods.get(a.namespace, a.pod) if pods is not None and a.namespace and a.pod else None
            if info is not None and info.uid == a.pod_uid:
                out[a.key] = frozenset(cid for cid, name in info.container_ids.items() if name == a.container)
        return out

    def pods(self, allocs: Iterable[ContainerAlloc], ident: Identity | None) -> list[PodView]:
        """Group allocations by pod; pods whose identity or policy is unknown are left out."""
        if ident is None:
            return []
        now_wall = self.clock.time()
        now = self.clock.monotonic()
        grouped: dict[PodKey, list[tuple[ContainerAlloc, ContainerPolicy]]] = {}
        for a in allocs:
            policy = ident.policy(a.key)
            if not (a.namespace and a.pod) or policy is None or not policy.pod_known:
                continue
            grouped.setdefault(PodKey(a.namespace, a.pod, a.pod_uid or ""), []).append((a, policy))
        pods = ident.pods
        out = []
        for key, members in grouped.items():
            idles = []
            for a, _ in members:
                act = self.tracker.get(a.key)
                # Booked since the last poll: not judged before the tracker has seen it.
                idles.append(0.0 if act is None else act.idle_seconds(now))
            # One policy per pod (annotations are pod-level); on any mismatch the most lenient
            # idle-timeout and max-runtime win, each on its own, 0 (off) being the most lenient.
            policies = [p for _, p in members]
            policy = replace(
                policies[0],
                idle_timeout=_most_lenient(p.idle_timeout for p in policies),
                max_runtime=_most_lenient(p.max_runtime for p in policies),
            )
            out.append(
                PodView(
                    key=key,
                    allocs=[a for a, _ in members],
                    policy=policy,
                    info=pods.get(key.namespace, key.name) if pods is not None else None,
                    idle_s=min(idles),
                    runtime_s=max(0.0, now_wall - min(a.created for a, _ in members)),
                )
            )
        return out

    def exempt(self, view: PodView) -> str | None:
        """Why this pod is never reaped (None if it may be)."""
        p = view.policy
        if view.key.namespace in self.cfg.idle.exempt_namespaces:
            return f"namespace {view.key.namespace} is exempt (idle.exemptNamespaces)"
        if p.idle_exempt:
            return f'annotation {annotations_mod.IDLE_EXEMPT}="true"'
        if p.workload_class != "interactive" and p.workload_class not in self.cfg.idle.reap_classes:
            return f"class {p.workload_class} is not reaped (idle.reapClasses)"
        if view.info is not None and view.info.deleting:
            return "the pod is being deleted"
        shared = [a for a in view.allocs if a.claim is not None and len({u for u, _ in a.consumers}) > 1]
        if shared:  # its idleness is several pods', and acting on one would cost the others
            return f"{shared[0].who()} is shared by several pods"
        return None

    # -- judging ----------------------------------------------------------------------------------

    async def _judge(self, view: PodView, ident: Identity | None) -> None:
        now = self.clock.monotonic()
        grace = self.cfg.idle.grace_period
        p = view.policy
        pending = self.pending.get(view.key)
        why_not = self.exempt(view)
        if why_not is not None:
            if pending is not None:
                del self.pending[view.key]
                if not pending.done:
                    self.actions.event(
                        view, ident, "Normal", REASON_CANCELLED, f"idle reaping cancelled: {why_not}"
                    )
            return
        trigger: str | None = None
        if (
            p.max_runtime > 0
            and view.runtime_s >= p.max_runtime - grace
            and self.runtime_done.get(view.key) != p.max_runtime
        ):
            trigger = MAX_RUNTIME
        elif p.idle_timeout > 0 and view.idle_s >= p.idle_timeout:
            trigger = IDLE
        if pending is not None and pending.trigger != trigger:
            # The episode is over: GPU work resumed, or the policy changed.
            del self.pending[view.key]
            if not pending.done and trigger is None:
                noun = action_noun(self.cfg.idle.action)
                if pending.trigger == IDLE:
                    text = f"GPU work resumed; the pending {noun} is cancelled ({policy_words(view, IDLE)})"
                else:
                    text = f"max-runtime changed; the pending {noun} is cancelled"
                log.info("pod %s: %s", view.who(), text)
                self.actions.event(view, ident, "Normal", REASON_CANCELLED, text)
            pending = None
        if trigger is None:
            return
        if pending is None:
            left = grace if trigger == IDLE else self._runtime_left(view, now)
            pending = self.pending[view.key] = Pending(trigger, due=now + left)
            self._warn(view, ident, pending, left)
        if pending.done or now < pending.due or now < pending.next_try:
            return
        await self.actions.act(view, ident, pending)
        if pending.trigger == MAX_RUNTIME and pending.done and not pending.ended:
            # The pod runs on past its limit: that limit is done with, and only idleness may
            # call for the action from now on.
            del self.pending[view.key]
            self.runtime_done[view.key] = p.max_runtime

    def _runtime_left(self, view: PodView, now: float) -> float:
        """Seconds from a MaxRuntimeWarning to its action: to the limit, when the warning comes
        in time; the whole grace period for a pod met inside the warning window or past its
        limit (it was there at the previous pass already, or there was none)."""
        grace = self.cfg.idle.grace_period
        left = view.policy.max_runtime - view.runtime_s
        prev = self._prev_pass
        late = prev is None or view.runtime_s - (now - prev) >= view.policy.max_runtime - grace
        return grace if late or left <= 0 else left

    def _warn(self, view: PodView, ident: Identity | None, pending: Pending, left: float) -> None:
        dry = "dry run: " if self.cfg.idle.dry_run else ""
        will = action_words(self.cfg.idle.action)
        if pending.trigger == IDLE:
            text = (
                f"{dry}no GPU work for {format_duration(view.idle_s)} ({policy_words(view, IDLE)}): "
                f"will {will} in {format_duration(left)} unless GPU work resumes"
            )
        else:
            policy = policy_words(view, MAX_RUNTIME)
            text = (
                f"{dry}running for {format_duration(view.runtime_s)} ({policy}): "
                f"will {will} in {format_duration(left)}"
            )
        log.warning("pod %s: %s", view.who(), text)
        self.actions.event(view, ident, "Warning", REASON_WARNING[pending.trigger], text)


def describe(cfg: Config) -> str:
    """The reaper's settings in words, for the agent's start log."""
    timeout = format_duration(cfg.idle.idle_timeout) if cfg.idle.idle_timeout else "off"
    dry = ", dry run" if cfg.idle.dry_run else ""
    classes = "".join(f", {c}" for c in cfg.idle.reap_classes)
    return (
        f"idle reaper: {cfg.idle.action} after idle-timeout {timeout} + grace "
        f"{format_duration(cfg.idle.grace_period)}{dry} (classes interactive{classes})"
    )
