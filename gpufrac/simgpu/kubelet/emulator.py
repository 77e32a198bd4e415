"""The kubelet emulator: its process lifetime, device-plugin registration and
ListAndWatch, admission (GetPreferredAllocation, Allocate, PreStartContainer) and the
container view of what was allocated. The pod-resources server is podresources.py,
the records model.py (the package docstring says how it behaves)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import threading
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import grpc

from gpufrac.proto import deviceplugin_pb2 as pb
from gpufrac.proto import deviceplugin_pb2_grpc as pb_grpc
from gpufrac.proto import podresources_pb2_grpc as pr_grpc
from gpufrac.simgpu.kubelet.model import (
    CHECKPOINT,
    DIAL_TIMEOUT,
    PRESTART_TIMEOUT,
    SUPPORTED_VERSIONS,
    AdmissionError,
    Allocated,
    Endpoint,
    Pod,
    PodRecord,
    Resource,
    go_error,
    is_extended_resource_name,
)
from gpufrac.simgpu.kubelet.podresources import PodResourcesServer
from gpufrac.simgpu.runtime import MountSpec, link_mounts, mounts_of, translate_envs

T = TypeVar("T")


class _Registration(pb_grpc.RegistrationServicer):
    def __init__(self, kubelet: KubeletEmulator, generation: int) -> None:
        self.kubelet = kubelet
        self.generation = generation

    async def Register(
        self, request: pb.RegisterRequest, context: grpc.aio.ServicerContext[pb.RegisterRequest, pb.Empty]
    ) -> pb.Empty:
        k = self.kubelet
        k.registration_total += 1
        if request.version not in SUPPORTED_VERSIONS:
            supported = "[" + " ".join(f'"{v}"' for v in SUPPORTED_VERSIONS) + "]"
            await context.abort(
                grpc.StatusCode.UNKNOWN,
                f'requested API version "{request.version}" is not supported by kubelet. '
                f"Supported version is {supported}",
            )
        if not is_extended_resource_name(request.resource_name):
            await context.abort(
                grpc.StatusCode.UNKNOWN, f'the ResourceName "{request.resource_name}" is invalid'
            )
        try:
            await k._connect(request, self.generation)
        except Exception as e:
            msg = go_error(e) if isinstance(e, grpc.aio.AioRpcError) else str(e)
            await context.abort(grpc.StatusCode.UNKNOWN, f"failed to connect to new client: {msg}")
        return pb.Empty()


class KubeletEmulator:
    """See the package docstring (kubelet/__init__.py). `root_dir` plays /var/lib/kubelet."""

    def __init__(self, root_dir: str | os.PathLike[str]) -> None:
        self.root = Path(root_dir)
        self.device_plugin_dir = self.root / "device-plugins"
        self.kubelet_socket = self.device_plugin_dir / "kubelet.sock"
        self.pod_resources_socket = self.root / "pod-resources" / "kubelet.sock"
        self.registration_total = 0
        self.generation = 0
        self._resources: dict[str, Resource] = {}
        self._stale: list[Endpoint] = []
        self._pods: dict[str, PodRecord] = {}
        self._rpc_times: list[float] = []
        self._server: grpc.aio.Server | None = None
        self._pr_server: grpc.aio.Server | None = None
        self._pr_servicer: PodResourcesServer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # -- thread plumbing ------------------------------------------------------------------

    def start(self) -> KubeletEmulator:
        ready = threading.Event()

        def main() -> None:
            loop = self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            loop.call_soon(ready.set)
            loop.run_forever()
            loop.close()

        self._thread = threading.Thread(target=main, name="kubelet-emulator", daemon=True)
        self._thread.start()
        ready.wait()
        self._call(self._start_kubelet)
        return self

    def stop(self) -> None:
        if self._loop is None:
            return
        self._call(self._shutdown)
        self._loop.call_soon_threadsafe(self._loop.stop)
        assert self._thread is not None
        self._thread.join(10)
        self._loop = None

    def __enter__(self) -> KubeletEmulator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _call(self, fn: Callable[[], Coroutine[Any, Any, T]], timeout: float = 120.0) -> T:
        assert self._loop is not None, "KubeletEmulator not started"
        return asyncio.run_coroutine_threadsafe(fn(), self._loop).result(timeout)

    def _get(self, fn: Callable[[], T]) -> T:
        async def run() -> T:
            return fn()

        return self._call(run)

    # -- kubelet process lifetime -------------------------------------------------------------

    def _wipe_sockets(self) -> None:
        """CleanupPluginDirectory: every socket except the checkpoint; directories stay."""
        for entry in os.scandir(self.device_plugin_dir):
            if entry.name == CHECKPOINT:
                continue
            with contextlib.suppress(OSError):
                if stat.S_ISSOCK(entry.stat(follow_symlinks=False).st_mode):
                    os.unlink(entry.path)

    async def _start_kubelet(self) -> None:
        self.generation += 1
        # readCheckpoint: known resources come back with no devices until re-registration.
        for res in self._resources.values():
            res.update(None)
            res.endpoint = None
        os.makedirs(self.device_plugin_dir, mode=0o750, exist_ok=True)
        os.makedirs(self.pod_resources_socket.parent, exist_ok=True)
        self._wipe_sockets()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.pod_resources_socket)
        server = grpc.aio.server()
        pb_grpc.add_RegistrationServicer_to_server(_Registration(self, self.generation), server)
        server.add_insecure_port(f"unix://{self.kubelet_socket}")
        pr_server = grpc.aio.server()
        self._pr_servicer = PodResourcesServer(self._pods, self._resources)
        pr_grpc.add_PodResourcesListerServicer_to_server(self._pr_servicer, pr_server)
        pr_server.add_insecure_port(f"unix://{self.pod_resources_socket}")
        await pr_server.start()
        await server.start()
        self._server, self._pr_server = server, pr_server

    async def _shutdown(self) -> None:
        """The kubelet process dies: its servers and its plugin connections go with it."""
        self.generation += 1
        for srv in (self._server, self._pr_server):
            if srv is not None:
                await srv.stop(grace=0)
        self._server = self._pr_server = None
        endpoints = [r.endpoint for r in self._resources.values() if r.endpoint] + self._stale
        self._stale = []
        for ep in endpoints:
            if ep.task is not None:
                ep.task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await ep.task
            await ep.channel.close(None)

    def restart(self) -> None:
        """Restart the kubelet: sockets wiped, kubelet.sock re-created, nothing re-dialled.
        Pod allocations survive (the real kubelet keeps them in its checkpoint)."""

        async def run() -> None:
            await self._shutdown()
            await self._start_kubelet()

        self._call(run)

    # -- registration and ListAndWatch ------------------------------------------------------------

    async def _connect(self, request: pb.RegisterRequest, generation: int) -> None:
        socket = str(self.device_plugin_dir / request.endpoint)
        channel = grpc.aio.insecure_channel(f"unix://{socket}")
        try:
            try:
                await asyncio.wait_for(channel.channel_ready(), DIAL_TIMEOUT)
            except asyncio.TimeoutError:
                raise RuntimeError(
                    f"failed to dial device plugin: context deadline exceeded ({socket})"
                ) from None
            stub = pb_grpc.DevicePluginStub(channel)
            options = await stub.GetDevicePluginOptions(pb.Empty(), timeout=DIAL_TIMEOUT)
        except BaseException:
            await channel.close(None)
            raise
        res = self._resources.setdefault(request.resource_name, Resource())
        if res.endpoint is not None:
            # The real kubelet overwrites the entry and leaves the old connection open.
            self._stale.append(res.endpoint)
        ep = Endpoint(request.resource_name, socket, channel, stub, options, generation)
        res.endpoint = ep
        res.registrations.append(time.monotonic())
        ep.task = asyncio.create_task(self._run_client(ep, res))

    async def _run_client(self, ep: Endpoint, res: Resource) -> None:
        try:
            async for msg in ep.stub.ListAndWatch(pb.Empty()):
                if res.endpoint is not ep:
                    continue  # a stale connection: the current registration owns the resource
                res.update(msg)
                res.snapshots += 1
        except (grpc.aio.AioRpcError, asyncio.CancelledError):
            pass
        finally:
            # Stream end -> PluginDisconnected: everything unhealthy, stop time set; no re-dial.
            if res.endpoint is ep and ep.generation == self.generation:
                res.update(None, dict.fromkeys(res.devices, "Unhealthy"))
                ep.stopped_at = time.monotonic()

    def drop_stream(self, resource: str) -> None:
        """End the current ListAndWatch stream of a resource (as a broken connection would)."""

        async def run() -> None:
            ep = self._resources[resource].endpoint
            if ep is not None and ep.task is not None:
                ep.task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await ep.task

        self._call(run)

    # -- admission ------------------------------------------------------------------------------

    def admit(self, pod: Pod) -> dict[str, dict[str, list[str]]]:
        """Admit a pod and start its containers. Returns container -> resource -> device IDs.

        Raises AdmissionError (reason UnexpectedAdmissionError) when a device plugin
        call fails, as the kubelet does; the pod then holds nothing."""
        return self._call(lambda: self._admit(pod))

    async def _admit(self, pod: Pod) -> dict[str, dict[str, list[str]]]:
        rec = PodRecord(pod)
        self._pods[pod.uid] = rec
        try:
            for c in pod.containers:
                for resource, count in c.resources.items():
                    alloc = await self._allocate(rec, c.name, resource, count)
                    rec.allocations.setdefault(c.name, {})[resource] = alloc
        except AdmissionError:
            del self._pods[pod.uid]
            raise
        for c in pod.containers:
            await self._start_container(rec, c.name)
        self._rpc_times += [a.rpc_seconds for per in rec.allocations.values() for a in per.values()]
        return {c: {r: list(a.device_ids) for r, a in per.items()} for c, per in rec.allocations.items()}

    def _allocated(self, resource: str) -> set[str]:
        out: set[str] = set()
        for rec in self._pods.values():
            for per in rec.allocations.values():
                if resource in per:
                    out.update(per[resource].device_ids)
        return out

    async def _allocate(self, rec: PodRecord, container: str, resource: str, count: int) -> Allocated:
        def fail(msg: str) -> AdmissionError:
            return AdmissionError(
                "UnexpectedAdmissionError", f"Allocate failed due to {msg}, which is unexpected"
            )

        res = self._resources.get(resource)
        if res is None:
            raise fail(f"cannot allocate unregistered device {resource}")
        ep = res.endpoint
        if ep is None or ep.stopped_at is not None:
            raise fail(f"endpoint not found in cache for a registered resource: {resource}")
        available = res.healthy - self._allocated(resource)
        if len(available) < count:
            raise fail(
                f"requested number of devices unavailable for {resource}. "
                f"Requested: {count}, Available: {len(available)}"
            )
        chosen: list[str] = []
        t0 = time.perf_counter()
        if ep.options.get_preferred_allocation_available:
            req = pb.PreferredAllocationRequest(
                container_requests=[
                    pb.ContainerPreferredAllocationRequest(
                        available_deviceIDs=sorted(available),
                        must_include_deviceIDs=[],
                        allocation_size=count,
                    )
                ]
            )
            try:
                resp = await ep.stub.GetPreferredAllocation(req)
            except grpc.aio.AioRpcError as e:
                raise fail(
                    f"device plugin GetPreferredAllocation rpc failed with err: {go_error(e)}"
                ) from None
            if resp.container_responses:
                chosen = [d for d in resp.container_responses[0].deviceIDs if d in available][:count]
        # The kubelet fills any shortfall itself.
        chosen += sorted(available - set(chosen))[: count - len(chosen)]
        try:
            aresp = await ep.stub.Allocate(
                pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=chosen)])
            )
        except grpc.aio.AioRpcError as e:
            raise fail(go_error(e)) from None
        if not aresp.container_responses:
            raise fail(f"no allocation response for {resource}")
        rpc_seconds = time.perf_counter() - t0
        numa = {d: res.numa_nodes([d]) for d in chosen}
        return Allocated(resource, chosen, aresp.container_responses[0], numa, rpc_seconds)

    async def _start_container(self, rec: PodRecord, container: str) -> None:
        rec.start_errors.pop(container, None)
        for resource, alloc in rec.allocations.get(container, {}).items():
            ep = self._resources[resource].endpoint
            if ep is None or not ep.options.pre_start_required:
                continue
            t0 = time.perf_counter()
            try:
                await ep.stub.PreStartContainer(
                    pb.PreStartContainerRequest(devices_ids=alloc.device_ids), timeout=PRESTART_TIMEOUT
                )
                alloc.rpc_seconds += time.perf_counter() - t0
            except grpc.aio.AioRpcError as e:
                rec.start_errors[container] = (
                    f"device plugin PreStartContainer rpc failed with err: {go_error(e)}"
                )

    def restart_container(self, pod_uid: str, container: str) -> str | None:
        """Start a container again (PreStartContainer runs again); returns the start error, if any."""

        async def run() -> str | None:
            rec = self._pods[pod_uid]
            await self._start_container(rec, container)
            return rec.start_errors.get(container)

        return self._call(run)

    def rpc_times(self) -> list[float]:
        """Per admitted (container, resource): seconds in GetPreferredAllocation + Allocate +
        PreStartContainer, as the kubelet waits for them."""
        return self._get(lambda: list(self._rpc_times))

    def pod_resources_lists(self) -> int:
        """pod-resources List calls answered since the kubelet last (re)started."""
        return self._get(lambda: self._pr_servicer.lists if self._pr_servicer is not None else 0)

    def start_errors(self, pod_uid: str) -> dict[str, str]:
        return self._get(lambda: dict(self._pods[pod_uid].start_errors))

    def delete(self, pod: Pod | str) -> None:
        """Delete a pod: its devices go back to the pool; the plugin is not told."""
        uid = pod if isinstance(pod, str) else pod.uid
        self._get(lambda: self._pods.pop(uid, None))

    # -- what the kubelet knows ---------------------------------------------------------------------

    def pods(self) -> list[Pod]:
        return self._get(lambda: [r.pod for r in self._pods.values()])

    def pod_devices(self, pod_uid: str) -> dict[str, dict[str, list[str]]]:
        return self._get(
            lambda: {
                c: {r: list(a.device_ids) for r, a in per.items()}
                for c, per in self._pods[pod_uid].allocations.items()
            }
        )

    def allocate_response(self, pod_uid: str, container: str, resource: str) -> pb.ContainerAllocateResponse:
        return self._get(lambda: self._pods[pod_uid].allocations[container][resource].response)

    def devices(self, resource: str) -> dict[str, str]:
        """The last full snapshot: device ID -> health."""
        return self._get(lambda: dict(self._resources.get(resource, Resource()).devices))

    def healthy(self, resource: str) -> set[str]:
        return self._get(lambda: set(self._resources.get(resource, Resource()).healthy))

    def allocatable(self, resource: str) -> int:
        """Allocatable as node status shows it: healthy devices (allocated ones included)."""
        return len(self.healthy(resource))

    def capacity(self, resource: str) -> int:
        return len(self.devices(resource))

    def available(self, resource: str) -> int:
        """What a new container could still get: healthy - allocated."""
        return self._get(
            lambda: len(self._resources.get(resource, Resource()).healthy - self._allocated(resource))
        )

    def snapshots(self, resource: str) -> int:
        return self._get(lambda: self._resources.get(resource, Resource()).snapshots)

    def registrations(self, resource: str) -> list[float]:
        """time.monotonic() of every successful Register of the resource."""
        return self._get(lambda: list(self._resources.get(resource, Resource()).registrations))

    def connected(self, resource: str) -> bool:
        def check() -> bool:
            res = self._resources.get(resource)
            return bool(
                res and res.endpoint and res.endpoint.stopped_at is None and res.snapshots and res.devices
            )

        return self._get(check)

    def wait_for(self, predicate: Callable[[], bool], timeout: float = 30.0, interval: float = 0.05) -> None:
        """Poll until predicate() is true; TimeoutError after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise TimeoutError(f"condition not met within {timeout:.0f}s")
            time.sleep(interval)

    # -- running a container's process on the sim ---------------------------------------------------

    def container_root(self, pod_uid: str, container: str) -> Path:
        """The container's filesystem view: each mount of its Allocate responses as a
        symlink at <root>/<container_path>, pointing to the host path."""
        base = self.root / "containers" / pod_uid / container
        link_mounts(base, self._mounts(pod_uid, container))
        return base

    def _mounts(self, pod_uid: str, container: str) -> list[MountSpec]:
        responses = self._get(
            lambda: [a.response for a in self._pods[pod_uid].allocations.get(container, {}).values()]
        )
        return [m for r in responses for m in mounts_of(r)]

    def container_env(self, pod_uid: str, container: str) -> dict[str, str]:
        """The envs of the container's Allocate responses, with container paths mapped to
        its filesystem view (container_root), so a host process sees what the container would."""
        root = self.container_root(pod_uid, container)
        envs: dict[str, str] = {}
        for alloc in self._get(lambda: list(self._pods[pod_uid].allocations.get(container, {}).values())):
            envs.update(alloc.response.envs)
        return translate_envs(envs, self._mounts(pod_uid, container), root)
