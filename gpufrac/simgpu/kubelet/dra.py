"""The kubelet's DRA side, for tests and the demo: plugin registration, claim preparation, CDI.

It behaves as the kubelet's DRA manager and plugin watcher do towards a DRA driver
(docs/design.md section 4; /work reference kubelet-contract.md):

* start and restart: the node's ResourceSlices are deleted (every driver's: a kubelet that
  starts advertises nothing until its drivers are back), then the plugin watcher scans
  <root>/plugins_registry/ for sockets;
* registration: GetInfo (type DRAPlugin, the driver name, its endpoint, the services it
  serves); the kubelet takes the first of the plugin's DRAPlugin versions it knows itself
  (`services`: v1 and v1beta1, or v1beta1 alone as 1.32 and 1.33) and says so with
  NotifyRegistrationStatus; a plugin naming none it knows is refused (NotifyRegistrationStatus
  with the kubelet's error); the health stream (v1.DRAResourceHealth) is opened when the plugin
  lists it; a registration socket that disappears deregisters the plugin;
* a pod starting: each ResourceClaim it uses is read from the apiserver (its uid, and the
  drivers of its allocation); claims not prepared yet are sent in one NodePrepareResources per
  driver; every claim of the request must be answered (a missing one or an error fails the
  pod's start, as "failed to prepare dynamic resources"), and the CDI device IDs are kept in
  the checkpoint; a claim already prepared (another pod shares it) is not sent again;
* a pod deleted: claims no pod uses any more are unprepared (NodeUnprepareResources);
* a restart: connections and streams are dropped, slices deleted, plugins found again, and
  every prepared claim of the checkpoint is sent again with NodePrepareResources;
* pod-resources: served on <root>/pod-resources/kubelet.sock as the kubelet always does; it
  lists no device-plugin devices (a node in DRA mode has none);
* the container runtime's side of CDI: a container's edits are the env and mounts of the CDI
  devices of the claims it uses, read from the spec files in `cdi_dir` (an ID no spec
  defines is an error, as containerd's "unresolvable CDI devices").

It runs its own asyncio loop in a thread; the public methods are synchronous and thread-safe.
Over 500 lines: it stands for one part of the kubelet (registration, both API versions, the
checkpoint and its replay, CDI), each a few methods of the same object.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import stat
import threading
import time
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from gpufrac.proto import dra_health_v1_pb2 as hpb
from gpufrac.proto import dra_health_v1_pb2_grpc as hpb_grpc
from gpufrac.proto import dra_v1_pb2 as v1
from gpufrac.proto import dra_v1_pb2_grpc as v1_grpc
from gpufrac.proto import dra_v1beta1_pb2 as v1beta1
from gpufrac.proto import dra_v1beta1_pb2_grpc as v1beta1_grpc
from gpufrac.proto import pluginregistration_pb2 as reg
from gpufrac.proto import pluginregistration_pb2_grpc as reg_grpc
from gpufrac.proto import podresources_pb2_grpc as pr_grpc
from gpufrac.simgpu.kubelet.podresources import PodResourcesServer
from gpufrac.simgpu.runtime import MountSpec

T = TypeVar("T")
KUBELET_SERVICES = ("v1.DRAPlugin", "v1beta1.DRAPlugin")
HEALTH_SERVICE = "v1.DRAResourceHealth"
SCAN_INTERVAL = 0.05
CALL_TIMEOUT = 45.0  # the kubelet's default for a DRA call
# A connection of its own per registration, as the kubelet's new gRPC client for each is:
# gRPC's Python core otherwise shares one per socket path across channels, and a restarted
# plugin's would still be backing off from the refusals of the one that died.
FRESH = [("grpc.use_local_subchannel_pool", 1)]


class PrepareError(Exception):
    """A pod's claims could not be prepared (its start fails and is retried by the kubelet)."""


@dataclass(frozen=True)
class ClaimUse:
    """A pod's use of a claim: the pod's name for it and the claim's name (in the pod's namespace)."""

    pod_claim: str
    claim: str


