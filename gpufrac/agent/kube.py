"""The agent's calls to the Kubernetes apiserver: API client setup, pods, Events, its Node.

* make_api_client: in-cluster service account, a kubeconfig, or an explicit host.
* PodCache: this node's pods, fed by a list + watch (fieldSelector spec.nodeName)
  running in one dedicated thread; every change is handed to the agent's asyncio
  loop with call_soon_threadsafe, so cache state is only touched on the loop.
  A watch that ends is resumed from the last resourceVersion; 410 Gone (the
  apiserver compacted past it) means relist and diff, so deletions missed while
  disconnected are still seen.
* EventRecorder: core/v1 Events on pods, aggregated like client-go does (the same
  object + reason + message bumps count and lastTimestamp of the existing Event); and,
  in the same ordered queue, the DisruptionTarget condition on a pod whose processes
  were killed to reclaim GPU memory (pods/status, as Kubernetes marks its own disruptions).
* NodeLabeler: the agent's gpufrac.dev/ labels on its own Node (gpufrac.agent.nodelabels
  decides them), patched from a worker thread; no other label is ever touched.

The calls made elsewhere: the idle reaper evicts pods itself (gpufrac.agent.idle.PodEvictor:
the policy/v1 Eviction subresource, a pod read to tell a gone pod from an unserved
subresource, a DELETE only as the fallback), on an API client built by make_api_client.

An apiserver that is slow, down or refusing never stalls the loop or crashes the
agent: blocking calls run in threads, errors are logged and counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kubernetes import client, config, watch
from kubernetes.client.rest import ApiException

log = logging.getLogger(__name__)

COMPONENT = "gpufrac-agent"
MAX_MESSAGE = 1024  # the apiserver rejects longer Event messages


class KubeConfigError(RuntimeError):
    """No way to reach the apiserver was found."""


def make_api_client(
    host: str | None = None, kubeconfig: str | None = None, context: str | None = None
) -> client.ApiClient:
    """An ApiClient: explicit host, else in-cluster, else kubeconfig ($KUBECONFIG or ~/.kube/config)."""
    cfg = client.Configuration()
    if host:
        cfg.host = host.rstrip("/")
    elif kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config(client_configuration=cfg)
    else:
        try:
            config.load_kube_config(config_file=kubeconfig, context=context, client_configuration=cfg)
        except (config.ConfigException, OSError) as e:
            raise KubeConfigError(
                f"cannot reach the apiserver: not in a cluster and no usable kubeconfig ({e})"
            ) from e
    return client.ApiClient(cfg)


@dataclass(frozen=True)
class PodInfo:
    """What the agent needs of a pod (kept small: a node may run hundreds)."""

    namespace: str
    name: str
    uid: str
    node_name: str
    annotations: Mapping[str, str] = field(default_factory=dict)
    priority: int | None = None
    containers: tuple[str, ...] = ()  # init containers included
    phase: str = ""
    deleting: bool = False
    resource_version: str = ""
    # status.*ContainerStatuses[].containerID (runtime prefix stripped) -> container name:
    # the arbiter turns a caller's cgroup container ID into its container with it.
    container_ids: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> PodInfo:
        meta = raw.get("metadata") or {}
        spec = raw.get("spec") or {}
        names = [c.get("name", "") for key in ("initContainers", "containers") for c in spec.get(key) or []]
        prio = spec.get("priority")
        return cls(
            namespace=meta.get("namespace") or "",
            name=meta.get("name") or "",
            uid=meta.get("uid") or "",
            node_name=spec.get("nodeName") or "",
            annotations=dict(meta.get("annotations") or {}),
            priority=prio if isinstance(prio, int) and not isinstance(prio, bool) else None,
            containers=tuple(names),
            phase=(raw.get("status") or {}).get("phase") or "",
            deleting=bool(meta.get("deletionTimestamp")),
            resource_version=meta.get("resourceVersion") or "",
            container_ids={
                cs["containerID"].split("://", 1)[-1]: cs["name"]
                for key in ("initContainerStatuses", "containerStatuses", "ephemeralContainerStatuses")
                for cs in (raw.get("status") or {}).get(key) or []
                if cs.get("containerID") and cs.get("name")
            },
        )


PodListener = Callable[[str, PodInfo], None]


def _decode(resp: Any) -> dict[str, Any]:
    """The JSON body of a _preload_content=False response (we skip the model classes)."""
    data = resp.data if hasattr(resp, "data") else resp.read()
    return json.loads(data)


class PodCache:
    """This node's pods, kept current by a watch; read on the agent's loop."""

    def __init__(
        self,
        api: client.ApiClient,
        node_name: str,
        *,
        watch_timeout: int = 300,
        request_timeout: float = 30.0,
        backoff: tuple[float, float] = (0.5, 30.0),
    ) -> None:
        self.node_name = node_name
        self._v1 = client.CoreV1Api(api)
        self._watch_timeout = watch_timeout
        self._request_timeout = request_timeout
        self._backoff = backoff
        self._pods: dict[tuple[str, str], PodInfo] = {}
        self._deletions = 0  # pods the cache has dropped so far (fetch() checks it)
        self._by_uid: dict[str, tuple[str, str]] = {}
        self._listeners: list[PodListener] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._watch: watch.Watch | None = None
        self._synced: asyncio.Event | None = None
        # Counters (read by metrics and tests).
        self.relists = 0
        self.watches = 0
        self.errors = 0

    # -- reading (on the loop) -------------------------------------------------------------------

    def get(self, namespace: str, name: str) -> PodInfo | None:
        return self._pods.get((namespace, name))

    def by_uid(self, uid: str) -> PodInfo | None:
        key = self._by_uid.get(uid)
        return self._pods.get(key) if key else None

    def pods(self) -> list[PodInfo]:
        return list(self._pods.values())

    def subscribe(self, listener: PodListener) -> None:
        """listener(kind, pod) on the loop for every change: ADDED, MODIFIED, DELETED."""
        self._listeners.append(listener)

    @property
    def synced(self) -> bool:
        return self._synced is not None and self._synced.is_set()

    async def wait_synced(self, timeout: float | None = None) -> bool:
        """True once the first list has landed in the cache."""
        assert self._synced is not None, "start() first"
        try:
            await asyncio.wait_for(self._synced.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    async def fetch(self, namespace: str, name: str) -> PodInfo | None:
        """GET a pod the watch has not delivered yet (None if absent or the apiserver fails)."""

        def get() -> dict[str, Any]:
            resp = self._v1.read_namespaced_pod(
                name, namespace, _preload_content=False, _request_timeout=self._request_timeout
            )
            return _decode(resp)

        before, deletions = self.get(namespace, name), self._deletions
        try:
            raw = await asyncio.to_thread(get)
        except ApiException as e:
            if e.status != 404:
                self.errors += 1
                log.warning("GET pod %s/%s failed: %s %s", namespace, name, e.status, e.reason)
            return None
        except Exception as e:  # connection refused, timeouts, bad JSON
            self.errors += 1
            log.warning("GET pod %s/%s failed: %s", namespace, name, e)
            return None
        pod = PodInfo.from_dict(raw)
        # The watch may have moved on while the GET was in flight: a change it delivered
        # meanwhile is at least as new, and a pod it deleted meanwhile must not come back.
        changed = self.get(namespace, name) is not before or self._deletions != deletions
        if pod.node_name == self.node_name and not changed:
            self._apply("MODIFIED" if before else "ADDED", pod)
        return pod

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the watch thread; call on the agent's loop."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._synced = asyncio.Event()
        self._stopping.clear()
        self._thread = threading.Thread(target=self._run, name="pod-watch", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stopping.set()
        w = self._watch
        if w is not None:
            w.stop()  # shuts the socket down, which unblocks the thread's read
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, self._request_timeout + 5)
            self._thread = None

    # -- the watch thread ------------------------------------------------------------------------

    def _deliver(self, fn: Callable[..., None], *args: Any) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: the agent is shutting down
            self._stopping.set()

    def _run(self) -> None:
        failures = 0  # consecutive; a watch that stayed up a while resets it
        while not self._stopping.is_set():
            started = time.monotonic()
            try:
                rv = self._relist()
                while not self._stopping.is_set():
                    started = time.monotonic()
                    rv = self._watch_once(rv)
                    failures = 0 if time.monotonic() - started >= 1.0 else failures + 1
                    if failures:  # a server that ends watches at once must not spin this thread
                        self._stopping.wait(self._delay(failures))
                continue
            except ApiException as e:
                if self._stopping.is_set():
                    break
                if time.monotonic() - started >= 1.0:
                    failures = 0
                failures += 1
                if e.status == 410:
                    log.info("pod watch expired (410 Gone); relisting")
                    if failures == 1:
                        continue  # relist at once, but never in a tight loop
                else:
                    self.errors += 1
                    log.warning("pod watch failed: %s %s", e.status, e.reason)
            except Exception as e:  # urllib3 connection errors, timeouts, a socket shut by stop()
                if self._stopping.is_set():
                    break
                failures += 1
                self.errors += 1
                log.warning("pod watch failed: %s: %s", type(e).__name__, e)
            self._stopping.wait(self._delay(failures))

    def _delay(self, failures: int) -> float:
        return min(self._backoff[1], self._backoff[0] * 2 ** max(0, failures - 1))

    def _relist(self) -> str | None:
        resp = self._v1.list_pod_for_all_namespaces(
            field_selector=f"spec.nodeName={self.node_name}",
            _preload_content=False,
            _request_timeout=self._request_timeout,
        )
        body = _decode(resp)
        self.relists += 1
        pods = [PodInfo.from_dict(raw) for raw in body.get("items") or []]
        self._deliver(self._replace, pods)
        rv = (body.get("metadata") or {}).get("resourceVersion")
        return rv if rv and rv.isdigit() else None

    def _watch_once(self, rv: str | None) -> str | None:
        """One watch request until the server ends it; returns the resourceVersion to resume from."""
        w = watch.Watch(return_type="object")  # raw dicts: PodInfo needs a few fields only
        self._watch = w
        self.watches += 1
        kwargs: dict[str, Any] = {
            "field_selector": f"spec.nodeName={self.node_name}",
            "timeout_seconds": self._watch_timeout,
            "allow_watch_bookmarks": True,
            # The server ends the watch after timeout_seconds; a silent dead
            # connection is cut by the read timeout a little later.
            "_request_timeout": (self._request_timeout, self._watch_timeout + self._request_timeout),
        }
        if rv:
            kwargs["resource_version"] = rv
        try:
            for event in w.stream(self._v1.list_pod_for_all_namespaces, **kwargs):
                kind = event["type"]
                if kind in ("ADDED", "MODIFIED", "DELETED"):
                    pod = PodInfo.from_dict(event["raw_object"])
                    self._deliver(self._apply, kind, pod)
                    rv = pod.resource_version or rv
                elif kind == "BOOKMARK":
                    rv = w.resource_version or rv
                if self._stopping.is_set():
                    break
        finally:
            self._watch = None
        return rv

    # -- cache updates (on the loop) --------------------------------------------------------------

    def _replace(self, pods: list[PodInfo]) -> None:
        fresh = {(p.namespace, p.name): p for p in pods if p.node_name == self.node_name}
        for key, old in list(self._pods.items()):
            if key not in fresh:
                self._apply("DELETED", old)
        for pod in fresh.values():
            self._apply("ADDED", pod)
        assert self._synced is not None
        self._synced.set()

    def _apply(self, kind: str, pod: PodInfo) -> None:
        key = (pod.namespace, pod.name)
        old = self._pods.get(key)
        if kind == "DELETED" or pod.node_name != self.node_name:
            if old is None:
                return
            del self._pods[key]
            self._by_uid.pop(old.uid, None)
            self._deletions += 1
            self._notify("DELETED", old)
            return
        if old == pod:
            return  # a replay (re-watch, relist) that changes nothing
        if old is not None and old.uid != pod.uid:
            # Same name, new pod: the old one is gone.
            self._by_uid.pop(old.uid, None)
            self._notify("DELETED", old)
            old = None
        self._pods[key] = pod
        self._by_uid[pod.uid] = key
        self._notify("ADDED" if old is None else "MODIFIED", pod)

    def _notify(self, kind: str, pod: PodInfo) -> None:
        for listener in list(self._listeners):
            try:
                listener(kind, pod)
            except Exception:
                log.exception("pod listener failed on %s %s/%s", kind, pod.namespace, pod.name)


# -- Events ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ObjectRef:
    """The object an Event is about (core/v1 ObjectReference)."""

    kind: str
    name: str
    namespace: str = ""
    uid: str = ""
    api_version: str = "v1"
    field_path: str = ""

    @classmethod
    def pod(cls, pod: PodInfo, container: str | None = None) -> ObjectRef:
        return cls.pod_named(pod.namespace, pod.name, pod.uid, container)

    @classmethod
    def pod_named(cls, namespace: str, name: str, uid: str = "", container: str | None = None) -> ObjectRef:
        """A pod (or one of its containers, as kubectl describe shows it) by name."""
        path = f"spec.containers{{{container}}}" if container else ""
        return cls("Pod", name, namespace, uid, field_path=path)


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


# The pod condition Kubernetes sets on a pod a disruption is about to end (preemption,
# the Eviction API, taint eviction); a Job's podFailurePolicy can match it (onPodConditions),
# so a pod failed by a GPU-memory reclaim need not count as the application's failure.
DISRUPTION_TARGET = "DisruptionTarget"


class EventRecorder:
    """Posts Events without ever blocking or failing the caller.

    record() is called on the agent's loop and only queues; one worker task sends
    (the HTTP call in a thread), so repeats of one Event are aggregated in order.
    """

    def __init__(
        self,
        api: client.ApiClient,
        node_name: str,
        *,
        component: str = COMPONENT,
        max_pending: int = 1024,
        cache_size: int = 4096,
        request_timeout: float = 10.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._v1 = client.CoreV1Api(api)
        self.node_name = node_name
        self.component = component
        self._max_pending = max_pending
        self._cache: OrderedDict[tuple[Any, ...], _Seen] = OrderedDict()
        self._cache_size = cache_size
        self._request_timeout = request_timeout
        self._clock = clock
        self._queue: asyncio.Queue[_Pending | _Condition] | None = None
        self._worker: asyncio.Task[None] | None = None
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

    def _put(self, item: _Pending | _Condition) -> None:
        if self._queue is None:
            self._queue = asyncio.Queue()
            self._worker = asyncio.get_running_loop().create_task(self._work(), name="event-recorder")
        if self._queue.qsize() >= self._max_pending:
            self.dropped += 1
            ref = item.ref
            log.warning("event queue full; dropped %s on %s/%s", item.reason, ref.namespace, ref.name)
            return
        self._queue.put_nowait(item)

    def warning(self, ref: ObjectRef, reason: str, message: str) -> None:
        self.record(ref, "Warning", reason, message)

    def normal(self, ref: ObjectRef, reason: str, message: str) -> None:
        self.record(ref, "Normal", reason, message)

    async def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued Event was sent (or failed); False on timeout."""
        if self._queue is None:
            return True
        try:
            await asyncio.wait_for(self._queue.join(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    async def close(self, timeout: float = 5.0) -> None:
        await self.flush(timeout)
        if self._worker is not None:
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)
            self._worker, self._queue = None, None

    async def _work(self) -> None:
        assert self._queue is not None
        while True:
            item = await self._queue.get()
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
            finally:
                self._queue.task_done()

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
        await asyncio.to_thread(
            self._v1.create_namespaced_event, namespace, event, _request_timeout=self._request_timeout
        )
        self.created += 1
        self._cache[key] = _Seen(name, namespace, 1)
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)

    def _event_name(self, obj_name: str) -> str:
        # Like client-go: <object>.<hex nanoseconds>; strictly increasing so never a duplicate.
        self._last_ns = max(time.time_ns(), self._last_ns + 1)
        return f"{obj_name}.{self._last_ns:x}"


