"""The DRA driver's gRPC servers: registration with the kubelet, DRAPlugin, DRAResourceHealth.

The kubelet's plugin watcher finds the registration socket in <kubelet dir>/plugins_registry/,
calls GetInfo (type DRAPlugin, the driver name, the endpoint of the driver's socket and the
services it serves: v1.DRAPlugin first, so a kubelet that knows v1 takes it, then
v1beta1.DRAPlugin, then v1.DRAResourceHealth) and tells the outcome with
NotifyRegistrationStatus. It then calls NodePrepareResources and NodeUnprepareResources on the
driver's socket, and opens the health stream where it knows that service.

Every claim of a call gets an entry in the answer, its own error if it was refused: one bad
claim does not fail the others, and a missing entry would only be asked for again. The
servers are served first and the registration socket last, so the kubelet never finds a
driver that does not answer yet; a supervisor serves either again if its socket disappears.
A kubelet restart needs nothing of the driver here: the watcher finds the socket again.

All of it runs on the agent's event loop (grpc.aio); the decisions belong to a Backend.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Protocol

import grpc

from gpufrac.core import logs
from gpufrac.core.claims import ClaimRef
from gpufrac.core.errors import AllocationError
from gpufrac.proto import dra_health_v1_pb2 as hpb
from gpufrac.proto import dra_health_v1_pb2_grpc as hpb_grpc
from gpufrac.proto import dra_v1_pb2 as v1
from gpufrac.proto import dra_v1_pb2_grpc as v1_grpc
from gpufrac.proto import dra_v1beta1_pb2 as v1beta1
from gpufrac.proto import dra_v1beta1_pb2_grpc as v1beta1_grpc
from gpufrac.proto import pluginregistration_pb2 as reg
from gpufrac.proto import pluginregistration_pb2_grpc as reg_grpc

log = logging.getLogger(__name__)
rpc_log = logging.getLogger("gpufrac.dra.rpc")

PLUGIN_TYPE = "DRAPlugin"
# The services the driver serves, as the kubelet names them: the first DRAPlugin version it
# knows is the one it uses, so the newest comes first.
DRA_SERVICES = ("v1.DRAPlugin", "v1beta1.DRAPlugin")
HEALTH_SERVICE = "v1.DRAResourceHealth"
WATCH_INTERVAL = 0.5  # socket checks of the supervisor
TIMES_KEPT = 4096  # per-call handler times kept for the summary logged at stop


class PreparedDevice(Protocol):
    """One device of a prepared claim (gpufrac.agent.booking.claims.PreparedDevice)."""

    @property
    def requests(self) -> tuple[str, ...]: ...
    @property
    def pool(self) -> str: ...
    @property
    def device(self) -> str: ...
    @property
    def cdi_ids(self) -> tuple[str, ...]: ...


class DeviceHealth(Protocol):
    """One published device's health (gpufrac.agent.booking.claims.DeviceHealth)."""

    @property
    def pool(self) -> str: ...
    @property
    def device(self) -> str: ...
    @property
    def healthy(self) -> bool: ...
    @property
    def message(self) -> str: ...


class Backend(Protocol):
    """What the driver needs of the agent: the allocation service. Refusals are
    gpufrac.core.errors.AllocationError, one per claim."""

    async def prepare_claims(
        self, refs: Sequence[ClaimRef]
    ) -> Mapping[str, Sequence[PreparedDevice] | AllocationError]: ...
    async def unprepare_claims(self, refs: Sequence[ClaimRef]) -> Mapping[str, AllocationError | None]: ...
    def device_health(self) -> Sequence[DeviceHealth]: ...


def _refs(claims: Sequence[v1.Claim] | Sequence[v1beta1.Claim]) -> tuple[list[ClaimRef], dict[str, str]]:
    """The claims of a request, and an error for each one the kubelet named incompletely."""
    refs, bad = [], {}
    for c in claims:
        if c.uid and c.namespace and c.name:
            refs.append(ClaimRef(c.namespace, c.name, c.uid))
        else:
            bad[c.uid] = (
                f"claim {c.namespace!r}/{c.name!r} uid {c.uid!r}: namespace, name and uid are required"
            )
    return refs, bad


