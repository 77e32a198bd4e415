"""Kubernetes Event reasons of gpufrac, in one place, and helpers to post one.

Reasons are CamelCase, as Kubernetes' own are. Each decision a user would want
to know about gets an Event on the object it concerns (type Warning where the
user lost something or must act, Normal otherwise), a structured log line
(gpufrac.core.logs.decision) and, where it is counted, a metric
(gpufrac.agent.metrics). Modules that post Events take their reason from here.

| reason | type | on | posted by | when |
|---|---|---|---|---|
| GpuLimitApplied | Normal | pod, claim | pods, claims | a burst limit took effect or changed |
| InvalidAnnotation | Warning | pod | pods | an annotation was refused; the safe default applies |
| InvalidClaimParameter | Warning | claim | claims | a claim parameter was refused; the safe default applies |
| GpuPolicyCapped | Warning | pod, claim | pods, claims | the namespace policy capped what was asked |
| GpuMemoryEvicted | Warning | victim pod | resolvers | its processes were killed to reclaim burst memory |
| GpuMemoryPreempted | Normal | requester | resolvers | burst memory was reclaimed from another pod for it |
| GpuMemorySwappedOut | Normal | victim pod | swap | its GPU memory was moved to host RAM (says for whom) |
| GpuMemoryFreedBySwap | Normal | requester | swap | another pod was swapped out to make room for it |
| GpuMemorySwappedIn | Normal | pod | swap | its GPU memory came back on its next GPU work |
| GpuSwapFailed | Warning | pod | (swap) | a swap-out or swap-in failed |
| GpuMemoryWaitTimeout | Warning | pod | (arbiter) | an allocation waited for memory, then got an OOM error |
| GpuBurstDenied | Warning | pod | (arbiter) | a burst above the request was refused: nothing could be freed |
| GpuGuaranteeAtRisk | Warning | pod | admission | at its start, others' bursts held its request |
| GpuMemoryOverLimit | Warning | pod | watchdog | NVML shows usage above the limit (report mode) |
| GpuMemoryLimitEnforced | Warning | pod | watchdog | a process over the limit was killed (enforce mode) |
| GpuUsageFileMismatch | Warning | pod | arbiter | its usage file disagrees with NVML's count (truth.py) |
| IdleWarning, MaxRuntimeWarning | Warning | pod | idle | the pod will be reaped after the grace period |
| IdleCancelled | Normal | pod | idle | the pod became active again (or exempt): no reaping |
| (Idle or MaxRuntime) + (Notify, Swapped, Evicted, Deleted, DryRun) | Warning | pod | idle | what was done |
| IdleEvictionBlocked | Warning | pod | idle | a PodDisruptionBudget refused the eviction; retried |
| IdleEvictionFailed | Warning | pod | idle | the eviction failed; retried |
| GpuUnhealthy / GpuHealthy | Warning / Normal | node | agent | a GPU's health changed (its slices follow) |
| GpuComputeOvercommitted | Warning | node, pods | compute | the GPU's compute shares sum past 100 % |
| GpuComputeUnheld | Warning | pod | compute | over its compute share though paced to the slowest |

"claim" is a ResourceClaim (DRA mode), "claims" gpufrac.agent.booking.claim_identity (from a claim's
parameters, as pods does from a pod's annotations). A poster in parentheses is reserved:
that module does not post the Event yet (it logs the decision only).

A collision eviction also sets the pod condition DisruptionTarget=True, reason
GpuMemoryReclaimed (pods/status, as Kubernetes marks a pod it disrupts), so a Job's
podFailurePolicy can tell a reclaim from an application failure.
"""

from __future__ import annotations

import logging
from typing import Protocol

from gpufrac.agent.kube.objref import ObjectRef

log = logging.getLogger(__name__)

NORMAL, WARNING = "Normal", "Warning"

