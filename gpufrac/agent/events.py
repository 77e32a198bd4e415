"""Kubernetes Event reasons of gpufrac, in one place, and a helper to post one on a container's pod.

Reasons are CamelCase, as Kubernetes' own are. Each decision a user would want
to know about gets an Event on the pod it concerns (type Warning where the user
lost something or must act, Normal otherwise), a structured log line
(gpufrac.agent.logs.decision) and, where it is counted, a metric
(gpufrac.agent.metrics).

| reason | type | on | when |
|---|---|---|---|
| GpuLimitApplied | Normal | pod | a burst limit from the pod's annotations took effect |
| InvalidAnnotation | Warning | pod | an annotation was refused; the safe default applies |
| GpuMemoryEvicted | Warning | victim | its processes were killed to free burst memory (says for whom) |
| GpuMemorySwappedOut | Normal | pod | its GPU memory was moved to host RAM (says for whom) |
| GpuMemorySwappedIn | Normal | pod | its GPU memory came back on its next GPU work |
| GpuSwapFailed | Warning | pod | a swap-out or swap-in failed |
| GpuMemoryWaitTimeout | Warning | pod | an allocation waited for memory and got CUDA_ERROR_OUT_OF_MEMORY |
| GpuBurstDenied | Warning | pod | a burst above the request was refused (nothing to free) |
| GpuMemoryOverLimit | Warning | pod | the watchdog saw usage above the limit (report mode) |
| GpuMemoryLimitEnforced | Warning | pod | the watchdog killed a process over the limit (enforce mode) |
| GpuIdle | Warning | pod | an interactive pod is idle: reaped after the grace period |
| GpuIdleReaped | Warning | pod | an idle interactive pod was swapped or evicted |
| GpuMaxRuntimeExceeded | Warning | pod | an interactive pod ran past its max-runtime |
| GpuUnhealthy / GpuHealthy | Warning / Normal | node | a GPU's health changed (its slices follow) |
"""

from __future__ import annotations

import logging
from typing import Any

from gpufrac.agent.kube import ObjectRef

log = logging.getLogger(__name__)

NORMAL, WARNING = "Normal", "Warning"

REASON_LIMIT_APPLIED = "GpuLimitApplied"
REASON_INVALID_ANNOTATION = "InvalidAnnotation"
REASON_EVICTED = "GpuMemoryEvicted"
REASON_SWAPPED_OUT = "GpuMemorySwappedOut"
REASON_SWAPPED_IN = "GpuMemorySwappedIn"
REASON_SWAP_FAILED = "GpuSwapFailed"
REASON_WAIT_TIMEOUT = "GpuMemoryWaitTimeout"
REASON_BURST_DENIED = "GpuBurstDenied"
REASON_OVER_LIMIT = "GpuMemoryOverLimit"
REASON_LIMIT_ENFORCED = "GpuMemoryLimitEnforced"
REASON_IDLE = "GpuIdle"
REASON_IDLE_REAPED = "GpuIdleReaped"
REASON_MAX_RUNTIME = "GpuMaxRuntimeExceeded"
REASON_GPU_UNHEALTHY = "GpuUnhealthy"
REASON_GPU_HEALTHY = "GpuHealthy"

REASONS = frozenset(v for k, v in dict(globals()).items() if k.startswith("REASON_"))


def container_ref(alloc: Any) -> ObjectRef | None:
    """The pod (and container) of a ContainerAlloc, or None while its pod is not known."""
    if not getattr(alloc, "pod", None):
        return None
    path = f"spec.containers{{{alloc.container}}}" if alloc.container else ""
    return ObjectRef("Pod", alloc.pod, alloc.namespace or "", alloc.pod_uid or "", field_path=path)


def recorder(agent: Any) -> Any | None:
    """The agent's EventRecorder (kept by its pod identity), None without an apiserver."""
    return getattr(getattr(agent, "identity", None), "events", None)


def post(agent: Any, alloc: Any, type_: str, reason: str, message: str) -> bool:
    """Post an Event on the pod of `alloc`; never raises, never blocks (call on the agent's loop).
    False when there is nobody to tell (no apiserver, or the pod is not known yet)."""
    if reason not in REASONS:
        raise ValueError(f"unknown Event reason {reason!r}: add it to gpufrac.agent.events")
    rec, ref = recorder(agent), container_ref(alloc)
    if rec is None or ref is None:
        return False
    rec.record(ref, type_, reason, message)
    return True


def post_node(agent: Any, type_: str, reason: str, message: str) -> bool:
    """Post an Event on this agent's Node object (GPU health)."""
    rec = recorder(agent)
    if rec is None:
        return False
    rec.record(ObjectRef("Node", agent.config.node_name, uid=agent.config.node_name), type_, reason, message)
    return True
