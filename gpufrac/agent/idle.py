"""The idle reaper: gives the GPU back from interactive pods that hold it doing nothing.

Every `idle.interval` it polls the activity tracker (gpufrac.agent.activity) and
judges each pod that holds gpufrac devices. Whole pods are judged, since a pod is
what gets evicted: a pod is idle for as long as its least idle container.

Who may be reaped: pods of class `interactive` (gpufrac.dev/workload-class), and
of the classes listed in `idle.reapClasses`; never a pod in `idle.exemptNamespaces`
or annotated gpufrac.dev/idle-exempt: "true"; never a pod whose annotations are not
known yet (its class is unknown).

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

Actions (`idle.action`): notify (an Event only), swap (the swap resolver moves the
pod's GPU memory to host RAM; unavailable -> said in the Event, notify instead),
evict (the Eviction API, so PodDisruptionBudgets hold; a plain delete only with
`idle.allowDelete` and only when the Eviction API itself is unusable). A refusal
by a PodDisruptionBudget (HTTP 429) is reported (IdleEvictionBlocked) and retried
with back-off, never forced. `idle.dryRun` posts the Events and logs what it
would do, and changes nothing.

Every action leaves an Event naming idle time, runtime, the policy and its source,
and the action (reason Idle<Action> / MaxRuntime<Action>), and counts in
gpufrac_idle_reaps_total{reason, action}.
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any, Protocol

from kubernetes import client
from kubernetes.client.rest import ApiException

from gpufrac.agent import annotations, events
from gpufrac.agent import metrics as metrics_mod
from gpufrac.agent.activity import ActivityTracker, Clock
from gpufrac.agent.allocations import ContainerAlloc, Ledger
from gpufrac.agent.annotations import ContainerPolicy
from gpufrac.agent.config import Config
from gpufrac.agent.kube import ObjectRef, PodInfo, make_api_client
from gpufrac.agent.units import format_duration, parse_duration

log = logging.getLogger(__name__)

IDLE, MAX_RUNTIME = "idle", "max-runtime"
REASON_WARNING = {IDLE: events.REASON_IDLE_WARNING, MAX_RUNTIME: events.REASON_MAX_RUNTIME_WARNING}
REASON_CANCELLED = events.REASON_IDLE_CANCELLED
REASON_BLOCKED = events.REASON_IDLE_BLOCKED
REASON_FAILED = events.REASON_IDLE_FAILED
# Event reason of the action record: prefix by trigger, suffix by what was done.
_PREFIX = dict(zip((IDLE, MAX_RUNTIME), events.IDLE_TRIGGERS, strict=True))
_DONE = dict(zip(("notify", "swap", "evict", "delete", "dry-run"), events.IDLE_ACTIONS, strict=True))
# Eviction retries: first after BACKOFF_MIN (or the interval, if longer), doubling up to BACKOFF_MAX.
BACKOFF_MIN = 0.5
BACKOFF_MAX = 300.0


def action_reason(trigger: str, done: str) -> str:
    """The Event reason recording an action: IdleEvicted, MaxRuntimeNotify, IdleDryRun…"""
    return _PREFIX[trigger] + _DONE[done]


def _most_lenient(seconds: Iterable[float]) -> float:
    """The most lenient of some idle-timeouts or max-runtimes: 0 (off) before any limit."""
    values = list(seconds)
    return 0.0 if any(v <= 0 for v in values) else max(values)


# -- eviction ------------------------------------------------------------------------------------------


class EvictResult(enum.Enum):
    EVICTED = "evicted"
    DELETED = "deleted"
    GONE = "gone"  # the pod (with that uid) no longer exists
    BLOCKED = "blocked"  # 429: a PodDisruptionBudget refuses it now
    UNAVAILABLE = "unavailable"  # the Eviction API cannot be used (missing, forbidden)
    FAILED = "failed"  # anything else; retried


@dataclass(frozen=True)
class EvictOutcome:
    result: EvictResult
    detail: str = ""
    retry_after: float | None = None


def _status_detail(e: ApiException) -> tuple[str, float | None]:
    """The apiserver's message (with its causes) and retry hint from an error response."""
    try:
        body = json.loads(e.body or "{}")
    except (TypeError, ValueError):
        body = {}
    if not isinstance(body, dict):
        body = {}
    message = str(body.get("message") or e.reason or f"HTTP {e.status}")
    details = body.get("details") if isinstance(body.get("details"), dict) else {}
    causes = [
        str(c.get("message")) for c in details.get("causes") or [] if isinstance(c, dict) and c.get("message")
    ]
    if causes:
        message += " (" + "; ".join(causes) + ")"
    retry: float | None = None
    raw = details.get("retryAfterSeconds") or (e.headers or {}).get("Retry-After")
    try:
        retry = float(raw) if raw else None
    except (TypeError, ValueError):
        retry = None
    return message, retry


