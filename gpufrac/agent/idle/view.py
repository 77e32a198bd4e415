"""A pod as the idle reaper sees it (gpufrac.agent.idle.reaper), and the words its Events say it in.

One tick groups each pod's bookings into a PodView (its least idle container, its longest
runtime, one policy); a Pending is a warned pod waiting for its grace period. The words
name the policy and its source (annotation or node config) as the decision used them, for
the warnings the reaper posts and the records of what was done (gpufrac.agent.idle.actions).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from gpufrac.agent.booking.ledger import ContainerAlloc
from gpufrac.agent.kube import events
from gpufrac.agent.kube.events import EventSink
from gpufrac.agent.kube.podcache import PodInfo
from gpufrac.core import annotations as annotations_mod
from gpufrac.core.annotations import ContainerPolicy
from gpufrac.core.units import format_duration, parse_duration

IDLE, MAX_RUNTIME = "idle", "max-runtime"
# Event reason of the action record: prefix by trigger, suffix by what was done.
_PREFIX = dict(zip((IDLE, MAX_RUNTIME), events.IDLE_TRIGGERS, strict=True))
_DONE = dict(zip(("notify", "swap", "evict", "delete", "dry-run"), events.IDLE_ACTIONS, strict=True))


def action_reason(trigger: str, done: str) -> str:
    """The Event reason recording an action: IdleEvicted, MaxRuntimeNotify, IdleDryRun…"""
    return _PREFIX[trigger] + _DONE[done]


# -- what the reaper reads from the rest of the agent ----------------------------------------------------


class PodSource(Protocol):
    def get(self, namespace: str, name: str) -> PodInfo | None: ...


class Identity(Protocol):
    """What the reaper needs of gpufrac.agent.booking.pods.PodIdentity: the pod cache and the Event
    sink (None without an apiserver) and each container's policy."""

    @property
    def pods(self) -> PodSource | None: ...
    @property
    def events(self) -> EventSink | None: ...

    def policy(self, key: str) -> ContainerPolicy | None: ...


# -- a pod, as judged -------------------------------------------------------------------------------------


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


# -- words ------------------------------------------------------------------------------------------------


def action_noun(action: str) -> str:
    """What idle.action does, as a noun."""
    nouns = {"notify": "notification", "swap": "swap to host RAM", "evict": "eviction"}
    return nouns[action]


def action_words(action: str) -> str:
    """What idle.action does, as a verb phrase."""
    return {"notify": "notify", "swap": "swap it to host RAM", "evict": "evict the pod"}[action]


def policy_words(view: PodView, trigger: str) -> str:
    """The limit a trigger rests on, with its source and the pod's class."""
    p = view.policy
    if trigger == IDLE:
        value, key, node_key = p.idle_timeout, annotations_mod.IDLE_TIMEOUT, "idle.idleTimeout"
    else:
        value, key, node_key = p.max_runtime, annotations_mod.MAX_RUNTIME, "idle.maxRuntime"
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


def state_words(view: PodView, trigger: str) -> str:
    """Where the pod stands against the trigger's limit."""
    head = "idle" if trigger == IDLE else "max runtime reached"
    return (
        f"{head}: no GPU work for {format_duration(view.idle_s)}, "
        f"running {format_duration(view.runtime_s)}; {policy_words(view, trigger)}"
    )
