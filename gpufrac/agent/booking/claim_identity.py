"""Claims' policies and consumers: what pod identity (gpufrac.agent.booking.pods) is for containers.

A claim's policy comes from its parameters (gpufrac.core.claimconfig: the class's and the
claim's opaque config for this driver), capped by the node's namespace policy
(gpufrac.core.policy, the claim's namespace), decided at prepare, before any container runs:
there is no limit = request interlude as for a device-plugin container whose pod is not known
yet. A refused parameter gets the safe default and one Warning Event InvalidClaimParameter on
the claim naming field, value and reason; a cap gets GpuPolicyCapped; a burst limit that takes
effect GpuLimitApplied, each told once.

Its consumers are the containers that use it: every container of a pod on this node whose
resources.claims names it (through the pod's resourceClaims), read from the pod cache as pods
come and go. They are one group for the claim's limit (one directory, one usage file), and
the arbiter, the watchdog and the killer tell its processes by them
(gpufrac.agent.booking.ledger.ContainerAlloc.held_by). The booking is bound to the first of its pods
(by name): Events about its memory (an eviction, a swap) go to that pod, and so does the idle
reaper, whose grouping is by pod; the claim's priority is the highest of its pods'.

Runs on the agent's loop. The reaper asks `policy(key)` of the agent's Identity: claims here,
device-plugin containers from pod identity (`fallback`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any, Protocol

from gpufrac.agent.booking.ledger import ContainerAlloc
from gpufrac.agent.kube import events
from gpufrac.agent.kube.events import EventSink
from gpufrac.agent.kube.objref import ObjectRef
from gpufrac.agent.kube.podcache import PodInfo
from gpufrac.core import claimconfig
from gpufrac.core import policy as policy_mod
from gpufrac.core.annotations import ContainerPolicy
from gpufrac.core.claims import ClaimAllocation, ClaimRef
from gpufrac.core.config import Config
from gpufrac.core.slices import GpuGeometry
from gpufrac.core.units import format_bytes

log = logging.getLogger(__name__)

CLAIM_API_VERSION = "resource.k8s.io/v1"


class ClaimBookings(Protocol):
    """What is read and written of the ledger (gpufrac.agent.booking.ledger.Ledger)."""

    @property
    def geometry(self) -> Mapping[str, GpuGeometry]: ...
    def containers(self) -> list[ContainerAlloc]: ...
    def get(self, key: str) -> ContainerAlloc | None: ...
    def bind(
        self,
        key: str,
        namespace: str | None,
        pod: str | None,
        container: str | None,
        pod_uid: str | None = None,
    ) -> ContainerAlloc: ...
    def set_consumers(self, key: str, consumers: frozenset[tuple[str, str]]) -> None: ...
    def update_config(self, key: str, **fields: object) -> Any: ...


class Pods(Protocol):
    """This node's pods (gpufrac.agent.kube.PodCache)."""

    def get(self, namespace: str, name: str) -> PodInfo | None: ...
    def pods(self) -> list[PodInfo]: ...
    def subscribe(self, listener: Any) -> None: ...


class Identity(Protocol):
    """Pod identity of device-plugin containers (gpufrac.agent.booking.pods.PodIdentity)."""

    @property
    def pods(self) -> Any: ...
    @property
    def events(self) -> EventSink | None: ...
    def policy(self, key: str) -> ContainerPolicy | None: ...


class ParameterMetrics(Protocol):
    """Where refused parameters are counted, as refused annotations are (gpufrac.agent.metrics)."""

    def count_annotation_error(self, key: str) -> None: ...


def claim_ref(claim: ClaimRef) -> ObjectRef:
    """The ResourceClaim an Event is about."""
    return ObjectRef("ResourceClaim", claim.name, claim.namespace, claim.uid, api_version=CLAIM_API_VERSION)


