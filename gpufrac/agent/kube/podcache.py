"""PodCache: this node's pods, fed by a list + watch (fieldSelector spec.nodeName) running in
one dedicated thread; every change is handed to the agent's asyncio loop with
call_soon_threadsafe, so cache state is only touched on the loop. A watch that ends is
resumed from the last resourceVersion; 410 Gone (the apiserver compacted past it) means
relist and diff, so deletions missed while disconnected are still seen. fetch() (a direct
GET) may put a pod in the cache ahead of the watch; the watch's later events for an older pod
of the same name are then dropped, so a deleted pod never comes back."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException

log = logging.getLogger(__name__)


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
    # Container name -> the ResourceClaims (by name, in the pod's namespace) it uses: its
    # resources.claims, through spec.resourceClaims (a claim by name) and
    # status.resourceClaimStatuses (the claim made from a template for this pod).
    claims: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

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
            claims=_claims(spec, raw.get("status") or {}),
        )


def _claims(spec: Mapping[str, Any], status: Mapping[str, Any]) -> dict[str, tuple[str, ...]]:
    """Container name -> the names of the ResourceClaims it uses (DRA)."""
    named: dict[str, str] = {}
    for rc in spec.get("resourceClaims") or []:
        if isinstance(rc, Mapping) and rc.get("name") and rc.get("resourceClaimName"):
            named[rc["name"]] = rc["resourceClaimName"]
    for rcs in status.get("resourceClaimStatuses") or []:
        if isinstance(rcs, Mapping) and rcs.get("name") and rcs.get("resourceClaimName"):
            named.setdefault(rcs["name"], rcs["resourceClaimName"])
    out: dict[str, tuple[str, ...]] = {}
    for key in ("initContainers", "containers"):
        for c in spec.get(key) or []:
            refs = ((c.get("resources") or {}).get("claims") or []) if isinstance(c, Mapping) else []
            names = tuple(named[r["name"]] for r in refs if isinstance(r, Mapping) and r.get("name") in named)
            if names:
                out[c.get("name", "")] = names
    return out


PodListener = Callable[[str, PodInfo], None]


def decode(resp: Any) -> dict[str, Any]:
    """The JSON body of a _preload_content=False response (we skip the model classes)."""
    data = resp.data if hasattr(resp, "data") else resp.read()
    decoded: dict[str, Any] = json.loads(data)
    return decoded


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
        # (namespace, name) -> uid of a pod fetch() put in the cache that the watch has not
        # delivered yet: the watch's events for other pods of that name come from before it.
        self._ahead: dict[tuple[str, str], str] = {}
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
            return decode(resp)

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
            if before is None or before.uid != pod.uid:
                self._ahead[(namespace, name)] = pod.uid  # ahead of the watch: _watched()
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
            w.stop()  # type: ignore[no-untyped-call]  # kubernetes.watch is untyped; shuts the socket down, which unblocks the thread's read
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
        return float(min(self._backoff[1], self._backoff[0] * 2 ** max(0, failures - 1)))

    def _relist(self) -> str | None:
        resp = self._v1.list_pod_for_all_namespaces(
            field_selector=f"spec.nodeName={self.node_name}",
            _preload_content=False,
            _request_timeout=self._request_timeout,
        )
        body = decode(resp)
        self.relists += 1
        pods = [PodInfo.from_dict(raw) for raw in body.get("items") or []]
        self._deliver(self._replace, pods)
        rv = (body.get("metadata") or {}).get("resourceVersion")
        return rv if rv and rv.isdigit() else None

    def _watch_once(self, rv: str | None) -> str | None:
        """One watch request until the server ends it; returns the resourceVersion to resume from."""
        # kubernetes.watch is untyped. Raw dicts: PodInfo needs a few fields only.
        w = watch.Watch(return_type="object")  # type: ignore[no-untyped-call]
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
            for event in w.stream(self._v1.list_pod_for_all_namespaces, **kwargs):  # type: ignore[no-untyped-call]
                kind = event["type"]
                if kind in ("ADDED", "MODIFIED", "DELETED"):
                    pod = PodInfo.from_dict(event["raw_object"])
                    self._deliver(self._watched, kind, pod)
                    rv = pod.resource_version or rv
                elif kind == "BOOKMARK":
                    rv = w.resource_version or rv
                if self._stopping.is_set():
                    break
        finally:
            self._watch = None
        return rv

    # -- cache updates (on the loop) --------------------------------------------------------------

    def _watched(self, kind: str, pod: PodInfo) -> None:
        """A watch event. Under a name whose pod fetch() read ahead of the watch, the events
        of other pods of that name are from before that pod existed (names are unique, the
        watch keeps the apiserver's order): they would bring a deleted pod back."""
        key = (pod.namespace, pod.name)
        ahead = self._ahead.get(key)
        if ahead is not None:
            if pod.uid != ahead:
                return
            del self._ahead[key]  # the watch has caught up with it
        self._apply(kind, pod)

    def _replace(self, pods: list[PodInfo]) -> None:
        self._ahead.clear()  # a list is the whole truth as of its answer
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