@dataclass
class ClaimPod:
    """A pod as the DRA side of the kubelet sees it: its claims and which containers use them."""

    namespace: str
    name: str
    uid: str
    claims: list[ClaimUse]
    # container name -> the pod claim names it lists in resources.claims
    containers: dict[str, list[str]] = field(default_factory=dict)


@dataclass
class PreparedClaim:
    """A claim in the kubelet's checkpoint."""

    namespace: str
    name: str
    uid: str
    driver: str
    pods: set[str] = field(default_factory=set)
    cdi_ids: list[str] = field(default_factory=list)
    devices: list[tuple[str, str, tuple[str, ...]]] = field(default_factory=list)  # pool, device, requests


@dataclass
class Plugin:
    driver: str
    endpoint: str
    service: str
    socket_id: tuple[int, int]
    channel: grpc.aio.Channel
    health_task: asyncio.Task[None] | None = None
    health: dict[tuple[str, str], tuple[int, str]] = field(
        default_factory=dict
    )  # (pool, device) -> (status, msg)
    health_messages: int = 0


class DraKubelet:
    """See the module docstring. `root_dir` plays /var/lib/kubelet; `api` reaches the apiserver."""

    def __init__(
        self,
        root_dir: str | os.PathLike[str],
        api: client.ApiClient,
        node_name: str,
        *,
        cdi_dir: str | os.PathLike[str],
        services: Sequence[str] = KUBELET_SERVICES,
    ) -> None:
        self.root = Path(root_dir)
        self.registry = self.root / "plugins_registry"
        self.cdi_dir = Path(cdi_dir)
        self.api = client.ResourceV1Api(api)
        self.node_name = node_name
        self.services = tuple(services)
        self.plugins: dict[str, Plugin] = {}
        self.refused: dict[str, str] = {}  # registration socket -> the kubelet's error
        self.registrations: dict[str, int] = {}  # driver -> registrations accepted so far
        self.checkpoint: dict[str, PreparedClaim] = {}  # claim uid -> what was prepared
        self.pods: dict[str, ClaimPod] = {}
        self.calls: list[tuple[str, list[str]]] = []  # (method, claim uids) of every call sent
        # (method, seconds the kubelet waited for the answer) of every call answered
        self.times: list[tuple[str, float]] = []
        self.generation = 0
        self._seen: dict[str, tuple[int, int]] = {}  # registration socket -> its identity when handled
        self._by_socket: dict[str, str] = {}  # registration socket -> the driver it registered
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._pr_server: grpc.aio.Server | None = None

    # -- thread plumbing ------------------------------------------------------------------

    def start(self) -> DraKubelet:
        ready = threading.Event()

        def main() -> None:
            loop = self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            loop.call_soon(ready.set)
            loop.run_forever()
            loop.close()

        self._thread = threading.Thread(target=main, name="dra-kubelet", daemon=True)
        self._thread.start()
        ready.wait()
        self._call(self._start)
        return self

    def stop(self) -> None:
        if self._loop is None:
            return
        self._call(self._shutdown)
        self._loop.call_soon_threadsafe(self._loop.stop)
        assert self._thread is not None
        self._thread.join(10)
        self._loop = None

    def __enter__(self) -> DraKubelet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _call(self, fn: Callable[[], Coroutine[Any, Any, T]], timeout: float = 120.0) -> T:
        assert self._loop is not None, "DraKubelet not started"
        return asyncio.run_coroutine_threadsafe(fn(), self._loop).result(timeout)

    def _get(self, fn: Callable[[], T]) -> T:
        async def run() -> T:
            return fn()

        return self._call(run)

    # -- the kubelet process --------------------------------------------------------------

    async def _start(self) -> None:
        self.generation += 1
        self.registry.mkdir(parents=True, exist_ok=True)
        socket = self.root / "pod-resources" / "kubelet.sock"
        socket.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            socket.unlink()
        self._pr_server = grpc.aio.server()
        pr_grpc.add_PodResourcesListerServicer_to_server(PodResourcesServer({}, {}), self._pr_server)
        self._pr_server.add_insecure_port(f"unix://{socket}")
        await self._pr_server.start()
        await asyncio.to_thread(self.wipe_slices)
        self._seen.clear()
        self._by_socket.clear()
        self._watcher = asyncio.create_task(self._watch())
        # Prepared claims are sent again: the kubelet prepares the pods it finds running.
        again = list(self.checkpoint.values())
        if again:
            await self._await_plugins({c.driver for c in again})
            for driver in {c.driver for c in again}:
                await self._prepare_call(driver, [c for c in again if c.driver == driver])

    async def _shutdown(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
        for p in list(self.plugins.values()):
            await self._drop(p)
        self.plugins.clear()
        if self._pr_server is not None:
            await self._pr_server.stop(grace=0)
            self._pr_server = None

    def restart(self) -> None:
        """Restart the kubelet: plugins found again, slices deleted, prepared claims sent again."""

        async def run() -> None:
            await self._shutdown()
            await self._start()

        self._call(run)

    def wipe_slices(self) -> None:
        """Delete this node's ResourceSlices (blocking), as a starting kubelet does."""
        self.api.delete_collection_resource_slice(
            field_selector=f"spec.nodeName={self.node_name}", _preload_content=False
        )

    # -- the plugin watcher ---------------------------------------------------------------

    async def _watch(self) -> None:
        while True:
            try:
                await self._scan()
            except Exception as e:  # keep watching, as the kubelet's watcher does
                print(f"dra-kubelet: plugin watcher: {e!r}")
            await asyncio.sleep(SCAN_INTERVAL)

    async def _scan(self) -> None:
        present: dict[str, tuple[int, int]] = {}
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(self.registry):
                st = entry.stat(follow_symlinks=False)
                if stat.S_ISSOCK(st.st_mode):
                    present[entry.path] = (st.st_ino, st.st_ctime_ns)
        for path, ident in present.items():
            if self._seen.get(path) != ident:
                self._seen[path] = ident
                await self._register(path, ident)
        for path in list(self._seen):
            if path not in present:  # the registration socket is gone: the plugin deregisters
                del self._seen[path]
                driver = self._by_socket.pop(path, None)
                plugin = self.plugins.pop(driver, None) if driver is not None else None
                if plugin is not None:
                    await self._drop(plugin)

    async def _register(self, path: str, ident: tuple[int, int]) -> None:
        async with grpc.aio.insecure_channel(f"unix://{path}", options=FRESH) as ch:
            stub = reg_grpc.RegistrationStub(ch)
            try:
                info = await stub.GetInfo(reg.InfoRequest(), timeout=10)
            except grpc.aio.AioRpcError:
                self._seen.pop(path, None)  # not serving yet: tried again at the next scan
                return
            error = ""
            service = next((s for s in info.supported_versions if s in self.services), "")
            if info.type != "DRAPlugin":
                error = f"plugin type {info.type!r} is not DRAPlugin"
            elif not info.supported_versions:
                error = "empty list of supported gRPC services (aka supported versions)"
            elif not service:
                error = (
                    f"none of services supported by the plugin ({list(info.supported_versions)}) are "
                    f"supported by the kubelet ({list(self.services)})"
                )
            if error:
                self.refused[path] = error
                await stub.NotifyRegistrationStatus(
                    reg.RegistrationStatus(plugin_registered=False, error=error)
                )
                return
            self.refused.pop(path, None)
            old = self.plugins.pop(info.name, None)
            if old is not None:
                await self._drop(old)
            channel = grpc.aio.insecure_channel(f"unix://{info.endpoint}", options=FRESH)
            plugin = Plugin(info.name, info.endpoint, service, ident, channel)
            self.plugins[info.name] = plugin
            self._by_socket[path] = info.name
            self.registrations[info.name] = self.registrations.get(info.name, 0) + 1
            if HEALTH_SERVICE in info.supported_versions:
                plugin.health_task = asyncio.create_task(self._health(plugin))
            await stub.NotifyRegistrationStatus(reg.RegistrationStatus(plugin_registered=True))

    async def _drop(self, plugin: Plugin) -> None:
        if plugin.health_task is not None:
            plugin.health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await plugin.health_task
        await plugin.channel.close(None)

    async def _health(self, plugin: Plugin) -> None:
        stub = hpb_grpc.DRAResourceHealthStub(plugin.channel)
        while True:
            try:
                async for msg in stub.NodeWatchResources(hpb.NodeWatchResourcesRequest()):
                    # A full list every time: devices missing from it are no longer known.
                    plugin.health = {
                        (d.device.pool_name, d.device.device_name): (d.health, d.message) for d in msg.devices
                    }
                    plugin.health_messages += 1
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(1.0)  # the kubelet retries the stream

    async def _await_plugins(self, drivers: Iterable[str], timeout: float = 60.0) -> None:
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while any(d not in self.plugins for d in drivers) and loop.time() < end:
            await asyncio.sleep(SCAN_INTERVAL)

    # -- calls ----------------------------------------------------------------------------

    def _stub(self, plugin: Plugin) -> Any:
        if plugin.service == "v1.DRAPlugin":
            return v1_grpc.DRAPluginStub(plugin.channel)
        return v1beta1_grpc.DRAPluginStub(plugin.channel)

    def _pb(self, plugin: Plugin) -> Any:
        return v1 if plugin.service == "v1.DRAPlugin" else v1beta1

    async def _prepare_call(self, driver: str, claims: Sequence[PreparedClaim]) -> dict[str, str]:
        """NodePrepareResources for `claims`; per claim uid the error ("" when prepared)."""
        plugin = self.plugins.get(driver)
        if plugin is None:
            return {c.uid: f"DRA driver {driver} is not registered" for c in claims}
        pb = self._pb(plugin)
        req = pb.NodePrepareResourcesRequest(
            claims=[pb.Claim(namespace=c.namespace, uid=c.uid, name=c.name) for c in claims]
        )
        self.calls.append(("NodePrepareResources", [c.uid for c in claims]))
        t0 = time.perf_counter()
        try:
            resp = await self._stub(plugin).NodePrepareResources(req, timeout=CALL_TIMEOUT)
        except grpc.aio.AioRpcError as e:
            return {c.uid: f"NodePrepareResources failed: {e.code().name}: {e.details()}" for c in claims}
        self.times.append(("NodePrepareResources", time.perf_counter() - t0))
        out = {}
        for c in claims:
            if c.uid not in resp.claims:
                out[c.uid] = "NodePrepareResources left out claim " + c.uid
                continue
            answer = resp.claims[c.uid]
            if answer.error:
                out[c.uid] = answer.error
                continue
            c.cdi_ids = sorted({i for d in answer.devices for i in d.cdi_device_ids})
            c.devices = [(d.pool_name, d.device_name, tuple(d.request_names)) for d in answer.devices]
            out[c.uid] = ""
        return out

    def prepare_raw(self, driver: str, claims: Sequence[tuple[str, str, str]]) -> Any:
        """NodePrepareResources with these (namespace, name, uid), as sent; the response."""

        async def run() -> Any:
            plugin = self.plugins[driver]
            pb = self._pb(plugin)
            req = pb.NodePrepareResourcesRequest(
                claims=[pb.Claim(namespace=n, name=m, uid=u) for n, m, u in claims]
            )
            return await self._stub(plugin).NodePrepareResources(req, timeout=CALL_TIMEOUT)

        return self._call(run)

    def unprepare_raw(self, driver: str, claims: Sequence[tuple[str, str, str]]) -> Any:
        """NodeUnprepareResources with these (namespace, name, uid), as sent; the response."""

        async def run() -> Any:
            plugin = self.plugins[driver]
            pb = self._pb(plugin)
            req = pb.NodeUnprepareResourcesRequest(
                claims=[pb.Claim(namespace=n, name=m, uid=u) for n, m, u in claims]
            )
            self.calls.append(("NodeUnprepareResources", [u for _, _, u in claims]))
            return await self._stub(plugin).NodeUnprepareResources(req, timeout=CALL_TIMEOUT)

        return self._call(run)

    # -- pods -----------------------------------------------------------------------------

    def run_pod(self, pod: ClaimPod) -> None:
        """Prepare the pod's claims (PrepareError when one could not be); the pod is then running."""

        async def run() -> None:
            await self._run_pod(pod)

        self._call(run)

    async def _run_pod(self, pod: ClaimPod) -> None:
        todo: dict[str, list[PreparedClaim]] = {}
        records: list[PreparedClaim] = []
        for use in pod.claims:
            raw = await asyncio.to_thread(self._read_claim, pod.namespace, use.claim)
            if raw is None:
                raise PrepareError(
                    f"failed to prepare dynamic resources: claim {pod.namespace}/{use.claim} not found"
                )
            meta, status = raw.get("metadata") or {}, raw.get("status") or {}
            uid = meta.get("uid", "")
            reserved = {r.get("uid") for r in status.get("reservedFor") or []}
            if pod.uid not in reserved:
                raise PrepareError(f"claim {pod.namespace}/{use.claim} is not reserved for pod {pod.name}")
            results = ((status.get("allocation") or {}).get("devices") or {}).get("results") or []
            drivers = sorted({r.get("driver") for r in results if r.get("driver")})
            if not drivers:
                raise PrepareError(f"claim {pod.namespace}/{use.claim} is not allocated")
            rec = self.checkpoint.get(uid)
            if rec is None:
                rec = PreparedClaim(pod.namespace, use.claim, uid, drivers[0])
                todo.setdefault(rec.driver, []).append(rec)
            records.append(rec)
        failed = []
        for driver, claims in todo.items():
            errors = await self._prepare_call(driver, claims)
            for c in claims:
                if errors.get(c.uid):
                    failed.append(f"claim {c.namespace}/{c.name}: {errors[c.uid]}")
                else:
                    self.checkpoint[c.uid] = c
        if failed:
            raise PrepareError("failed to prepare dynamic resources: " + "; ".join(failed))
        for rec in records:
            rec.pods.add(pod.uid)
        self.pods[pod.uid] = pod

    def _read_claim(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            resp = self.api.read_namespaced_resource_claim(name, namespace, _preload_content=False)
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        data: dict[str, Any] = json.loads(resp.data)  # type: ignore[attr-defined]  # _preload_content=False: the raw response
        return data

    def delete_pod(self, pod_uid: str) -> dict[str, str]:
        """The pod is gone: claims no other pod uses are unprepared. Per claim uid the
        driver's error ("" when unprepared)."""

        async def run() -> dict[str, str]:
            self.pods.pop(pod_uid, None)
            done: dict[str, list[PreparedClaim]] = {}
            for rec in list(self.checkpoint.values()):
                rec.pods.discard(pod_uid)
                if not rec.pods:
                    done.setdefault(rec.driver, []).append(rec)
            out = {}
            for driver, claims in done.items():
                plugin = self.plugins.get(driver)
                if plugin is None:
                    out.update({c.uid: f"DRA driver {driver} is not registered" for c in claims})
                    continue
                pb = self._pb(plugin)
                req = pb.NodeUnprepareResourcesRequest(
                    claims=[pb.Claim(namespace=c.namespace, uid=c.uid, name=c.name) for c in claims]
                )
                self.calls.append(("NodeUnprepareResources", [c.uid for c in claims]))
                t0 = time.perf_counter()
                resp = await self._stub(plugin).NodeUnprepareResources(req, timeout=CALL_TIMEOUT)
                self.times.append(("NodeUnprepareResources", time.perf_counter() - t0))
                for c in claims:
                    if c.uid in resp.claims and not resp.claims[c.uid].error:
                        del self.checkpoint[c.uid]
                        out[c.uid] = ""
                    else:
                        out[c.uid] = resp.claims[c.uid].error if c.uid in resp.claims else "not answered"
            return out

        return self._call(run)

    # -- what the kubelet knows -----------------------------------------------------------

    def registered(self, driver: str) -> bool:
        return self._get(lambda: driver in self.plugins)

    def registered_times(self, driver: str) -> int:
        """How many registrations of the driver the kubelet accepted (a restarted one adds one)."""
        return self._get(lambda: self.registrations.get(driver, 0))

    def service_of(self, driver: str) -> str:
        return self._get(lambda: self.plugins[driver].service)

    def health(self, driver: str) -> dict[tuple[str, str], tuple[int, str]]:
        """(pool, device) -> (health status, message), from the driver's last health message."""
        return self._get(lambda: dict(self.plugins[driver].health) if driver in self.plugins else {})

    def prepared(self) -> dict[str, PreparedClaim]:
        return self._get(lambda: dict(self.checkpoint))

    def sent(self) -> list[tuple[str, list[str]]]:
        return self._get(lambda: list(self.calls))

    def call_times(self, method: str) -> list[float]:
        """Seconds the kubelet waited for each answered call of `method`, in order."""
        return self._get(lambda: [t for m, t in self.times if m == method])

    # -- the container runtime's CDI ------------------------------------------------------

    def container_edits(self, pod_uid: str, container: str) -> tuple[dict[str, str], list[MountSpec]]:
        """The env and mounts of the CDI devices of the claims the container uses."""

        def ids() -> list[str]:
            pod = self.pods[pod_uid]
            names = {u.pod_claim: u.claim for u in pod.claims}
            claims = {names[n] for n in pod.containers.get(container, []) if n in names}
            return [
                i
                for rec in self.checkpoint.values()
                if rec.namespace == pod.namespace and rec.name in claims
                for i in rec.cdi_ids
            ]

        return resolve_cdi(self.cdi_dir, self._get(ids))


def _specs(cdi_dir: Path) -> dict[str, dict[str, Any]]:
    """CDI device name (vendor/class=name) -> its container edits merged with its spec's."""
    out: dict[str, dict[str, Any]] = {}
    if not cdi_dir.is_dir():
        return out
    for path in sorted(cdi_dir.iterdir()):
        if path.suffix not in (".json", ".yaml", ".yml"):
            continue
        spec = yaml.safe_load(path.read_text())
        if not isinstance(spec, Mapping):
            continue
        kind = spec.get("kind", "")
        common = spec.get("containerEdits") or {}
        for dev in spec.get("devices") or []:
            edits = dev.get("containerEdits") or {}
            out[f"{kind}={dev.get('name')}"] = {
                "env": list(common.get("env") or []) + list(edits.get("env") or []),
                "mounts": list(common.get("mounts") or []) + list(edits.get("mounts") or []),
            }
    return out


def resolve_cdi(
    cdi_dir: str | os.PathLike[str], device_ids: Sequence[str]
) -> tuple[dict[str, str], list[MountSpec]]:
    """What a runtime applies for these CDI devices: env and mounts. ValueError for an ID no
    spec in `cdi_dir` defines (containerd refuses the container so)."""
    specs = _specs(Path(cdi_dir))
    missing = [i for i in device_ids if i not in specs]
    if missing:
        raise ValueError(f"unresolvable CDI devices {', '.join(missing)}")
    env: dict[str, str] = {}
    mounts: list[MountSpec] = []
    for i in device_ids:
        for e in specs[i]["env"]:
            k, _, v = str(e).partition("=")
            env[k] = v
        for m in specs[i]["mounts"]:
            mounts.append(MountSpec(m["containerPath"], m["hostPath"], "ro" in (m.get("options") or [])))
    return env, mounts
