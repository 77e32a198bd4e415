"""A Kubernetes apiserver for tests and the demo: kmock's KubernetesEmulator on localhost,
in its own thread.

kmock is aiohttp-based; the kubernetes client is synchronous. So the emulator
runs on an event loop in a background thread and tests (and the agent's worker
threads) reach it over real HTTP on 127.0.0.1 with the real kubernetes client.

The emulator is extended where the agent depends on apiserver behaviour that
kmock 0.8 leaves out: field selectors on list/watch (spec.nodeName), uid,
resourceVersion and creationTimestamp on objects, watch timeoutSeconds,
410 Gone for expired resource versions (`KubeServer.expire_watches`), a watch
that lags behind (`KubeServer.hold_watches`), the
resource.k8s.io/v1 kinds of dynamic resource allocation (ResourceSlices,
ResourceClaims and their templates, DeviceClasses: stored as given, not
validated), PUT of a named object (update, with the resourceVersion precondition) and
DELETE on a collection (deletecollection, with a fieldSelector).

Tests get one per test from the `kube_server` fixture (tests/fixtures/kube.py);
the demo (`gpufrac run`) starts one itself. Over 500 lines: it is one emulator, each
extension above a few lines of the same request handler.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime
import threading
import uuid
from asyncio import FIRST_COMPLETED
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine, Iterator, Mapping
from typing import Any, TypeVar, cast

import aiohttp.web
import attrs
import kmock
from kmock._internal import aiobus, rendering
from kubernetes import client

T = TypeVar("T")
PODS = kmock.resource("v1/pods")
EVENTS = kmock.resource("v1/events")
# Dynamic resource allocation (resource.k8s.io/v1): what the DRA driver publishes and reads,
# and what a DRA install ships (DeviceClasses, claim templates).
RESOURCE_SLICES = kmock.resource("resource.k8s.io/v1/resourceslices")
RESOURCE_CLAIMS = kmock.resource("resource.k8s.io/v1/resourceclaims")
RESOURCE_CLAIM_TEMPLATES = kmock.resource("resource.k8s.io/v1/resourceclaimtemplates")
DEVICE_CLASSES = kmock.resource("resource.k8s.io/v1/deviceclasses")
HISTORY = 10_000  # watch events kept per resource for watches that resume from a version
REQUESTS_KEPT = 16  # requests kmock itself keeps (ApiServerEmulator._handle says why)


def _get_path(obj: Mapping[str, Any], dotted: str) -> str:
    cur: Any = obj
    for part in dotted.split("."):
        cur = cur.get(part) if isinstance(cur, Mapping) else None
    return "" if cur is None else str(cur)


def _selector_matches(obj: Mapping[str, Any], selector: str | None) -> bool:
    """Field selectors as the apiserver applies them: comma-joined field=value / field!=value."""
    if not selector:
        return True
    for term in selector.split(","):
        if "!=" in term:
            path, value = term.split("!=", 1)
            if _get_path(obj, path.strip()) == value.strip():
                return False
        else:
            path, value = term.replace("==", "=").split("=", 1)
            if _get_path(obj, path.strip()) != value.strip():
                return False
    return True


class ApiServerEmulator(kmock.KubernetesEmulator):
    """kmock's emulator plus the apiserver behaviours the agent relies on."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.resource_version = 0
        self.expired_before = 0  # watches from an older resourceVersion get 410 Gone
        self.closing = asyncio.Event()  # set when the server shuts down: open watches end
        self.expiry = asyncio.Event()  # set (then replaced) to give every open watch 410 Gone
        self.flowing = asyncio.Event()  # cleared while watches are held (KubeServer.hold_watches)
        self.flowing.set()
        self.resources["v1/pods"] = kmock.ResourceInfo(namespaced=True, kind="Pod", singular="pod")
        self.resources["v1/events"] = kmock.ResourceInfo(namespaced=True, kind="Event", singular="event")
        self.resources["v1/nodes"] = kmock.ResourceInfo(namespaced=False, kind="Node", singular="node")
        for path, namespaced, kind in (
            ("resource.k8s.io/v1/resourceslices", False, "ResourceSlice"),
            ("resource.k8s.io/v1/resourceclaims", True, "ResourceClaim"),
            ("resource.k8s.io/v1/resourceclaimtemplates", True, "ResourceClaimTemplate"),
            ("resource.k8s.io/v1/deviceclasses", False, "DeviceClass"),
        ):
            self.resources[path] = kmock.ResourceInfo(namespaced=namespaced, kind=kind, singular=kind.lower())
        self.history: dict[Any, list[tuple[int, Any]]] = collections.defaultdict(list)
        self.history_floor = 0  # watches from before the oldest kept event get 410 Gone
        self._buses = _RecordingBuses(self)
        self.request_log: list[tuple[str, str, dict[str, str]]] = []  # (method, path, query) of each
        # While set and not yet released: every read of pods (get, list, watch) waits, as an
        # apiserver that is slow or away would keep them (KubeServer.hold_pod_reads).
        self.pod_reads: asyncio.Event | None = None

    async def _handle(self, request: rendering.Request) -> Any:
        # kmock keeps every request and, to route each new one, runs its reactions' filters over
        # all of them: a request costs more with every request before it (a few hundred made a
        # GET take 0.4 s). The apiserver remembers none: kmock's log keeps the last few (the
        # current one included, as routing needs), and requests() reads a record of our own.
        self.request_log.append(
            (str(getattr(request.method, "value", request.method)), request.url.path, dict(request.params))
        )
        del self._requests[:-REQUESTS_KEPT]
        if self.pod_reads is not None and request.resource == PODS and request.method == kmock.method.GET:
            await self.pod_reads.wait()
        if (
            request.method == kmock.method.DELETE
            and request.resource is not None
            and request.name is None
            and request.action is None
        ):
            return await self._delete_collection(request)
        if (
            request.method == kmock.method.PUT
            and request.resource is not None
            and request.name is not None
            and isinstance(request.data, dict)
        ):
            return await self._replace(request)
        if request.action == kmock.action.UPDATE and request.name and isinstance(request.data, dict):
            await self._patch_preconditions(request)
        # Stamp what the apiserver sets on every write before kmock stores the object.
        if request.resource is not None and isinstance(request.data, dict):
            if request.action in (kmock.action.CREATE, kmock.action.UPDATE):
                self.resource_version += 1
                meta = request.data.setdefault("metadata", {})
                meta["resourceVersion"] = str(self.resource_version)
                if request.action == kmock.action.CREATE:
                    if (
                        request.namespace
                        and meta.setdefault("namespace", request.namespace) != request.namespace
                    ):
                        raise kmock.KubernetesError(
                            400, "BadRequest", "the namespace of the object does not match the request's"
                        )
                    meta.setdefault("uid", str(uuid.uuid4()))
                    now = datetime.datetime.now(tz=datetime.timezone.utc)
                    meta.setdefault("creationTimestamp", now.strftime("%Y-%m-%dT%H:%M:%SZ"))
        elif request.action == kmock.action.DELETE:
            self.resource_version += 1
        return await super()._handle(request)

    async def _delete_collection(self, request: rendering.Request) -> Any:
        """DELETE on a collection (deletecollection), which kmock does not route: every object of
        the resource (in the namespace, if the URL names one) that the fieldSelector matches is
        deleted, each with its DELETED watch event, as the apiserver does (the kubelet deletes its
        node's ResourceSlices so)."""
        assert request.resource is not None
        selector = request.params.get("fieldSelector")
        gone = 0
        async with self._lock:
            for (res, ns, _name), obj in list(self.objects.items()):
                if res != request.resource or obj.deleted:
                    continue
                if request.namespace is not None and ns != request.namespace:
                    continue
                if not _selector_matches(_plain(obj.raw), selector):
                    continue
                raw = obj.raw
                obj.delete()
                self.resource_version += 1
                await self._buses[request.resource].put({"type": "DELETED", "object": raw})
                gone += 1
        return aiohttp.web.json_response(
            {
                "apiVersion": "v1",
                "kind": "Status",
                "metadata": {},
                "status": "Success",
                "details": {"deleted": gone},
            }
        )

    async def _replace(self, request: rendering.Request) -> Any:
        """PUT of a named object (update/replace), which kmock does not route: the object becomes
        the body (uid and creationTimestamp kept, a new resourceVersion), 409 Conflict when the
        body names a resourceVersion that is no longer the object's, 404 when there is none."""
        assert request.resource is not None and request.name is not None
        key = (request.resource, request.namespace, request.name)
        body = request.data
        async with self._lock:
            try:
                obj = self.objects[key]
            except KeyError:
                obj = None
            if obj is None or obj.deleted:
                raise kmock.KubernetesError(404, "NotFound", f"{request.name} not found")
            stored = _plain(obj.raw)
            meta, have = body.setdefault("metadata", {}), stored.get("metadata") or {}
            wanted = meta.get("resourceVersion")
            if wanted and wanted != have.get("resourceVersion"):
                raise kmock.KubernetesError(
                    409,
                    "Conflict",
                    f"Operation cannot be fulfilled on {request.name}: the object has been modified; "
                    "please apply your changes to the latest version and try again",
                )
            self.resource_version += 1
            meta["resourceVersion"] = str(self.resource_version)
            for field in ("uid", "creationTimestamp", "namespace"):
                if field in have:
                    meta[field] = have[field]
            obj.patch(_replacing(stored, body))
            raw = obj.raw
            await self._buses[request.resource].put({"type": "MODIFIED", "object": raw})
        return aiohttp.web.json_response(_plain(raw))

    async def _patch_preconditions(self, request: rendering.Request) -> None:
        """What the apiserver does to a PATCH before it applies it, where kmock's plain
        recursive merge differs: metadata.uid in the patch is a precondition (409 on another
        object of that name), and a strategic merge patch of a pod merges
        status.conditions by type (kmock would replace the whole list)."""
        if request.resource is None or request.name is None:
            return  # not a write to a named object: nothing to check
        key = (request.resource, request.namespace, request.name)
        async with self._lock:
            try:
                obj = self.objects[key]
            except KeyError:
                return  # kmock answers 404
            stored = None if obj.deleted else _plain(obj.raw)
        if stored is None:
            return  # kmock answers 404
        data = request.data
        if not isinstance(data, dict):
            return  # _handle calls this for a dict body only
        uid = (data.get("metadata") or {}).get("uid")
        have = (stored.get("metadata") or {}).get("uid")
        if uid and have and uid != have:
            raise kmock.KubernetesError(
                409,
                "Conflict",
                f"Precondition failed: UID in precondition: {uid}, UID in object meta: {have}",
            )
        strategic = request.headers.get("Content-Type", "").startswith("application/strategic-merge-patch")
        conditions = (data.get("status") or {}).get("conditions")
        if strategic and request.resource == PODS and isinstance(conditions, list):
            merged = {c.get("type"): c for c in (stored.get("status") or {}).get("conditions") or []}
            for c in conditions:
                if isinstance(c, dict):
                    merged[c.get("type")] = {**merged.get(c.get("type"), {}), **c}
            data["status"]["conditions"] = list(merged.values())

    async def _serve_fetch(self, request: rendering.Request) -> Any:
        # A GET of one object by its key, as the apiserver serves it from its cache: kmock's
        # own compares the request with every stored object, which makes a node's worth of
        # ResourceClaims slow to read one by one (the DRA driver reads one per prepare).
        if request.resource is None or request.name is None:
            return await super()._serve_fetch(request)
        async with self._lock:
            try:
                obj = self.objects[request.resource, request.namespace, request.name]
            except KeyError:
                obj = None
            if obj is None or obj.deleted:
                raise kmock.KubernetesError(404, "NotFound", f"{request.name} not found")
            return obj.raw

    async def _serve_list(self, request: rendering.Request) -> Any:
        # kmock answers a list with a dict ({"items": [...], ...}).
        result = cast(dict[str, Any], await super()._serve_list(request))
        selector = request.params.get("fieldSelector")
        result["items"] = [o for o in result["items"] if _selector_matches(o, selector)]
        result["metadata"] = {"resourceVersion": str(self.resource_version)}
        return result

    async def _serve_watch(self, request: rendering.Request) -> AsyncIterator[Any]:
        # kmock's own watch snapshots the objects and only then joins the event bus, so a
        # write landing between the two is lost. Here the bus mark and the starting point are
        # taken together under the store lock, and a watch from a resourceVersion replays the
        # events after it (as the apiserver does) instead of re-sending every object.
        selector = request.params.get("fieldSelector")
        rv = request.params.get("resourceVersion", "")
        since = int(rv) if rv.isdigit() and int(rv) > 0 else None
        if since is not None and (since < self.expired_before or since < self.history_floor):
            yield b""
            yield _gone()
            return
        assert request.resource is not None
        bus = self._buses[request.resource]
        # Captured before any await, so an expiry can never slip between the check above and here.
        closing = asyncio.ensure_future(self.closing.wait())
        expired = asyncio.ensure_future(self.expiry.wait())
        step: asyncio.Future[Any] | None = None
        mark = inner = None
        try:
            async with self._lock:
                mark = await bus.mark()
                if since is not None:
                    first = [event for at, event in self.history[request.resource] if at > since]
                else:
                    objs = self._KubernetesEmulator__get_objs(request, strict=False)  # type: ignore[attr-defined]
                    first = [{"type": "ADDED", "object": obj.raw} for obj in objs if not obj.deleted]
            yield b""  # headers out: the client sees the stream open even if nothing happens
            timeout = request.params.get("timeoutSeconds")
            loop = asyncio.get_running_loop()
            deadline = None if timeout is None else loop.time() + float(timeout)
            inner = bus.stream(since=mark)
            for event in first:
                if self._wanted(request, event, selector):
                    if not await self._flowing(closing):
                        return
                    yield event
            while True:
                remaining = None if deadline is None else max(0.0, deadline - loop.time())
                step = asyncio.ensure_future(inner.__anext__())
                done, _ = await asyncio.wait(
                    {step, closing, expired}, timeout=remaining, return_when=FIRST_COMPLETED
                )
                if expired in done:
                    yield _gone()
                    return
                if step not in done:
                    return  # timeoutSeconds passed or the server shuts down: end as the apiserver does
                try:
                    event = step.result()
                except StopAsyncIteration:
                    return
                if isinstance(event, dict) and event.get("type") == "ERROR":
                    yield event
                    return
                if self._wanted(request, event, selector):
                    if not await self._flowing(closing):
                        return
                    yield event
        finally:
            pending = [f for f in (step, closing, expired) if f is not None and not f.done()]
            for f in pending:
                f.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            if isinstance(inner, AsyncGenerator):  # Bus.stream is an async generator
                await inner.aclose()
            if mark is not None:
                await bus.unmark(mark)

    async def _flowing(self, closing: asyncio.Future[Any]) -> bool:
        """Wait while watches are held (a lagging watch: writes and reads go on, events wait);
        False if the server shuts down meanwhile."""
        if self.flowing.is_set():
            return True
        flowing = asyncio.ensure_future(self.flowing.wait())
        try:
            await asyncio.wait({flowing, closing}, return_when=FIRST_COMPLETED)
        finally:
            flowing.cancel()
        return self.flowing.is_set()

    def _wanted(self, request: rendering.Request, event: Any, selector: str | None) -> bool:
        if not isinstance(event, dict):
            return True  # raw payloads (bytes) go out as kmock would send them
        obj = event.get("object", {})
        meta = obj.get("metadata", {})
        return bool(
            self._KubernetesEmulator__check(  # type: ignore[attr-defined]
                request, request.resource, meta.get("namespace"), meta.get("name"), strict=False
            )
        ) and _selector_matches(obj, selector)

    def _record(self, resource: Any, items: tuple[Any, ...]) -> None:
        """Keep each watch event with the resourceVersion it happened at (called under the lock)."""
        log = self.history[resource]
        for item in items:
            if isinstance(item, dict) and item.get("type") == "DELETED":
                # The apiserver stamps a deletion with its own version; kmock sends the last state.
                raw = _plain(item["object"])  # a copy: the stored object keeps its own version
                raw.setdefault("metadata", {})["resourceVersion"] = str(self.resource_version)
                item["object"] = raw
            log.append((self.resource_version, item))
        if len(log) > HISTORY:
            self.history_floor = max(self.history_floor, log[-HISTORY - 1][0] + 1)
            del log[:-HISTORY]