class Driver:
    """The DRAPlugin calls, whichever version they came in (the messages are the same)."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        # Seconds inside the handler per NodePrepareResources call (the bench reads them).
        self.prepare_seconds: deque[float] = deque(maxlen=TIMES_KEPT)

    async def prepare(self, request: v1.NodePrepareResourcesRequest) -> v1.NodePrepareResourcesResponse:
        t0 = time.perf_counter()
        refs, bad = _refs(request.claims)
        resp = v1.NodePrepareResourcesResponse()
        for uid, error in bad.items():
            resp.claims[uid].error = error
        results = await self.backend.prepare_claims(refs) if refs else {}
        for ref in refs:
            result = results.get(ref.uid)
            entry = resp.claims[ref.uid]
            if result is None:
                entry.error = f"{ref.who()}: not answered by the agent"
            elif isinstance(result, AllocationError):
                entry.error = result.message
            else:
                for d in result:
                    entry.devices.add(
                        request_names=list(d.requests),
                        pool_name=d.pool,
                        device_name=d.device,
                        cdi_device_ids=list(d.cdi_ids),
                    )
        dt = time.perf_counter() - t0
        self.prepare_seconds.append(dt)
        rpc_log.debug("NodePrepareResources of %d claims handled in %.3f ms", len(request.claims), dt * 1000)
        return resp

    async def unprepare(self, request: v1.NodeUnprepareResourcesRequest) -> v1.NodeUnprepareResourcesResponse:
        refs, bad = _refs(request.claims)
        resp = v1.NodeUnprepareResourcesResponse()
        for uid, error in bad.items():
            resp.claims[uid].error = error
        results = await self.backend.unprepare_claims(refs) if refs else {}
        for ref in refs:
            err = results.get(ref.uid)
            entry = resp.claims[ref.uid]  # an entry for every claim, empty on success
            if err is not None:
                entry.error = err.message
        return resp

    def log_summary(self) -> None:
        times = sorted(self.prepare_seconds)
        if times:

            def ms(q: float) -> float:
                return round(times[min(len(times) - 1, round(q * (len(times) - 1)))] * 1000, 3)

            log.info(
                "DRA driver: %d NodePrepareResources calls; time in the handler p50 %.3f ms, p99 %.3f ms",
                len(times),
                ms(0.5),
                ms(0.99),
                extra={
                    logs.FIELDS: {
                        "prepare_calls": len(times),
                        "prepare_handler_p50_ms": ms(0.5),
                        "prepare_handler_p99_ms": ms(0.99),
                        "prepare_handler_max_ms": ms(1.0),
                    }
                },
            )


class V1Plugin(v1_grpc.DRAPluginServicer):
    """k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin"""

    def __init__(self, driver: Driver) -> None:
        self.driver = driver

    async def NodePrepareResources(
        self,
        request: v1.NodePrepareResourcesRequest,
        context: grpc.aio.ServicerContext[v1.NodePrepareResourcesRequest, v1.NodePrepareResourcesResponse],
    ) -> v1.NodePrepareResourcesResponse:
        return await self.driver.prepare(request)

    async def NodeUnprepareResources(
        self,
        request: v1.NodeUnprepareResourcesRequest,
        context: grpc.aio.ServicerContext[
            v1.NodeUnprepareResourcesRequest, v1.NodeUnprepareResourcesResponse
        ],
    ) -> v1.NodeUnprepareResourcesResponse:
        return await self.driver.unprepare(request)


class V1beta1Plugin(v1beta1_grpc.DRAPluginServicer):
    """k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin: v1's messages under another package
    (the wire format is the same), for a kubelet that knows only v1beta1 (1.32, 1.33)."""

    def __init__(self, driver: Driver) -> None:
        self.driver = driver

    async def NodePrepareResources(
        self,
        request: v1beta1.NodePrepareResourcesRequest,
        context: grpc.aio.ServicerContext[
            v1beta1.NodePrepareResourcesRequest, v1beta1.NodePrepareResourcesResponse
        ],
    ) -> v1beta1.NodePrepareResourcesResponse:
        req = v1.NodePrepareResourcesRequest.FromString(request.SerializeToString())
        resp = await self.driver.prepare(req)
        return v1beta1.NodePrepareResourcesResponse.FromString(resp.SerializeToString())

    async def NodeUnprepareResources(
        self,
        request: v1beta1.NodeUnprepareResourcesRequest,
        context: grpc.aio.ServicerContext[
            v1beta1.NodeUnprepareResourcesRequest, v1beta1.NodeUnprepareResourcesResponse
        ],
    ) -> v1beta1.NodeUnprepareResourcesResponse:
        req = v1.NodeUnprepareResourcesRequest.FromString(request.SerializeToString())
        resp = await self.driver.unprepare(req)
        return v1beta1.NodeUnprepareResourcesResponse.FromString(resp.SerializeToString())


class Health(hpb_grpc.DRAResourceHealthServicer):
    """v1.DRAResourceHealth: every message is the whole device list; the first goes out at
    once, a new one when a device's health changes (notify() is called on every booking
    too: those are no news here), and the same one again every `heartbeat` seconds, as the
    kubelet counts a device it has heard nothing of for 30 s as Unknown."""

    HEARTBEAT_S = 10.0

    def __init__(self, backend: Backend, heartbeat: float = HEARTBEAT_S) -> None:
        self.backend = backend
        self.heartbeat = heartbeat
        self._version = 0
        self._changed = asyncio.Event()
        self.streams = 0

    def notify(self) -> None:
        self._version += 1
        ev, self._changed = self._changed, asyncio.Event()
        ev.set()

    def snapshot(self) -> tuple[tuple[tuple[str, str, bool, str], ...], hpb.NodeWatchResourcesResponse]:
        """The devices' health (to compare with what a stream sent last) and the message."""
        now = int(time.time())
        state = tuple((d.pool, d.device, d.healthy, d.message[:1024]) for d in self.backend.device_health())
        resp = hpb.NodeWatchResourcesResponse()
        for pool, device, healthy, message in state:
            resp.devices.add(
                device=hpb.DeviceIdentifier(pool_name=pool, device_name=device),
                health=hpb.HEALTHY if healthy else hpb.UNHEALTHY,
                last_updated_time=now,
                message=message,
            )
        return state, resp

    async def NodeWatchResources(
        self,
        request: hpb.NodeWatchResourcesRequest,
        context: grpc.aio.ServicerContext[hpb.NodeWatchResourcesRequest, hpb.NodeWatchResourcesResponse],
    ) -> AsyncIterator[hpb.NodeWatchResourcesResponse]:
        self.streams += 1
        sent: object = None
        due = 0.0
        try:
            while True:
                version, changed = self._version, self._changed
                state, resp = self.snapshot()
                now = time.monotonic()
                if state != sent or now >= due:
                    yield resp
                    sent, due = state, now + self.heartbeat
                if self._version == version:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(changed.wait(), max(0.0, due - time.monotonic()))
        finally:
            self.streams -= 1