REASON_LIMIT_APPLIED = "GpuLimitApplied"
REASON_INVALID_ANNOTATION = "InvalidAnnotation"
REASON_INVALID_CLAIM_PARAMETER = "InvalidClaimParameter"
REASON_POLICY_CAPPED = "GpuPolicyCapped"
REASON_EVICTED = "GpuMemoryEvicted"
REASON_PREEMPTED = "GpuMemoryPreempted"
REASON_SWAPPED_OUT = "GpuMemorySwappedOut"
REASON_FREED_BY_SWAP = "GpuMemoryFreedBySwap"
REASON_SWAPPED_IN = "GpuMemorySwappedIn"
REASON_SWAP_FAILED = "GpuSwapFailed"
REASON_WAIT_TIMEOUT = "GpuMemoryWaitTimeout"
REASON_BURST_DENIED = "GpuBurstDenied"
REASON_GUARANTEE_AT_RISK = "GpuGuaranteeAtRisk"
REASON_OVER_LIMIT = "GpuMemoryOverLimit"
REASON_LIMIT_ENFORCED = "GpuMemoryLimitEnforced"
REASON_USAGE_MISMATCH = "GpuUsageFileMismatch"
REASON_GPU_UNHEALTHY = "GpuUnhealthy"
REASON_GPU_HEALTHY = "GpuHealthy"
REASON_COMPUTE_OVERCOMMITTED = "GpuComputeOvercommitted"
REASON_COMPUTE_UNHELD = "GpuComputeUnheld"
# The idle reaper: a warning ahead of the action, then the action (trigger prefix + what was done).
REASON_IDLE_WARNING = "IdleWarning"
REASON_MAX_RUNTIME_WARNING = "MaxRuntimeWarning"
REASON_IDLE_CANCELLED = "IdleCancelled"
REASON_IDLE_BLOCKED = "IdleEvictionBlocked"
REASON_IDLE_FAILED = "IdleEvictionFailed"
# The reason of the DisruptionTarget pod condition a collision eviction sets (not an Event).
CONDITION_GPU_MEMORY_RECLAIMED = "GpuMemoryReclaimed"
IDLE_TRIGGERS = ("Idle", "MaxRuntime")
IDLE_ACTIONS = ("Notify", "Swapped", "Evicted", "Deleted", "DryRun")

REASONS = frozenset(
    [v for k, v in dict(globals()).items() if k.startswith("REASON_")]
    + [t + a for t in IDLE_TRIGGERS for a in IDLE_ACTIONS]
)


class EventSink(Protocol):
    """Where Events go (gpufrac.agent.kube.EventRecorder); never raises, never blocks."""

    def record(self, ref: ObjectRef, type_: str, reason: str, message: str) -> None: ...


class Booked(Protocol):
    """What an Event needs of a container's booking (gpufrac.agent.booking.ledger.ContainerAlloc)."""

    @property
    def key(self) -> str: ...
    @property
    def namespace(self) -> str | None: ...
    @property
    def pod(self) -> str | None: ...
    @property
    def pod_uid(self) -> str | None: ...
    @property
    def container(self) -> str | None: ...


def container_name(alloc: Booked) -> str:
    """How an Event on its pod names a container: its name, or its ledger key while the
    kubelet has not said which container of the pod holds it."""
    return str(alloc.container or alloc.key)


def container_ref(alloc: Booked) -> ObjectRef | None:
    """The pod (and container) of a ContainerAlloc, or None while its pod is not known."""
    if not alloc.pod:
        return None
    return ObjectRef.pod_named(alloc.namespace or "", alloc.pod, alloc.pod_uid or "", alloc.container)


def post(sink: EventSink | None, alloc: Booked, type_: str, reason: str, message: str) -> bool:
    """Post an Event on the pod of `alloc`; never raises, never blocks (call on the agent's loop).
    False when there is nobody to tell (no apiserver, or the pod is not known yet)."""
    if reason not in REASONS:
        raise ValueError(f"unknown Event reason {reason!r}: add it to gpufrac.agent.kube.events")
    ref = container_ref(alloc)
    if sink is None or ref is None:
        return False
    sink.record(ref, type_, reason, message)
    return True


def post_node(sink: EventSink | None, node_name: str, type_: str, reason: str, message: str) -> bool:
    """Post an Event on this agent's Node object (GPU health)."""
    if sink is None:
        return False
    sink.record(ObjectRef("Node", node_name, uid=node_name), type_, reason, message)
    return True