class PodEvictor:
    """Evicts pods through the policy/v1 Eviction subresource (PodDisruptionBudgets hold).
    The reaper's own apiserver calls; everything else the agent asks the apiserver goes
    through gpufrac.agent.kube.

    A plain DELETE is used only when `allow_delete` is set AND the Eviction API itself
    is unusable (not served, forbidden); a PodDisruptionBudget's 429 is never
    answered with a delete. Every call carries the pod's uid as a precondition, so a
    new pod that took the same name is never hit. Blocking calls run in a thread."""

    def __init__(
        self, api: client.ApiClient, *, allow_delete: bool = False, request_timeout: float = 10.0
    ) -> None:
        self._v1 = client.CoreV1Api(api)
        self.allow_delete = allow_delete
        self._timeout = request_timeout

    async def evict(self, namespace: str, name: str, uid: str) -> EvictOutcome:
        outcome = await asyncio.to_thread(self._evict, namespace, name, uid)
        if outcome.result is EvictResult.UNAVAILABLE and self.allow_delete:
            return await asyncio.to_thread(self._delete, namespace, name, uid, outcome.detail)
        return outcome

    def _evict(self, namespace: str, name: str, uid: str) -> EvictOutcome:
        body: dict[str, Any] = {
            "apiVersion": "policy/v1",
            "kind": "Eviction",
            "metadata": {"name": name, "namespace": namespace},
        }
        if uid:
            body["deleteOptions"] = {"preconditions": {"uid": uid}}
        try:
            self._v1.create_namespaced_pod_eviction(
                name, namespace, body, _preload_content=False, _request_timeout=self._timeout
            )
        except ApiException as e:
            detail, retry = _status_detail(e)
            if e.status == 429:
                return EvictOutcome(EvictResult.BLOCKED, detail, retry)
            if e.status == 409:  # the uid precondition failed: another pod has the name now
                return EvictOutcome(EvictResult.GONE, detail)
            if e.status == 404:
                # The pod is gone, or the apiserver does not serve the subresource: ask which.
                return self._missing(namespace, name, uid, detail)
            if e.status in (403, 405):
                return EvictOutcome(EvictResult.UNAVAILABLE, f"Eviction API: HTTP {e.status} {detail}")
            return EvictOutcome(EvictResult.FAILED, f"HTTP {e.status} {detail}", retry)
        except Exception as e:  # connection refused, timeouts
            return EvictOutcome(EvictResult.FAILED, f"{type(e).__name__}: {e}")
        return EvictOutcome(EvictResult.EVICTED)

    def _missing(self, namespace: str, name: str, uid: str, detail: str) -> EvictOutcome:
        try:
            resp = self._v1.read_namespaced_pod(
                name, namespace, _preload_content=False, _request_timeout=self._timeout
            )
            pod = json.loads(resp.data)
        except ApiException as e:
            if e.status == 404:
                return EvictOutcome(EvictResult.GONE, detail)
            return EvictOutcome(EvictResult.FAILED, f"HTTP {e.status} {e.reason}")
        except Exception as e:
            return EvictOutcome(EvictResult.FAILED, f"{type(e).__name__}: {e}")
        if uid and (pod.get("metadata") or {}).get("uid") not in (None, uid):
            return EvictOutcome(EvictResult.GONE, "a new pod has the name")
        return EvictOutcome(EvictResult.UNAVAILABLE, f"Eviction API not served: {detail}")

    def _delete(self, namespace: str, name: str, uid: str, why: str) -> EvictOutcome:
        body = {"preconditions": {"uid": uid}} if uid else {}
        try:
            self._v1.delete_namespaced_pod(
                name, namespace, body=body, _preload_content=False, _request_timeout=self._timeout
            )
        except ApiException as e:
            if e.status in (404, 409):
                return EvictOutcome(EvictResult.GONE, _status_detail(e)[0])
            return EvictOutcome(EvictResult.FAILED, f"delete: HTTP {e.status} {_status_detail(e)[0]}")
        except Exception as e:
            return EvictOutcome(EvictResult.FAILED, f"delete: {type(e).__name__}: {e}")
        return EvictOutcome(EvictResult.DELETED, why)