class Registration(reg_grpc.RegistrationServicer):
    """pluginregistration.Registration: what the kubelet's plugin watcher asks."""

    def __init__(self, driver_name: str, endpoint: str, registered: asyncio.Event) -> None:
        self.driver_name = driver_name
        self.endpoint = endpoint
        self.registered = registered
        self.notifications = 0
        self.last_error = ""

    async def GetInfo(
        self, request: reg.InfoRequest, context: grpc.aio.ServicerContext[reg.InfoRequest, reg.PluginInfo]
    ) -> reg.PluginInfo:
        return reg.PluginInfo(
            type=PLUGIN_TYPE,
            name=self.driver_name,
            endpoint=self.endpoint,
            supported_versions=[*DRA_SERVICES, HEALTH_SERVICE],
        )

    async def NotifyRegistrationStatus(
        self,
        request: reg.RegistrationStatus,
        context: grpc.aio.ServicerContext[reg.RegistrationStatus, reg.RegistrationStatusResponse],
    ) -> reg.RegistrationStatusResponse:
        self.notifications += 1
        if request.plugin_registered:
            self.last_error = ""
            self.registered.set()
            log.info("DRA driver %s: registered with the kubelet", self.driver_name)
        else:
            self.last_error = request.error
            self.registered.clear()
            log.error(
                "DRA driver %s: the kubelet refused the registration: %s", self.driver_name, request.error
            )
        return reg.RegistrationStatusResponse()