# -- Node labels -------------------------------------------------------------------------------------


class NodeLabeler:
    """Keeps a set of labels on this agent's Node as the agent last asked (update()).

    update() is called on the agent's loop and returns at once; one task applies the
    newest wish in a worker thread, so a burst of changes costs one PATCH. The first sync
    reads the Node and removes labels of `owned` that are no longer wished for (left by an
    earlier run of the agent); later syncs send only what changed. Labels outside `owned` are never
    touched. A failed call is logged, counted and retried with backoff until it lands.
    """

    def __init__(
        self,
        api: client.ApiClient,
        node_name: str,
        owned: frozenset[str],
        *,
        request_timeout: float = 10.0,
        backoff: tuple[float, float] = (1.0, 60.0),
    ) -> None:
        self._v1 = client.CoreV1Api(api)
        self.node_name = node_name
        self.owned = owned
        self._request_timeout = request_timeout
        self._backoff = backoff
        self._wanted: dict[str, str] | None = None
        self._applied: dict[str, str] | None = None  # None: the Node has not been read yet
        self._task: asyncio.Task[None] | None = None
        self._kick = asyncio.Event()
        # Counters (read by tests).
        self.patches = 0
        self.errors = 0

    @property
    def applied(self) -> dict[str, str] | None:
        return None if self._applied is None else dict(self._applied)

    def update(self, labels: Mapping[str, str]) -> None:
        """Wish for exactly these owned labels (others of `owned` are removed); never blocks."""
        unknown = set(labels) - self.owned
        if unknown:
            raise ValueError(f"labels {sorted(unknown)} are not owned by this labeler")
        self._wanted = dict(labels)
        self._kick.set()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="node-labels")

    async def settled(self, timeout: float | None = None) -> bool:
        """True once the Node carries the last wish (tests, shutdown)."""

        async def wait() -> None:
            while self._wanted is not None and self._applied != self._wanted:
                await asyncio.sleep(0.05)

        try:
            await asyncio.wait_for(wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        failures = 0
        while True:
            self._kick.clear()
            wanted = self._wanted
            if wanted is None or wanted == self._applied:
                await self._kick.wait()
                continue
            try:
                if self._applied is None:
                    self._applied = await asyncio.to_thread(self._read)
                if wanted != self._applied:
                    await asyncio.to_thread(self._patch, self._changes(wanted, self._applied))
                    self._applied = dict(wanted)
                failures = 0
            except Exception as e:
                failures += 1
                self.errors += 1
                status = getattr(e, "status", None)
                log.warning(
                    "labelling node %s failed: %s",
                    self.node_name,
                    f"{status} {getattr(e, 'reason', '')}".strip() if status else e,
                )
                delay = min(self._backoff[1], self._backoff[0] * 2 ** (failures - 1))
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._kick.wait(), delay)

    def _read(self) -> dict[str, str]:
        """The owned labels the Node carries now."""
        node = _decode(
            self._v1.read_node(self.node_name, _preload_content=False, _request_timeout=self._request_timeout)
        )
        labels = (node.get("metadata") or {}).get("labels") or {}
        return {k: v for k, v in labels.items() if k in self.owned}

    def _changes(self, wanted: Mapping[str, str], have: Mapping[str, str]) -> dict[str, str | None]:
        changes: dict[str, str | None] = {k: v for k, v in wanted.items() if have.get(k) != v}
        changes.update({k: None for k in have if k not in wanted})  # None removes a label
        return changes

    def _patch(self, changes: Mapping[str, str | None]) -> None:
        # A merge patch of metadata.labels: the Node's other labels stay as they are.
        self._v1.patch_node(
            self.node_name,
            {"metadata": {"labels": dict(changes)}},
            _request_timeout=self._request_timeout,
            _content_type="application/merge-patch+json",
        )
        self.patches += 1
        log.info(
            "node %s labels: %s",
            self.node_name,
            ", ".join(f"{k}={v}" if v is not None else f"-{k}" for k, v in sorted(changes.items())),
        )
