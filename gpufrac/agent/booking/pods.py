"""Pods: which pod and container own an allocation, and the policy that follows.

Allocate carries only device IDs. The kubelet's pod-resources List maps those
device IDs to namespace/pod/container; the apiserver (PodCache, a watch on this
node's pods) gives the pod's uid, annotations and spec.priority. From those,
annotations.parse_policy decides the container's limit, class and policy, and the
ledger writes it to the container's config file. A booking is bound to its pod's uid once
(the pod a GET asked after the booking finds: the watch may lag) and keeps it: pod-resources
names no uid, and a pod force-deleted while its container runs may have a successor of the
same name, with its own booking.

Until the pod is known the container keeps limit = request (the ledger's safe
default). Bad annotations get a Warning Event "InvalidAnnotation" on the pod
naming key, value, reason and the default applied; a burst limit that takes
effect gets a Normal Event "GpuLimitApplied". A change of the pod's annotations
(watch MODIFIED) re-applies the policy.

Everything here runs on the agent's event loop. The composition root (gpufrac.agent.main)
builds one PodIdentity, with the PodCache and EventRecorder on its one API client (or none
of them without an apiserver: every limit then stays at the request), and calls resolve()
after Allocate/PreStart and each reconcile.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import grpc

from gpufrac.agent.booking.ledger import ContainerAlloc, Ledger, keyed
from gpufrac.agent.kube import events
from gpufrac.agent.kube.objref import ObjectRef
from gpufrac.agent.kube.podcache import PodCache, PodInfo
from gpufrac.agent.kube.recorder import EventRecorder
from gpufrac.core import annotations as annotations_mod
from gpufrac.core import policy as policy_mod
from gpufrac.core import slices
from gpufrac.core.annotations import ContainerPolicy
from gpufrac.core.config import Config
from gpufrac.core.slices import ContainerDevices
from gpufrac.core.units import format_bytes

log = logging.getLogger(__name__)

# Event reasons live in gpufrac.agent.kube.events with all the others.
REASON_INVALID = events.REASON_INVALID_ANNOTATION
REASON_APPLIED = events.REASON_LIMIT_APPLIED
# A pod neither in the cache nor found by a direct GET is asked for again only this often.
FETCH_RETRY = 5.0


class PodResourcesLister(Protocol):
    async def list(self, resources: tuple[str, ...] | None = None) -> list[ContainerDevices]: ...


class AnnotationMetrics(Protocol):
    """Where refused annotations are counted (gpufrac.agent.metrics.Metrics)."""

    def count_annotation_error(self, key: str) -> None: ...


@dataclass(frozen=True)
class _Applied:
    """What a policy was computed from: the same inputs give the same policy."""

    uid: str
    container: str
    annotations: frozenset[tuple[str, str]]
    priority: int | None
    booked: float  # the allocation's booking time: slices released and booked again are a new container


@dataclass(frozen=True)
class _Asked:
    """A GET of a pod by name for a booking not yet bound: when asked, and what it found."""

    at: float  # time.time(), as a booking's `created`
    mono: float  # time.monotonic(), for the retry interval
    pod: PodInfo | None  # None: absent, or the apiserver failed


class PodIdentity:
    """Finds the pods behind allocations and keeps each container's policy applied; a refused
    annotation is counted in `metrics`."""

    def __init__(
        self,
        cfg: Config,
        ledger: Ledger,
        pods: PodCache | None,
        events: EventRecorder | None,
        podresources: PodResourcesLister | None = None,
        *,
        metrics: AnnotationMetrics,
    ) -> None:
        self.cfg = cfg
        self.ledger = ledger
        self.pods = pods
        self.events = events
        self.podresources = podresources
        self.metrics = metrics
        self._policies: dict[str, ContainerPolicy] = {}
        self._applied: dict[str, _Applied] = {}
        self._caps: dict[str, frozenset[str]] = {}  # policy caps already told, per container key
        self._problems: dict[str, frozenset[str]] = {}  # annotation refusals already told, likewise
        self._fetched: dict[tuple[str, str], float] = {}
        self._asked: dict[tuple[str, str], _Asked] = {}  # the last GET per pod name for a new booking
        self._pending: asyncio.Task[None] | None = None
        # resolve() awaits the apiserver; a watch-triggered pass must not interleave with it.
        self._lock = asyncio.Lock()
        self.annotation_problems = 0  # bad annotations seen (tests read it)
        self._failed: dict[str, str] = {}  # container key -> the error its last resolve logged
        if pods is not None:
            pods.subscribe(self._on_pod)

    # -- lookups for other parts of the agent ---------------------------------------------------

    def policy(self, key: str) -> ContainerPolicy | None:
        """The policy in force for a container key: from its pod, or the safe default while
        the pod is unknown; None for keys the ledger does not hold."""
        if key in self._policies:
            return self._policies[key]
        alloc = self.ledger.get(key)
        if alloc is None:
            return None
        return annotations_mod.safe_policy(alloc.request_bytes, self.cfg, whole_gpu=alloc.whole_gpu)

    # -- resolving --------------------------------------------------------------------------------

    async def resolve(self, listing: Mapping[str, ContainerDevices] | None = None) -> int:
        """Bind and apply policy to every allocation whose pod (or pod state) is new.

        `listing` maps container keys to pod-resources entries (the agent's last
        List); without it pod-resources is asked here. Returns how many containers
        got a new policy."""
        async with self._lock:
            if listing is None:
                listing = await self._list()
            return await self._resolve_all(listing)

    async def _resolve_all(self, listing: Mapping[str, ContainerDevices]) -> int:
        changed = 0
        held = set()
        for alloc in self.ledger.containers():
            if alloc.claim is not None:
                continue  # a DRA claim's: its policy comes from the claim (booking.claim_identity)
            held.add(alloc.key)
            try:
                if await self._resolve_one(alloc, listing.get(alloc.key)):
                    changed += 1
            except Exception as e:  # one bad container must not stop the others
                # Once per container and error, not a traceback every reconcile.
                seen = f"{type(e).__name__}: {e}"
                if self._failed.get(alloc.key) != seen:
                    self._failed[alloc.key] = seen
                    log.exception("resolving the pod of %s failed (logged once until it changes)", alloc.key)
            else:
                self._failed.pop(alloc.key, None)
        for key in set(self._failed) - held:
            del self._failed[key]
        # A GET found a booking's pod once; only names of bookings still unbound may ask again.
        unbound = {(a.namespace, a.pod) for a in self.ledger.containers() if not a.pod_uid}
        for name in set(self._asked) - unbound:
            del self._asked[name]
        for key in set(self._policies) - held:
            self._policies.pop(key, None)
            self._applied.pop(key, None)
            self._caps.pop(key, None)
            self._problems.pop(key, None)
        return changed

    async def _list(self) -> dict[str, ContainerDevices]:
        if self.podresources is None:
            return {}
        try:
            listed = await self.podresources.list(slices.RESOURCES)
        except grpc.aio.AioRpcError as e:
            log.debug("pod-resources List: %s", e.details())
            return {}
        return keyed(listed)

    async def _resolve_one(self, alloc: ContainerAlloc, entry: ContainerDevices | None) -> bool:
        bound = bool(alloc.pod_uid and alloc.namespace and alloc.pod and alloc.container)
        if bound or (entry is None and alloc.namespace and alloc.pod and alloc.container):
            # Bound before (state, reconcile, an earlier pass); bound to a pod uid, a booking
            # keeps its names whatever pod-resources, which names no uid, says.
            ns, name, container = alloc.namespace or "", alloc.pod or "", alloc.container or ""
        elif entry is not None:
            ns, name, container = entry.namespace, entry.pod, entry.container
        else:
            return False  # not listed yet: stays limit = request
        pod = await (self._pod(ns, name) if bound else self._owner(ns, name, alloc.created))
        if self.ledger.get(alloc.key) is not alloc:
            return False  # released (and maybe booked again by another pod) during the wait
        if pod is None:
            if (alloc.namespace, alloc.pod, alloc.container) != (ns, name, container):
                self.ledger.bind(alloc.key, ns, name, container, None)
            return False
        if bound and pod.uid != alloc.pod_uid:
            # A booking is one Allocate's, for one pod, for its whole life. Pod-resources names
            # no uid: a pod of the same name that replaced its pod in the apiserver (a force
            # delete, the old container still running) is another pod; its own Allocate books
            # its own. This one keeps the policy of its pod.
            return False
        self.ledger.bind(alloc.key, ns, name, container, pod.uid or None)
        inputs = _Applied(pod.uid, container, frozenset(pod.annotations.items()), pod.priority, alloc.created)
        if self._applied.get(alloc.key) == inputs:
            return False
        self._apply(alloc, pod, container, inputs)
        return True

    async def _pod(self, namespace: str, name: str) -> PodInfo | None:
        """The pod of that name: the cache's, or one direct GET when the watch has not delivered
        it (not again for a while)."""
        if self.pods is None:
            return None
        pod = self.pods.get(namespace, name)
        if pod is not None:
            return pod
        # Not delivered by the watch (yet): one direct GET, not again for a while.
        now = time.monotonic()
        if now - self._fetched.get((namespace, name), -FETCH_RETRY) < FETCH_RETRY:
            return None
        self._fetched[(namespace, name)] = now
        if len(self._fetched) > 4096:
            self._fetched = {k: t for k, t in self._fetched.items() if now - t < FETCH_RETRY}
        return await self.pods.fetch(namespace, name)

    async def _owner(self, namespace: str, name: str, booked: float) -> PodInfo | None:
        """The pod a booking made at `booked` (time.time()) is for, as a GET asked after it
        finds it; None while unknown.

        The kubelet admits only a pod it got from the apiserver, so the booking's pod was
        there before the booking and a GET asked after returns it (unless that pod too has
        gone since). The watch may lag: its pod of that name may still be a predecessor, force
        deleted, whose successor this booking is. A GET asked after the booking is reused
        (the other containers of the pod); a failed one is not repeated for FETCH_RETRY."""
        if self.pods is None:
            return None
        seen = self._asked.get((namespace, name))
        if (
            seen is not None
            and seen.at >= booked
            and (seen.pod is not None or time.monotonic() - seen.mono < FETCH_RETRY)
        ):
            return self._newest(seen.pod)
        at, mono = time.time(), time.monotonic()
        fetched = await self.pods.fetch(namespace, name)
        if fetched is not None and fetched.node_name != self.pods.node_name:
            fetched = None  # a pod of that name bound to another node is not this node's booking's
        self._asked[(namespace, name)] = _Asked(at, mono, fetched)
        return self._newest(fetched)

    def _newest(self, pod: PodInfo | None) -> PodInfo | None:
        """`pod`, or the cache's copy of the same pod (the watch keeps it current)."""
        if pod is None or self.pods is None:
            return pod
        cached = self.pods.get(pod.namespace, pod.name)
        return cached if cached is not None and cached.uid == pod.uid else pod

    def _apply(self, alloc: ContainerAlloc, pod: PodInfo, container: str, inputs: _Applied) -> None:
        allocatable = min(self.ledger.geometry[u].allocatable for u in alloc.gpus)
        result = annotations_mod.parse_policy(
            pod.annotations,
            container=container,
            request_bytes=alloc.request_bytes,
            gpu_allocatable=allocatable,
            cfg=self.cfg,
            priority=pod.priority,
            containers=pod.containers or None,
            whole_gpu=alloc.whole_gpu,
        )
        # The node's per-namespace caps (gpufrac.core.policy) over what the annotations asked.
        policy, caps = policy_mod.enforce(
            result.policy, pod.namespace, self.cfg.policy, container=container, format_bytes=format_bytes
        )
        before = self._policies.get(alloc.key)
        self.ledger.update_config(alloc.key, **policy.config_fields())
        self._policies[alloc.key] = policy
        self._applied[alloc.key] = inputs
        ref = ObjectRef.pod(pod, container)
        # Each refusal is told once, not again when only something else changed (a tenant may
        # rewrite an unrelated annotation as often as the apiserver lets it).
        told_problems = self._problems.get(alloc.key, frozenset())
        messages = [problem.message(container) for problem in result.problems]
        for problem, message in zip(result.problems, messages, strict=True):
            if message in told_problems:
                continue
            self.annotation_problems += 1
            self.metrics.count_annotation_error(problem.key)
            log.warning("pod %s/%s: %s", pod.namespace, pod.name, message)
            self._event(ref, "Warning", REASON_INVALID, message)
        self._problems[alloc.key] = frozenset(messages)
        # Each cap is told once, not on every re-apply (a watch event, an unrelated annotation).
        told = self._caps.get(alloc.key, frozenset())
        for cap in caps:
            if cap.message not in told:
                log.warning("pod %s/%s: %s", pod.namespace, pod.name, cap.message)
                self._event(ref, "Warning", events.REASON_POLICY_CAPPED, cap.message)
        self._caps[alloc.key] = frozenset(c.message for c in caps)
        # Tell the user when their burst limit takes effect, changes, or goes back to the request.
        if policy.limit_bytes != (before.limit_bytes if before else policy.request_bytes):
            source = f"from {policy.limit_key}" if policy.limit_key else "= the request, no burst"
            if any(c.what == policy_mod.LIMIT for c in caps):
                source += ", capped by the node policy"
            message = (
                f"container {container}: GPU memory limit {format_bytes(policy.limit_bytes)} "
                f"(request {format_bytes(policy.request_bytes)}) {source} on GPU {alloc.gpus[0]}"
            )
            log.info("pod %s/%s: %s", pod.namespace, pod.name, message)
            self._event(ref, "Normal", REASON_APPLIED, message)
        log.info(
            "pod %s/%s container %s (%s): limit %s, class %s, priority %d, preemptible %s, swappable %s",
            pod.namespace, pod.name, container, alloc.key, format_bytes(policy.limit_bytes),
            policy.workload_class, policy.priority, policy.preemptible, policy.swappable,
        )  # fmt: skip

    def _event(self, ref: ObjectRef, type_: str, reason: str, message: str) -> None:
        if self.events is not None:
            self.events.record(ref, type_, reason, message)

    # -- pod changes ------------------------------------------------------------------------------

    def _on_pod(self, kind: str, pod: PodInfo) -> None:
        """Watch delivered a pod: re-resolve if it owns one of our containers."""
        if kind == "DELETED":
            return
        seen = self._asked.get((pod.namespace, pod.name))
        if seen is not None and seen.pod is None:
            del self._asked[(pod.namespace, pod.name)]  # a GET that found nothing is asked again now
        for alloc in self.ledger.containers():
            if (alloc.namespace, alloc.pod) == (pod.namespace, pod.name):
                self._schedule()
                return

    def _schedule(self) -> None:
        if self._pending is None or self._pending.done():
            self._pending = asyncio.get_running_loop().create_task(self._resolve_soon())

    async def _resolve_soon(self) -> None:
        await asyncio.sleep(0)  # coalesce a burst of watch events into one pass
        try:
            await self.resolve(self._known_listing())
        except Exception:
            log.exception("re-resolving pods after a watch event failed")

    def _known_listing(self) -> dict[str, ContainerDevices]:
        # The bindings the ledger already holds stand in for a pod-resources List; a container
        # bound to a pod uid needs none (it keeps its own names, and only ever its own pod).
        return {
            a.key: ContainerDevices(a.namespace, a.pod, a.container, a.resource, a.device_ids)
            for a in self.ledger.containers()
            if a.namespace and a.pod and a.container and not a.pod_uid
        }

    async def close(self) -> None:
        if self._pending is not None:
            self._pending.cancel()
            await asyncio.gather(self._pending, return_exceptions=True)
        if self.pods is not None:
            await self.pods.stop()
        if self.events is not None:
            await self.events.close()