def _stat_id(path: str) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_ctime_ns)


class _Served:
    """One grpc.aio server on one unix socket, served again if the socket goes away."""

    def __init__(self, path: str, what: str, add: Callable[[grpc.aio.Server], None]) -> None:
        self.path = path
        self.what = what
        self.add = add  # adds the servicers to a new server
        self.server: grpc.aio.Server | None = None
        self.socket_id: tuple[int, int, int] | None = None

    async def serve(self) -> None:
        await self.stop(unlink=False)
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # a stale socket of an earlier run
        server = grpc.aio.server()
        self.add(server)
        server.add_insecure_port(f"unix://{self.path}")
        await server.start()
        self.server = server
        self.socket_id = _stat_id(self.path)
        log.info("serving %s on %s", self.what, self.path)

    def gone(self) -> bool:
        return _stat_id(self.path) != self.socket_id

    async def stop(self, *, unlink: bool = True) -> None:
        if self.server is not None:
            await self.server.stop(grace=0)
            self.server = None
        if unlink and self.socket_id is not None and _stat_id(self.path) == self.socket_id:
            with contextlib.suppress(OSError):
                os.unlink(self.path)


class DraPluginServer:
    """Serves the driver's socket and its registration socket, and keeps both served."""

    def __init__(
        self, backend: Backend, *, driver_name: str, plugin_socket: str, registration_socket: str
    ) -> None:
        self.driver = Driver(backend)
        self.health = Health(backend)
        self.registered = asyncio.Event()
        self.registration = Registration(driver_name, plugin_socket, self.registered)
        v1_plugin, v1beta1_plugin = V1Plugin(self.driver), V1beta1Plugin(self.driver)

        def driver_services(server: grpc.aio.Server) -> None:
            v1_grpc.add_DRAPluginServicer_to_server(v1_plugin, server)
            v1beta1_grpc.add_DRAPluginServicer_to_server(v1beta1_plugin, server)
            hpb_grpc.add_DRAResourceHealthServicer_to_server(self.health, server)

        def registration(server: grpc.aio.Server) -> None:
            reg_grpc.add_RegistrationServicer_to_server(self.registration, server)

        self.plugin = _Served(plugin_socket, f"DRA driver {driver_name}", driver_services)
        self.reg = _Served(registration_socket, f"DRA driver {driver_name} registration", registration)
        self._task: asyncio.Task[None] | None = None

    @property
    def registrations(self) -> int:
        return self.registration.notifications

    def notify(self) -> None:
        """Device health changed: the health streams send the new list."""
        self.health.notify()

    async def start(self) -> None:
        await self.plugin.serve()
        await self.reg.serve()  # last: the kubelet calls what it finds registered at once
        self._task = asyncio.create_task(self._supervise(), name="dra-supervise")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.reg.stop()  # first: the kubelet stops calling the driver it deregisters
        await self.plugin.stop()
        self.driver.log_summary()

    async def _supervise(self) -> None:
        while True:
            await asyncio.sleep(WATCH_INTERVAL)
            try:
                if self.plugin.gone():
                    log.warning("%s was removed: serving it again", self.plugin.path)
                    await self.plugin.serve()
                if self.reg.gone():
                    log.warning(
                        "%s was removed: serving it again (the kubelet registers it anew)", self.reg.path
                    )
                    self.registered.clear()
                    await self.reg.serve()
            except Exception:
                log.exception("DRA driver: serving again failed; retrying")