class Evictor(Protocol):
    async def evict(self, namespace: str, name: str, uid: str) -> EvictOutcome: ...


# -- what the reaper reads from the rest of the agent ----------------------------------------------------


class PodSource(Protocol):
    def get(self, namespace: str, name: str) -> PodInfo | None: ...


class EventSink(Protocol):
    def record(self, ref: ObjectRef, type_: str, reason: str, message: str) -> None: ...


class Identity(Protocol):
    """What the reaper needs of gpufrac.agent.identity.PodIdentity."""

    pods: Any  # PodSource | None
    events: Any  # EventSink | None

    def policy(self, key: str) -> ContainerPolicy | None: ...


# Swap one container, saying why (for its Event): returns (done, what happened in words);
# raises SwapUnavailable when swapping cannot be had on this node at all.
Swapper = Callable[[ContainerAlloc, str], Awaitable[tuple[bool, str]]]


class SwapUnavailable(Exception):
    """Swapping to host RAM cannot be had on this node; the message says why."""


class ReapCounter(Protocol):
    """gpufrac.agent.metrics' counting API (a Metrics, or the module itself)."""

    def count_reap(self, action: str, reason: str = "idle") -> None: ...


# -- the reaper -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PodKey:
    namespace: str
    name: str
    uid: str


@dataclass
class PodView:
    """One pod as the reaper judges it this tick."""

    key: PodKey
    allocs: list[ContainerAlloc]
    policy: ContainerPolicy
    info: PodInfo | None
    idle_s: float
    runtime_s: float

    def who(self) -> str:
        return f"{self.key.namespace}/{self.key.name}"


@dataclass
class Pending:
    """A warned pod, waiting for its grace period (or acted on, once per episode)."""

    trigger: str  # IDLE or MAX_RUNTIME
    due: float  # clock.monotonic() when the action is taken
    done: bool = False  # acted (or reported) for this episode
    ended: bool = False  # the action ended the pod (evicted, deleted, gone)
    attempts: int = 0  # eviction attempts
    next_try: float = 0.0