class ClaimIdentity:
    """Claims' policies and consumers; the reaper's Identity (device-plugin containers
    through `fallback`)."""

    def __init__(
        self,
        cfg: Config,
        ledger: ClaimBookings,
        pods: Pods | None,
        sink: EventSink | None,
        *,
        metrics: ParameterMetrics,
        fallback: Identity | None = None,
    ) -> None:
        self.cfg = cfg
        self.ledger = ledger
        self._pods = pods
        self._events = sink
        self.metrics = metrics
        self.fallback = fallback
        self._parameters: dict[str, tuple[Mapping[str, Any], ...]] = {}  # key -> the claim's parameters
        self._policies: dict[str, ContainerPolicy] = {}
        self._told: dict[str, frozenset[str]] = {}  # messages already posted, per claim
        self._pending: asyncio.Task[None] | None = None
        self.problems = 0  # refused parameters seen (tests)
        if pods is not None:
            pods.subscribe(self._on_pod)

    # -- the reaper's Identity ----------------------------------------------------------------

    @property
    def pods(self) -> Any:
        return self._pods if self.fallback is None else self.fallback.pods

    @property
    def events(self) -> EventSink | None:
        return self._events

    def policy(self, key: str) -> ContainerPolicy | None:
        """A claim's policy (None until its parameters were read), else the fallback's."""
        if key in self._policies:
            return self._policies[key]
        alloc = self.ledger.get(key)
        if alloc is not None and alloc.claim is not None:
            return None
        return self.fallback.policy(key) if self.fallback is not None else None

    # -- claims -------------------------------------------------------------------------------

    def prepared(self, alloc: ContainerAlloc, allocation: ClaimAllocation) -> None:
        """A claim booked (or restored and read again): its consumers and its policy."""
        self._parameters[alloc.key] = allocation.parameters
        self._bind(alloc)
        self._apply(alloc)

    def released(self, alloc: ContainerAlloc) -> None:
        for table in (self._parameters, self._policies, self._told):
            table.pop(alloc.key, None)

    def known(self, key: str) -> bool:
        """Whether a claim's parameters have been read since the agent started."""
        return key in self._parameters

    def refresh(self) -> int:
        """Consumers (and so priority) of every claim, from the pod cache; how many changed."""
        changed = 0
        for alloc in self.ledger.containers():
            if alloc.claim is not None and self._bind(alloc):
                changed += 1
                if alloc.key in self._parameters:
                    self._apply(alloc)
        return changed

    def _consumers(self, claim: ClaimRef) -> list[tuple[PodInfo, str]]:
        if self._pods is None:
            return []
        out = []
        for pod in self._pods.pods():
            if pod.namespace != claim.namespace or pod.phase in ("Succeeded", "Failed"):
                continue
            out += [(pod, c) for c, names in pod.claims.items() if claim.name in names]
        return sorted(out, key=lambda t: (t[0].name, t[1]))

    def _bind(self, alloc: ContainerAlloc) -> bool:
        """Record the claim's consumers and bind it to its first pod; True when they changed."""
        assert alloc.claim is not None
        found = self._consumers(alloc.claim)
        consumers = frozenset((pod.uid, c) for pod, c in found)
        if consumers == alloc.consumers and (alloc.pod or not found):
            return False
        self.ledger.set_consumers(alloc.key, consumers)
        if found:
            first = found[0][0]
            self.ledger.bind(alloc.key, first.namespace, first.name, None, first.uid or None)
        return True

    def _priority(self, alloc: ContainerAlloc) -> int | None:
        if self._pods is None:
            return None
        prios = [
            p.priority
            for p in self._pods.pods()
            if any(uid == p.uid for uid, _ in alloc.consumers) and p.priority is not None
        ]
        return max(prios) if prios else None

    def _apply(self, alloc: ContainerAlloc) -> None:
        claim = alloc.claim
        assert claim is not None
        who = claim.who()
        allocatable = min(self.ledger.geometry[u].allocatable for u in alloc.gpus)
        policy, problems = claimconfig.claim_policy(
            self._parameters.get(alloc.key, ()),
            claim=who,
            request_bytes=alloc.request_bytes,
            gpu_allocatable=allocatable,
            cfg=self.cfg,
            priority=self._priority(alloc),
            whole_gpu=alloc.whole_gpu,
        )
        policy, caps = policy_mod.enforce(
            policy, claim.namespace, self.cfg.policy, container=who, format_bytes=format_bytes
        )
        before = self._policies.get(alloc.key)
        self.ledger.update_config(alloc.key, **policy.config_fields())
        self._policies[alloc.key] = policy
        told = self._told.get(alloc.key, frozenset())
        now: set[str] = set()
        for p in problems:
            message = p.message(who)
            now.add(message)
            if message not in told:
                self.problems += 1
                self.metrics.count_annotation_error(claimconfig.FIELDS.get(p.field, "gpufrac.dev/unknown"))
                log.warning("%s", message)
                self._post(claim, events.WARNING, events.REASON_INVALID_CLAIM_PARAMETER, message)
        for cap in caps:
            now.add(cap.message)
            if cap.message not in told:
                log.warning("%s", cap.message)
                self._post(claim, events.WARNING, events.REASON_POLICY_CAPPED, cap.message)
        self._told[alloc.key] = frozenset(now)
        if policy.limit_bytes != (before.limit_bytes if before else policy.request_bytes):
            source = f"from {policy.limit_key}" if policy.limit_key else "= the request, no burst"
            if any(c.what == policy_mod.LIMIT for c in caps):
                source += ", capped by the node policy"
            message = (
                f"{who}: GPU memory limit {format_bytes(policy.limit_bytes)} "
                f"(request {format_bytes(policy.request_bytes)}) {source} on GPU {alloc.gpus[0]}"
            )
            log.info("%s", message)
            self._post(claim, events.NORMAL, events.REASON_LIMIT_APPLIED, message)

    def _post(self, claim: ClaimRef, type_: str, reason: str, message: str) -> None:
        if self._events is not None:
            self._events.record(claim_ref(claim), type_, reason, message)

    # -- pod changes --------------------------------------------------------------------------

    def _on_pod(self, kind: str, pod: PodInfo) -> None:
        if (pod.claims or kind == "DELETED") and (self._pending is None or self._pending.done()):
            self._pending = asyncio.get_running_loop().create_task(self._refresh_soon())

    async def _refresh_soon(self) -> None:
        await asyncio.sleep(0)  # a burst of watch events is one pass
        try:
            self.refresh()
        except Exception:
            log.exception("claim consumers: refresh failed")

    async def close(self) -> None:
        if self._pending is not None:
            self._pending.cancel()
            await asyncio.gather(self._pending, return_exceptions=True)
