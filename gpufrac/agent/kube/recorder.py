"""EventRecorder: core/v1 Events on pods, aggregated like client-go does (the same object +
reason + message bumps count and lastTimestamp of the existing Event); and, in the same
ordered queue, the DisruptionTarget condition on a pod whose processes were killed to
reclaim GPU memory (pods/status, as Kubernetes marks its own disruptions).

The queue is shared fairly between the objects Events are about: each object has a queue
of its own (in order), capped at its share, and the sender takes one item from each object
in turn. So one pod whose annotations make the agent say a lot (a tenant controls them)
neither pushes a neighbour's Events out of the queue nor holds them up behind its own;
what is dropped is counted and logged at most once a minute."""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from gpufrac.agent.kube.objref import ObjectRef

COMPONENT = "gpufrac-agent"
MAX_MESSAGE = 1024  # the apiserver rejects longer Event messages
DROP_LOG_EVERY = 60.0  # seconds between two log lines about dropped Events

log = logging.getLogger(__name__)


def _sent(call: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """One write to the apiserver (in a worker thread), its answer read and dropped: the client's
    model of it (an Event, a Pod) is never made, which cost more than the request itself."""
    resp = call(*args, _preload_content=False, **kwargs)
    resp.data  # noqa: B018 - read to its end, the connection goes back to the pool


def _timestamp(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, tz=datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class _Seen:
    name: str
    namespace: str
    count: int


@dataclass(frozen=True)
class _Pending:
    ref: ObjectRef
    type: str
    reason: str
    message: str


@dataclass(frozen=True)
class _Condition:
    """A pod condition to set (True) through the pods/status subresource."""

    ref: ObjectRef
    type: str
    reason: str
    message: str


_Item = _Pending | _Condition
_Object = tuple[str, str, str]  # kind, namespace, name: whose share of the queue an item takes


def _object(ref: ObjectRef) -> _Object:
    return (ref.kind, ref.namespace, ref.name)


# The pod condition Kubernetes sets on a pod a disruption is about to end (preemption,
# the Eviction API, taint eviction); a Job's podFailurePolicy can match it (onPodConditions),
# so a pod failed by a GPU-memory reclaim need not count as the application's failure.
DISRUPTION_TARGET = "DisruptionTarget"


class EventRecorder:
    """Posts Events without ever blocking or failing the caller.

    record() is called on the agent's loop and only queues; one worker task sends
    (the HTTP call in a thread), so repeats of one Event are aggregated in order.
    At most `max_pending` items wait, at most `per_object` of them about one object
    (default: a 16th of the queue, at least 16); when the queue is full, the object
    holding the most of it gives up its newest item to an object holding fewer.
    """

    def __init__(
        self,
        api: client.ApiClient,
        node_name: str,
        *,
        component: str = COMPONENT,
        max_pending: int = 1024,
        per_object: int | None = None,
        cache_size: int = 4096,
        request_timeout: float = 10.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._v1 = client.CoreV1Api(api)
        self.node_name = node_name
        self.component = component
        self._max_pending = max_pending
        self._per_object = per_object or min(max_pending, max(16, max_pending // 16))
        self._cache: OrderedDict[tuple[Any, ...], _Seen] = OrderedDict()
        self._cache_size = cache_size
        self._request_timeout = request_timeout
        self._clock = clock
        # Items waiting, by object, objects in the order the sender visits them.
        self._pending: OrderedDict[_Object, deque[_Item]] = OrderedDict()
        self._waiting = 0  # items in _pending
        self._wake: asyncio.Event | None = None  # set when something is queued
        self._idle: asyncio.Event | None = None  # set while nothing is queued or being sent
        self._worker: asyncio.Task[None] | None = None
        self._untold = 0  # drops not logged yet
        self._told_at = -DROP_LOG_EVERY  # time.monotonic() of the last drop log line
        self._last_ns = 0
        # Counters (read by metrics and tests).
        self.created = 0
        self.aggregated = 0
        self.errors = 0
        self.dropped = 0
        self.conditions = 0  # pod conditions set

    def record(self, ref: ObjectRef, type_: str, reason: str, message: str) -> None:
        """Queue an Event (type_ Normal or Warning, reason CamelCase); never raises, never blocks."""
        if len(message) > MAX_MESSAGE:
            message = message[: MAX_MESSAGE - 3] + "..."
        self._put(_Pending(ref, type_, reason, message))

    def disruption(self, ref: ObjectRef, reason: str, message: str) -> None:
        """Queue the DisruptionTarget condition (status True) on the pod of `ref`, after the
        Events queued before it; never raises, never blocks. A pod of the same name but
        another uid is left alone (the uid is a precondition of the patch)."""
        if len(message) > MAX_MESSAGE:
            message = message[: MAX_MESSAGE - 3] + "..."
        self._put(_Condition(ref, DISRUPTION_TARGET, reason, message))

    def _put(self, item: _Item) -> None:
        if self._wake is None or self._idle is None:
            self._wake, self._idle = asyncio.Event(), asyncio.Event()
            self._worker = asyncio.get_running_loop().create_task(self._work(), name="event-recorder")
        key = _object(item.ref)
        mine = self._pending.get(key)
        held = len(mine) if mine is not None else 0
        if held >= self._per_object:
            self._drop(item, "its share of the queue is full")
            return
        if self._waiting >= self._max_pending:
            # Full: the object holding the most gives up its newest item, unless that would
            # leave it holding no more than this one does.
            heaviest = max(self._pending.values(), key=len)
            if len(heaviest) <= held + 1:
                self._drop(item, "the queue is full")
                return
            self._waiting -= 1
            self._drop(heaviest.pop(), "the queue is full and that object holds the most of it")
        if mine is None:
            mine = self._pending[key] = deque()
        mine.append(item)
        self._waiting += 1
        self._idle.clear()
        self._wake.set()

    def _drop(self, item: _Item, why: str) -> None:
        self.dropped += 1
        self._untold += 1
        now = time.monotonic()
        if now - self._told_at >= DROP_LOG_EVERY:
            ref = item.ref
            log.warning(
                "event queue: %d Event(s) dropped since the last report; the latest %s on %s/%s (%s)",
                self._untold, item.reason, ref.namespace, ref.name, why,
            )  # fmt: skip
            self._told_at, self._untold = now, 0

    def warning(self, ref: ObjectRef, reason: str, message: str) -> None:
        self.record(ref, "Warning", reason, message)

    def normal(self, ref: ObjectRef, reason: str, message: str) -> None:
        self.record(ref, "Normal", reason, message)

    async def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued Event was sent (or failed); False on timeout."""
        if self._idle is None:
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    async def close(self, timeout: float = 5.0) -> None:
        await self.flush(timeout)
        if self._worker is not None:
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)
            self._worker, self._wake, self._idle = None, None, None
        if self._untold:
            log.warning("event queue: %d Event(s) dropped since the last report", self._untold)
            self._untold = 0
        self._pending.clear()
        self._waiting = 0

    def _next(self) -> _Item | None:
        """The next item to send: the oldest of the object whose turn it is."""
        if not self._pending:
            return None
        key, items = next(iter(self._pending.items()))
        item = items.popleft()
        self._waiting -= 1
        if items:
            self._pending.move_to_end(key)  # its next item waits for every other object's turn
        else:
            del self._pending[key]
        return item

    async def _work(self) -> None:
        assert self._wake is not None and self._idle is not None
        while True:
            item = self._next()
            if item is None:
                self._idle.set()
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                if isinstance(item, _Condition):
                    await self._set_condition(item)
                else:
                    await self._send(item)
            except Exception as e:
                self.errors += 1
                log.warning(
                    "posting %s %s on %s/%s failed: %s",
                    "condition" if isinstance(item, _Condition) else "Event",
                    item.reason,
                    item.ref.namespace,
                    item.ref.name,
                    getattr(e, "reason", None) or e,
                )

    async def _set_condition(self, item: _Condition) -> None:
        ref = item.ref
        condition = {
            "type": item.type,
            "status": "True",
            "reason": item.reason,
            "message": item.message,
            "lastTransitionTime": _timestamp(self._clock()),
        }
        # A strategic merge patch: conditions merge by type, so the kubelet's own stay.
        body: dict[str, Any] = {"status": {"conditions": [condition]}}
        if ref.uid:
            body["metadata"] = {"uid": ref.uid}
        await asyncio.to_thread(
            _sent,
            self._v1.patch_namespaced_pod_status,
            ref.name,
            ref.namespace,
            body,
            _request_timeout=self._request_timeout,
        )
        self.conditions += 1

    async def _send(self, item: _Pending) -> None:
        ref = item.ref
        key = (
            ref.kind,
            ref.namespace,
            ref.name,
            ref.uid,
            ref.field_path,
            item.type,
            item.reason,
            item.message,
        )
        now = _timestamp(self._clock())
        seen = self._cache.get(key)
        if seen is not None:
            body = {"count": seen.count + 1, "lastTimestamp": now}
            try:
                await asyncio.to_thread(
                    _sent,
                    self._v1.patch_namespaced_event,
                    seen.name,
                    seen.namespace,
                    body,
                    _request_timeout=self._request_timeout,
                )
            except ApiException as e:
                if e.status != 404:
                    raise
                # The Event expired (the apiserver keeps them ~1 h): start a new one.
            else:
                seen.count += 1
                self._cache.move_to_end(key)
                self.aggregated += 1
                return
        namespace = ref.namespace or "default"  # Events on cluster objects live in default
        name = self._event_name(ref.name)
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": name, "namespace": namespace},
            "involvedObject": {
                k: v
                for k, v in {
                    "apiVersion": ref.api_version,
                    "kind": ref.kind,
                    "name": ref.name,
                    "namespace": ref.namespace,
                    "uid": ref.uid,
                    "fieldPath": ref.field_path,
                }.items()
                if v
            },
            "reason": item.reason,
            "message": item.message,
            "type": item.type,
            "count": 1,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "source": {"component": self.component, "host": self.node_name},
            "reportingComponent": self.component,
            "reportingInstance": self.node_name,
        }
        # The client sends a plain dict body as it is (its hints name only the model class).
        await asyncio.to_thread(
            _sent,
            self._v1.create_namespaced_event,
            namespace,
            event,
            _request_timeout=self._request_timeout,
        )
        self.created += 1
        self._cache[key] = _Seen(name, namespace, 1)
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)

    def _event_name(self, obj_name: str) -> str:
        # Like client-go: <object>.<hex nanoseconds>; strictly increasing so never a duplicate.
        self._last_ns = max(time.time_ns(), self._last_ns + 1)
        return f"{obj_name}.{self._last_ns:x}"