class IdleReaper:
    def __init__(
        self,
        cfg: Config,
        ledger: Ledger,
        tracker: ActivityTracker,
        identity: Callable[[], Identity | None],
        *,
        evictor: Evictor | None = None,
        swapper: Swapper | None = None,
        metrics: ReapCounter | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.cfg = cfg
        self.ledger = ledger
        self.tracker = tracker
        self._identity = identity
        self.evictor = evictor
        self.swapper = swapper
        # The running agent's Metrics through the module-level API unless one is given (tests).
        self.metrics: ReapCounter = metrics if metrics is not None else metrics_mod
        self.clock = clock or tracker.clock
        self.pending: dict[PodKey, Pending] = {}
        # Pods a max-runtime action left running (notify, swap, dry run) -> the limit it was for:
        # that limit is not acted on again, and the pod's idleness is judged from then on.
        self.runtime_done: dict[PodKey, float] = {}
        # Counters (tests, status): action records by Event reason.
        self.records: dict[str, int] = {}
        # clock.monotonic() of the latest pass and of the one before it (None: none yet).
        self._last_pass: float | None = None
        self._prev_pass: float | None = None

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
        await self.tracker.poll(allocs)
        self._prev_pass, self._last_pass = self._last_pass, self.clock.monotonic()
        if not self.cfg.idle.enabled:
            self.pending.clear()
            self.runtime_done.clear()
            return []
        ident = self._identity()
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
        pods: PodSource | None = getattr(ident, "pods", None)
        out = []
        for key, members in grouped.items():
            idles = []
            for a, _ in members:
                act = self.tracker.get(a.key)
                # Not polled yet (its usage file is unreadable): treat as busy.
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
            return f'annotation {annotations.IDLE_EXEMPT}="true"'
        if p.workload_class != "interactive" and p.workload_class not in self.cfg.idle.reap_classes:
            return f"class {p.workload_class} is not reaped (idle.reapClasses)"
        if view.info is not None and view.info.deleting:
            return "the pod is being deleted"
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
                    self._event(view, ident, "Normal", REASON_CANCELLED, f"idle reaping cancelled: {why_not}")
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
                if pending.trigger == IDLE:
                    text = (
                        f"GPU work resumed; the pending {self._action_noun()} is cancelled "
                        f"({self._policy_words(view, IDLE)})"
                    )
                else:
                    text = f"max-runtime changed; the pending {self._action_noun()} is cancelled"
                log.info("pod %s: %s", view.who(), text)
                self._event(view, ident, "Normal", REASON_CANCELLED, text)
            pending = None
        if trigger is None:
            return
        if pending is None:
            left = grace if trigger == IDLE else self._runtime_left(view, now)
            pending = self.pending[view.key] = Pending(trigger, due=now + left)
            self._warn(view, ident, pending, left)
        if pending.done or now < pending.due or now < pending.next_try:
            return
        await self._act(view, ident, pending)
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
        if pending.trigger == IDLE:
            text = (
                f"{dry}no GPU work for {format_duration(view.idle_s)} ({self._policy_words(view, IDLE)}): "
                f"will {self._action_words()} in {format_duration(left)} unless GPU work resumes"
            )
        else:
            policy = self._policy_words(view, MAX_RUNTIME)
            text = (
                f"{dry}running for {format_duration(view.runtime_s)} ({policy}): "
                f"will {self._action_words()} in {format_duration(left)}"
            )
        log.warning("pod %s: %s", view.who(), text)
        self._event(view, ident, "Warning", REASON_WARNING[pending.trigger], text)

    async def _act(self, view: PodView, ident: Identity | None, pending: Pending) -> None:
        cfg = self.cfg.idle
        trigger = pending.trigger
        what = self._state_words(view, trigger)
        if cfg.dry_run:
            text = f"dry run: would {self._action_words()} ({what}); nothing was changed"
            log.warning("pod %s: %s", view.who(), text)
            self._record(view, ident, trigger, "dry-run", "Normal", text)
            pending.done = True
            return
        if cfg.action == "notify":
            self._record(
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
                    self._record(view, ident, pending.trigger, "swap", "Warning", f"{what}; {done}")
                    return
                why = "swap to host RAM failed: " + "; ".join(msg for ok, msg in results if not ok)
        log.warning("pod %s: %s; notifying instead", view.who(), why)
        self._record(view, ident, pending.trigger, "notify", "Warning", f"{what}; {why}, notified only")

    async def _evict(self, view: PodView, ident: Identity | None, pending: Pending, what: str) -> None:
        now = self.clock.monotonic()
        if self.evictor is None:
            pending.done = True
            self._record(
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
            self._record(view, ident, pending.trigger, done, "Warning", f"{what}; {how}")
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
        policy = self._policy_words(view, pending.trigger)
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
        self._event(view, ident, "Warning", reason, text)

    # -- records ----------------------------------------------------------------------------------

    def _record(
        self, view: PodView, ident: Identity | None, trigger: str, done: str, type_: str, text: str
    ) -> None:
        reason = action_reason(trigger, done)
        self.records[reason] = self.records.get(reason, 0) + 1
        self.metrics.count_reap(done.replace("-", "_"), trigger.replace("-", "_"))
        self._event(view, ident, type_, reason, text)

    def _event(self, view: PodView, ident: Identity | None, type_: str, reason: str, message: str) -> None:
        sink: EventSink | None = getattr(ident, "events", None)
        if sink is None:
            return
        if view.info is not None:
            ref = ObjectRef.pod(view.info)
        else:
            ref = ObjectRef.pod_named(view.key.namespace, view.key.name, view.key.uid)
        sink.record(ref, type_, reason, message)

    # -- words ------------------------------------------------------------------------------------

    def _action_noun(self) -> str:
        nouns = {"notify": "notification", "swap": "swap to host RAM", "evict": "eviction"}
        return nouns[self.cfg.idle.action]

    def _action_words(self) -> str:
        return {"notify": "notify", "swap": "swap it to host RAM", "evict": "evict the pod"}[
            self.cfg.idle.action
        ]

    def _policy_words(self, view: PodView, trigger: str) -> str:
        p = view.policy
        if trigger == IDLE:
            value, key, node_key = p.idle_timeout, annotations.IDLE_TIMEOUT, "idle.idleTimeout"
        else:
            value, key, node_key = p.max_runtime, annotations.MAX_RUNTIME, "idle.maxRuntime"
        source = f"node config {node_key}"
        raw = (view.info.annotations if view.info is not None else {}).get(key)
        if raw is not None:
            try:
                if parse_duration(raw) == value:
                    source = f"annotation {key}"
            except ValueError:
                pass
        name = "idle-timeout" if trigger == IDLE else "max-runtime"
        return f"{name} {format_duration(value)} from {source}, class {p.workload_class}"

    def _state_words(self, view: PodView, trigger: str) -> str:
        head = "idle" if trigger == IDLE else "max runtime reached"
        return (
            f"{head}: no GPU work for {format_duration(view.idle_s)}, "
            f"running {format_duration(view.runtime_s)}; {self._policy_words(view, trigger)}"
        )


# -- wiring into the agent ---------------------------------------------------------------------------------


async def swap_via_agent(agent: Any, alloc: ContainerAlloc, reason: str) -> tuple[bool, str]:
    """Swap one container out through the arbiter's swap resolver (gpufrac.agent.swap)."""
    arbiter = getattr(agent, "arbiter", None)
    if arbiter is None:
        raise SwapUnavailable("the burst arbiter is not running")
    from gpufrac.agent import swap

    resolver = swap.of(arbiter.chain)
    if resolver is None:
        raise SwapUnavailable("the swap resolver is not in the resolvers list")
    support = await resolver.detect()
    if not support.available:
        raise SwapUnavailable(support.reason)
    return await resolver.swap_out(alloc, reason)


async def run_for(agent: Any) -> None:
    """The agent's idle task: the activity tracker (agent.activity, shared with the arbiter)
    and the reaper (agent.reaper), until cancelled."""
    cfg: Config = agent.config
    tracker = await asyncio.to_thread(ActivityTracker.with_nvml)
    agent.activity = tracker
    if agent.arbiter is not None:  # swap and evict victims are judged idle by the tracker too
        agent.arbiter.activity = tracker
    evictor: PodEvictor | None = None
    try:
        # Loading a kubeconfig reads files and may run an exec credential plugin: off the loop.
        api = await asyncio.to_thread(make_api_client, host=cfg.api_server or None)
        evictor = PodEvictor(api, allow_delete=cfg.idle.allow_delete)
    except Exception as e:  # KubeConfigError, or a kubeconfig the client cannot parse
        if cfg.idle.enabled and cfg.idle.action == "evict":
            log.error("idle reaper cannot evict (it will only notify): %s", e)
    reaper = IdleReaper(
        cfg,
        agent.ledger,
        tracker,
        lambda: getattr(agent, "identity", None),
        evictor=evictor,
        swapper=lambda alloc, reason: swap_via_agent(agent, alloc, reason),
        metrics=getattr(agent, "metrics", None),
    )
    agent.reaper = reaper
    if cfg.idle.enabled:
        log.info(
            "idle reaper: %s after idle-timeout %s + grace %s%s (classes interactive%s)",
            cfg.idle.action,
            format_duration(cfg.idle.idle_timeout) if cfg.idle.idle_timeout else "off",
            format_duration(cfg.idle.grace_period),
            ", dry run" if cfg.idle.dry_run else "",
            "".join(f", {c}" for c in cfg.idle.reap_classes),
        )
    try:
        await reaper.run()
    finally:
        await asyncio.to_thread(tracker.close)