@attrs.mutable(weakref_slot=True)
class _RecordingBus(aiobus.Bus[Any]):
    """kmock's event bus, also telling the emulator what passed (for watches from a version)."""

    on_put: Callable[[tuple[Any, ...]], None] = attrs.field(kw_only=True)

    async def put(self, *items: Any) -> None:
        self.on_put(items)
        await super().put(*items)


class _RecordingBuses(dict[kmock.resource, aiobus.Bus[Any]]):
    """One recording bus per resource, made on first use (as kmock's defaultdict does)."""

    def __init__(self, emulator: ApiServerEmulator) -> None:
        super().__init__()
        self._emulator = emulator

    def __missing__(self, resource: kmock.resource) -> aiobus.Bus[Any]:
        bus = self[resource] = _RecordingBus(on_put=lambda items: self._emulator._record(resource, items))
        return bus


def _gone() -> dict[str, Any]:
    return {
        "type": "ERROR",
        "object": {
            "apiVersion": "v1",
            "kind": "Status",
            "metadata": {},
            "status": "Failure",
            "message": "too old resource version",
            "reason": "Expired",
            "code": 410,
        },
    }


class KubeServer:
    """A running ApiServerEmulator in a background thread, and clients for it."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self.emulator: ApiServerEmulator
        self.url = ""
        self._thread = threading.Thread(target=self._run, name="kube-emulator", daemon=True)
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the Kubernetes emulator did not start within 30 s")
        if self._error is not None:
            raise RuntimeError("the Kubernetes emulator failed to start") from self._error

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._serve())
        except BaseException as e:  # surfaced by __init__
            self._error = e
            self._ready.set()
        finally:
            self._loop.close()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        self.emulator = ApiServerEmulator()
        async with self.emulator, kmock.Server(self.emulator) as server:
            self.url = str(server.url).rstrip("/")
            self._ready.set()
            await self._stop.wait()
            # End open watch streams first: aiohttp's shutdown would otherwise wait for
            # clients (an agent still watching) to hang up.
            self.emulator.closing.set()
            await asyncio.sleep(0.1)

    def close(self) -> None:
        if self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)

    def call(self, fn: Callable[[ApiServerEmulator], Coroutine[Any, Any, T]]) -> T:
        """Run a coroutine against the emulator on its own loop (thread-safe)."""
        return asyncio.run_coroutine_threadsafe(fn(self.emulator), self._loop).result(30)

    # -- clients ---------------------------------------------------------------------------------

    def configuration(self) -> client.Configuration:
        return client.Configuration(host=self.url)

    def api_client(self) -> client.ApiClient:
        return client.ApiClient(self.configuration())

    def core_v1(self) -> client.CoreV1Api:
        return client.CoreV1Api(self.api_client())

    # -- what the apiserver holds (thread-safe snapshots) -----------------------------------------

    def objects(self, resource: Any, namespace: str | None = None) -> list[dict[str, Any]]:
        async def snap(emu: ApiServerEmulator) -> list[dict[str, Any]]:
            return [
                _plain(obj.raw)
                for (res, ns, _name), obj in list(emu.objects.items())
                if res == resource and (namespace is None or ns == namespace) and not obj.deleted
            ]

        return self.call(snap)

    def events(self, namespace: str | None = None) -> list[dict[str, Any]]:
        return self.objects(EVENTS, namespace)

    def requests(self) -> list[tuple[str, str, dict[str, str]]]:
        """(method, path, query params) of every request served so far."""

        async def snap(emu: ApiServerEmulator) -> list[tuple[str, str, dict[str, str]]]:
            return list(emu.request_log)

        return self.call(snap)

    # -- apiserver behaviours tests trigger -------------------------------------------------------

    def expire_watches(self) -> None:
        """Compaction: every open watch gets 410 Gone, and older resourceVersions stay expired."""

        async def expire(emu: ApiServerEmulator) -> None:
            emu.expired_before = emu.resource_version  # a watch from the current version is still fine
            emu.expiry.set()
            emu.expiry = asyncio.Event()

        self.call(expire)

    def hold_pod_reads(self) -> None:
        """From now on, reads of pods wait (an apiserver slow or away for them) until
        release_pod_reads(); writes are served."""

        async def hold(emu: ApiServerEmulator) -> None:
            emu.pod_reads = asyncio.Event()

        self.call(hold)

    def release_pod_reads(self) -> None:
        async def release(emu: ApiServerEmulator) -> None:
            if emu.pod_reads is not None:
                emu.pod_reads.set()
            emu.pod_reads = None

        self.call(release)

    @contextlib.contextmanager
    def hold_watches(self) -> Iterator[None]:
        """Within: open watches deliver nothing (a watch lagging behind the apiserver); writes,
        GETs and lists go on. After: the events held flow on, in order."""

        async def flow(emu: ApiServerEmulator, on: bool) -> None:
            if on:
                emu.flowing.set()
            else:
                emu.flowing.clear()

        self.call(lambda emu: flow(emu, False))
        try:
            yield
        finally:
            self.call(lambda emu: flow(emu, True))

    def delete_silently(self, resource: Any, namespace: str, name: str) -> None:
        """Remove an object without a watch event, as if it went while a watcher was disconnected."""

        async def drop(emu: ApiServerEmulator) -> None:
            async with emu._lock:
                emu.resource_version += 1
                emu.objects[resource, namespace, name].delete()

        self.call(drop)


def _replacing(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """The merge patch (kmock's: a None removes a key) that turns `old` into exactly `new`."""
    out: dict[str, Any] = {k: None for k in old if k not in new}
    for k, v in new.items():
        if isinstance(v, Mapping) and isinstance(old.get(k), Mapping):
            out[k] = _replacing(old[k], v)
        else:
            out[k] = v
    return out


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def pod_manifest(
    name: str,
    *,
    node: str,
    namespace: str = "default",
    annotations: Mapping[str, str] | None = None,
    containers: tuple[str, ...] = ("main",),
    priority: int | None = None,
    uid: str | None = None,
) -> dict[str, Any]:
    """A minimal Pod as a scheduler would have bound it to `node`."""
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "annotations": dict(annotations or {})}
    if uid:
        meta["uid"] = uid
    spec: dict[str, Any] = {"nodeName": node, "containers": [{"name": c, "image": "app"} for c in containers]}
    if priority is not None:
        spec["priority"] = priority
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec, "status": {"phase": "Running"}}
