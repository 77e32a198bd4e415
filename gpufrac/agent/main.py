"""The gpufrac node agent: device plugins, the allocation ledger, health, recovery.

One asyncio loop owns all agent state (docs/architecture.md): the ledger, the two
device-plugin servers, the reconciler with the kubelet's pod-resources and the
health monitor (whose blocking NVML wait runs in a worker thread).

Run it with `gpufrac agent --config node.yaml` or `python -m gpufrac.agent.main`;
tests, the bench and the demo may also run `Agent` in-process (AgentThread).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import logging
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Hashable, Sequence
from typing import Any, TypeVar

import grpc

from gpufrac.agent import config as config_mod
from gpufrac.agent import eventloop, events, logs
from gpufrac.agent import metrics as metrics_mod
from gpufrac.agent.admission import Admission
from gpufrac.agent.allocations import (
    AllocationError,
    ContainerAlloc,
    ContainerDirs,
    Ledger,
    keyed,
)
from gpufrac.agent.config import Config
from gpufrac.agent.gpus import GpuHealth, Inventory
from gpufrac.agent.nodelabels import NodeLabels
from gpufrac.agent.state import StateStore, restore
from gpufrac.agent.status import server as status_mod
from gpufrac.deviceplugin import preferred as preferred_mod
from gpufrac.deviceplugin import slices
from gpufrac.deviceplugin.podresources import ContainerDevices, PodResourcesClient
from gpufrac.deviceplugin.server import DevicePlugin, PluginServer

log = logging.getLogger("gpufrac.agent")
T = TypeVar("T")

# How often the agent asks pod-resources which containers still hold devices.
RECONCILE_INTERVAL = 3.0
# A fresh allocation is not released for missing from pod-resources this soon: the
# kubelet records it only after Allocate returns.
RELEASE_GRACE = 10.0
# Changes within this long of the first are saved to the state file together. Under pod
# churn every admission and release changes the ledger; a save per change (encode, write,
# fsync) cost the agent about as much CPU as the admissions themselves. What a kill -9
# loses from this window, recovery rebuilds from pod-resources and the config files.
PERSIST_BATCH = 0.1


def _recorded_before(alloc: ContainerAlloc, when: float) -> bool:
    return alloc.recorded_at is not None and alloc.recorded_at < when


class Agent:
    """The agent. `inventory` and `health` may be injected (tests); by default they
    come from NVML (gpufrac.agent.inventory / gpufrac.agent.health)."""

    def __init__(
        self,
        config: Config,
        *,
        inventory: Inventory | None = None,
        health: Any | None = None,
        reconcile_interval: float = RECONCILE_INTERVAL,
        release_grace: float = RELEASE_GRACE,
    ) -> None:
        self.config = config
        self.inventory = inventory
        self.health = health
        self.reconcile_interval = reconcile_interval
        self.release_grace = release_grace
        self.ledger: Ledger | None = None
        self.state = StateStore(config.paths.state_dir)
        self.pod_resources = PodResourcesClient(config.paths.pod_resources_socket)
        # Last pod-resources answer: container key -> who holds those devices.
        self.listing: dict[str, ContainerDevices] = {}
        # Lists asked and the latest applied (reconciles overlap: the loop, identity passes,
        # Allocate and PreStartContainer; an answer older than the one applied is dropped).
        self._lists_asked = 0
        self._list_applied = 0
        self._listing_asked = 0.0  # time.monotonic() when the applied List was asked
        self.plugins: dict[str, DevicePlugin] = {}
        self.servers: dict[str, PluginServer] = {}
        self.started = asyncio.Event()
        self._stopping = asyncio.Event()
        # Container directories: written, deleted and swept in order, off the loop.
        self.dirs = ContainerDirs(config.paths.containers_dir, config.paths.state_dir)
        self._notified_generation = -1
        self._state_generation = -1  # the ledger's state_generation the last save request saw
        self._tasks: list[asyncio.Task[Any]] = []
        self._dirty = asyncio.Event()
        self._identity_task: asyncio.Task[None] | None = None
        self.identity: Any | None = None  # set by gpufrac.agent.identity on first use
        self.arbiter: Any | None = None  # gpufrac.agent.arbiter.Arbiter: burst grants
        self.watchdog: Any | None = None  # gpufrac.agent.watchdog.Watchdog (started with the arbiter)
        # gpufrac.agent.idle: per-container GPU activity (ActivityTracker) and the IdleReaper.
        self.activity: Any | None = None
        self.reaper: Any | None = None
        self._identity_again = False
        # /metrics, /healthz, /readyz (gpufrac.agent.metrics) and the status socket (gpufrac.agent.status).
        self.metrics = metrics_mod.Metrics()
        self.status_server: status_mod.StatusServer | None = None
        # Reclaim at admission: a new container's request is taken back from others' bursts.
        self.admission = Admission(self)
        # gpufrac.dev/ labels on this Node (product, memory, count, health, sharing, driver).
        self.node_labels = NodeLabels(
            config, lambda: self.inventory, lambda uuid: self.ledger is not None and self.ledger.healthy(uuid)
        )

    # -- lifetime --------------------------------------------------------------------

    async def start(self) -> None:
        cfg = self.config
        # First: the probes answer (not ready) while NVML and recovery take their time.
        await self.metrics.start(self)
        self.status_server = await status_mod.start(self)
        await self.dirs.start()
        if self.inventory is None:
            from gpufrac.agent.inventory import read_inventory

            self.inventory = await asyncio.to_thread(read_inventory)
        ledger = self.ledger = Ledger(cfg, self.inventory)
        ledger.retire = self.dirs.discard
        log.info(
            "agent on %s: %d GPUs, policy %s, memory unit %d bytes, reserved %d bytes per GPU",
            cfg.node_name,
            len(self.inventory.gpus),
            cfg.allocation_policy,
            cfg.memory_unit,
            cfg.reserved_per_gpu,
        )
        await self._recover()
        ledger.add_listener(self._on_change)
        if self.health is None:
            self.health = await asyncio.to_thread(self._open_health)
        if self.health is not None:
            self._apply_health(self.health.current())
            self._tasks.append(asyncio.create_task(self._health_loop(), name="health"))
        await self._start_arbiter()  # before any container can start and ask
        self._start_watchdog()
        for resource in slices.RESOURCES:
            plugin = self.plugins[resource] = DevicePlugin(resource, self)
            server = self.servers[resource] = PluginServer(plugin, cfg.paths.device_plugin_dir)
            await server.start()
        self._tasks.append(asyncio.create_task(self._persist_loop(), name="persist"))
        self._tasks.append(asyncio.create_task(self._reconcile_loop(), name="reconcile"))
        self._tasks.append(asyncio.create_task(self._idle_loop(), name="idle"))
        self.node_labels.refresh()
        self.started.set()

    async def _idle_loop(self) -> None:
        """Activity tracking and idle reaping, every idle.interval (gpufrac.agent.idle)."""
        from gpufrac.agent import idle

        try:
            await idle.run_for(self)
        except Exception:  # the rest of the agent goes on without it
            log.exception("idle reaper stopped")

    async def _start_arbiter(self) -> None:
        """The burst arbiter on one node-wide socket (bind-mounted into each container).
        Pod identity and Events come from gpufrac.agent.identity once it exists."""
        from gpufrac.agent.arbiter import Arbiter
        from gpufrac.agent.peers import PeerLookup, namer_from_pods
        from gpufrac.deviceplugin.server import arbiter_socket

        assert self.ledger is not None
        path = arbiter_socket(self.config)

        def namer(pod_uid: str, container_id: str) -> str | None:
            return namer_from_pods(getattr(self.identity, "pods", None))(pod_uid, container_id)

        arbiter = Arbiter(
            self.config,
            self.ledger,
            PeerLookup(self.ledger, namer),
            path,
            events=lambda: getattr(self.identity, "events", None),
        )
        try:
            await arbiter.start()
        except OSError as e:  # the shim then refuses bursts: safe, and the rest still works
            log.error("burst arbiter unavailable: cannot listen on %s: %s", path, e)
            return
        self.arbiter = arbiter
        self._kick_identity()  # callers are identified through the pod cache: start it now
        if arbiter.swap is not None:
            # Checkpoint API detection (blocking, in a thread) and takeover of containers a
            # previous agent swapped out; bursts do not wait for it.
            self._tasks.append(asyncio.create_task(arbiter.swap.start(), name="swap-start"))

    def _start_watchdog(self) -> None:
        """NVML's per-process memory against each container's limit (gpufrac.agent.watchdog).
        Containers are told apart as the arbiter tells its callers apart."""
        from gpufrac.agent.peers import PeerLookup, namer_from_pods
        from gpufrac.agent.watchdog import Watchdog

        assert self.ledger is not None
        peers = getattr(self.arbiter, "peers", None) or PeerLookup(
            self.ledger, lambda uid, cid: namer_from_pods(getattr(self.identity, "pods", None))(uid, cid)
        )
        self.watchdog = Watchdog(
            self.config.watchdog, self.ledger, peers, lambda: getattr(self.identity, "events", None)
        )
        task = self.watchdog.start()
        if task is not None:
            self._tasks.append(task)

    def _open_health(self) -> Any | None:
        try:
            from gpufrac.agent.health import HealthMonitor

            assert self.inventory is not None
            return HealthMonitor(self.config.health, gpus=self.inventory.gpus)
        except Exception as e:  # no health monitoring is better than no agent
            log.error("GPU health monitoring unavailable: %s", e)
            return None

    async def stop(self) -> None:
        self._stopping.set()
        for server in self.servers.values():
            await server.stop()
        await self.admission.stop()
        if self.arbiter is not None:
            await self.arbiter.stop()  # waiters are answered (denied), the socket removed
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self._identity_task is not None:
            self._identity_task.cancel()
        close = getattr(self.identity, "close", None)
        if close is not None:
            with contextlib.suppress(Exception):
                result = close()
                if inspect.isawaitable(result):
                    await result
        await self.pod_resources.close()
        if self.ledger is not None:
            await self.state.save(self.ledger)
        if self.health is not None and hasattr(self.health, "close"):
            await asyncio.to_thread(self.health.close)
        await self.node_labels.close()
        if self.status_server is not None:
            await self.status_server.stop()
        await self.metrics.stop()
        await self.dirs.close()  # queued deletions finish

    async def run(self) -> None:
        """Start, serve until stop() (or SIGTERM/SIGINT), then stop."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.add_signal_handler(sig, self._stopping.set)
        await self.start()
        log.info("agent ready")
        await self._stopping.wait()
        log.info("agent stopping")
        await self.stop()

    # -- recovery --------------------------------------------------------------------

    async def _recover(self) -> None:
        """Rebuild the ledger: persisted state, reconciled with what the kubelet says."""
        assert self.ledger is not None
        entries = await asyncio.to_thread(self.state.load)
        restored = restore(self.ledger, entries or [])
        if restored:
            log.info("state: %d allocations restored from %s", len(restored), self.state.path)
        if not await self.reconcile(grace=0.0, materialize=False):
            log.warning(
                "pod-resources (%s) not reachable at start: keeping %d persisted allocations until it "
                "answers",
                self.config.paths.pod_resources_socket,
                len(self.ledger.containers()),
            )
        # Grants published after the last state save must survive rewriting the config files.
        from gpufrac.agent.arbiter import adopt_grants, published_grants

        booked = [(a.key, a.directory, a.config.gpu_uuid, a.request_bytes) for a in self.ledger.containers()]
        adopt_grants(self.ledger, await asyncio.to_thread(published_grants, booked))
        await self._materialize_all()
        await self._sweep_orphans()
        await self.state.save(self.ledger)

    async def _materialize_all(self) -> None:
        """(Re)write every booked container's directory and keep its config open."""
        assert self.ledger is not None
        for alloc in self.ledger.containers():
            handle = await self.dirs.write(alloc.directory, alloc.config)
            self.ledger.attach(alloc.key, handle)

    async def _sweep_orphans(self) -> None:
        assert self.ledger is not None
        ledger = self.ledger
        await self.dirs.sweep(lambda: [a.key for a in ledger.containers()])

    async def reconcile(self, grace: float | None = None, materialize: bool = True) -> bool:
        """Align the ledger with pod-resources: release what the kubelet no longer lists
        (older than `grace`), rebuild what it lists but the ledger lacks, record names.
        False when pod-resources did not answer (nothing changed then)."""
        assert self.ledger is not None
        grace = self.release_grace if grace is None else grace
        asked = time.monotonic()
        self._lists_asked += 1
        seq = self._lists_asked
        try:
            listed = await self.pod_resources.list(slices.RESOURCES)
        except grpc.aio.AioRpcError as e:
            log.debug("pod-resources List: %s", e.details())
            return False
        if seq < self._list_applied:
            # A List asked after this one was applied meanwhile: this answer is older than
            # what the ledger now follows (it may name a released key's former pod). The
            # caller's release rule (Allocate asks with grace 0) goes over the newer one.
            self._release_unlisted(grace, self._listing_asked)
            return True
        self._list_applied, self._listing_asked = seq, asked
        self.listing = keyed(listed)
        for alloc in self.ledger.containers():
            c = self.listing.get(alloc.key)
            if c is not None:
                if alloc.recorded_at is None:
                    alloc.recorded_at = asked
                if alloc.pod is None:
                    self.ledger.bind(alloc.key, c.namespace, c.pod, c.container, alloc.pod_uid)
        self._release_unlisted(grace, asked)
        for key, c in self.listing.items():
            if seq != self._list_applied:
                break  # a newer List was applied during the last await: it decides the rest
            if self.ledger.get(key) is not None:
                continue
            try:
                alloc = self.ledger.reserve(c.resource, list(c.device_ids), ignore_health=True)
            except AllocationError as e:
                log.error(
                    "cannot rebuild allocation of %s/%s %s: %s", c.namespace, c.pod, c.container, e.message
                )
                continue
            alloc.recorded_at = asked  # listed: the kubelet holds it
            self.ledger.bind(alloc.key, c.namespace, c.pod, c.container, None)
            log.info(
                "rebuilt allocation %s of %s/%s %s from pod-resources", key, c.namespace, c.pod, c.container
            )
            if materialize:
                try:
                    handle = await self.dirs.write(alloc.directory, alloc.config)
                except OSError as e:
                    # Unbooked again, so the next reconcile rebuilds it (and tries the files again).
                    log.error("cannot write the directory of rebuilt allocation %s: %s", key, e)
                    if self.ledger.get(key) is alloc:
                        self.ledger.release(key)
                    continue
                self.ledger.attach(alloc.key, handle)
        return True

    def _release_unlisted(self, grace: float, asked: float) -> None:
        """Release the bookings the last applied List (asked at `asked`) lacks, unless younger
        than `grace` and not yet recorded by the kubelet."""
        assert self.ledger is not None
        now = time.time()
        for alloc in self.ledger.containers():
            if alloc.key in self.listing:
                continue
            if now - alloc.created >= grace or _recorded_before(alloc, asked):
                # Too old to be an Allocate the kubelet has yet to record, or recorded
                # before this List was asked: the kubelet has let it go.
                logs.decision(
                    log,
                    "release",
                    "releasing %s (%s): pod-resources no longer lists it",
                    alloc.key,
                    alloc.who(),
                    container=alloc.key,
                    resource=alloc.resource,
                    gpus=",".join(alloc.gpus),
                    request_bytes=alloc.request_bytes,
                    namespace=alloc.namespace or "",
                    pod=alloc.pod or "",
                )
                self.ledger.release(alloc.key)
                self.metrics.forget(alloc.key)

    async def _reconcile_loop(self) -> None:
        while True:
            await asyncio.sleep(self.reconcile_interval)
            try:
                if await self.reconcile():
                    await self._sweep_orphans()
                    await self._resolve_identity()
                else:
                    self.metrics.count_reconcile_error()  # pod-resources did not answer
            except Exception:
                self.metrics.count_reconcile_error()
                log.exception("reconcile failed")

    # -- persistence and change propagation ---------------------------------------------

    def _on_change(self) -> None:
        assert self.ledger is not None
        # Only bookings and health change the device lists; identity, limits and grants
        # change configs, which the state file follows but ListAndWatch need not resend.
        if self.ledger.capacity_generation != self._notified_generation:
            self._notified_generation = self.ledger.capacity_generation
            for plugin in self.plugins.values():
                plugin.notify()
        if self.ledger.state_generation != self._state_generation:
            self._state_generation = self.ledger.state_generation
            self._dirty.set()

    async def _persist_loop(self) -> None:
        while True:
            await self._dirty.wait()
            await asyncio.sleep(PERSIST_BATCH)
            self._dirty.clear()
            try:
                await self.state.save(self.ledger)
            except OSError as e:
                log.error("cannot write state file %s: %s", self.state.path, e)
                await asyncio.sleep(1.0)
                self._dirty.set()

    # -- health ------------------------------------------------------------------------

    def _apply_health(self, health: dict[str, GpuHealth]) -> None:
        assert self.ledger is not None
        changed = False
        for uuid, h in health.items():
            if self.ledger.set_health(uuid, h.healthy, h.reason):
                changed = True
                state = "Healthy" if h.healthy else "Unhealthy"
                text = f"GPU {uuid} is now {state}{f' ({h.reason})' if h.reason else ''}: its slices follow"
                logs.decision(log, "gpu-health", text, level=logging.WARNING, gpu=uuid, healthy=h.healthy)
                events.post_node(
                    self,
                    events.NORMAL if h.healthy else events.WARNING,
                    events.REASON_GPU_HEALTHY if h.healthy else events.REASON_GPU_UNHEALTHY,
                    text,
                )
        if changed and self.started.is_set():
            self.node_labels.refresh()  # gpufrac.dev/gpu.healthy follows

    async def _health_loop(self) -> None:
        interval = self.config.health.poll_interval
        while True:
            # The wait ends at once on an XID; otherwise after the poll interval (loss checks),
            # or sooner when an XID's recovery window closes and the GPU may be Healthy again.
            wait = interval
            recovery = getattr(self.health, "next_change_in", lambda: None)()
            if recovery is not None:
                wait = min(wait, recovery)
            try:
                changes = await asyncio.to_thread(self.health.poll, max(10, int(wait * 1000)))
            except Exception as e:
                log.error("health poll failed: %s", e)
                await asyncio.sleep(interval)
                continue
            if changes or changes is None:  # the ledger already holds an unchanged health
                self._apply_health(self.health.current())

    # -- Backend for the device-plugin servers --------------------------------------------

    def device_sections(
        self, resource: str
    ) -> list[tuple[Hashable, Callable[[], list[tuple[str, bool, int | None]]]]]:
        assert self.ledger is not None
        return list(self.ledger.device_sections(resource))

    def preferred(self, resource: str, available: Sequence[str], must: Sequence[str], size: int) -> list[str]:
        assert self.ledger is not None and self.inventory is not None
        return preferred_mod.preferred(
            resource,
            available,
            must,
            size,
            self.ledger.geometry,
            self.inventory,
            self.config.allocation_policy,
            self.ledger.booked(),
            self.ledger.released(),
        )

    async def allocate(self, resource: str, device_ids: Sequence[str]) -> ContainerAlloc:
        ledger = self.ledger
        assert ledger is not None
        existing = ledger.find(resource, device_ids)
        if existing is not None or any(ledger.owner(d) for d in device_ids):
            # The kubelet reuses devices of deleted pods without telling us: ask it
            # which holders are still alive before calling this double booking.
            if await self.reconcile(grace=0.0):
                existing = ledger.find(resource, device_ids)
                if existing is not None and existing.key in self.listing:
                    log.info(
                        "Allocate: %s again for %s (kubelet re-allocation)", existing.key, existing.who()
                    )
                    return existing
            elif existing is not None:
                # Cannot tell who holds them: start over with the safe config (limit = request).
                ledger.release(existing.key)
        alloc = ledger.reserve(resource, device_ids)
        try:
            handle = await self.dirs.create(alloc.directory, alloc.config)
        except OSError as e:
            ledger.release(alloc.key)
            raise AllocationError(
                grpc.StatusCode.INTERNAL, f"cannot create container directory {alloc.directory}: {e}"
            ) from e
        ledger.attach(alloc.key, handle)
        # The state file follows through the persist loop, off the kubelet's critical path:
        # if the agent dies before it lands, pod-resources (the kubelet's record) rebuilds it.
        logs.decision(
            log,
            "allocate",
            "allocated %s: %s x%d on %s (%d bytes per GPU)",
            alloc.key,
            resource,
            alloc.slice_count,
            ",".join(alloc.gpus),
            alloc.request_bytes,
            container=alloc.key,
            resource=resource,
            slices=alloc.slice_count,
            gpus=",".join(alloc.gpus),
            request_bytes=alloc.request_bytes,
        )
        self._kick_identity()
        self.admission.start(alloc)  # PreStartContainer awaits it
        return alloc

    async def prestart(self, resource: str, device_ids: Sequence[str]) -> None:
        assert self.ledger is not None
        if self.ledger.find(resource, device_ids) is None:
            await self.reconcile()  # rebuilds from pod-resources if our state was lost
        alloc = self.ledger.find(resource, device_ids)
        if alloc is None:
            ids = sorted(device_ids)
            raise AllocationError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"PreStartContainer: {resource} devices {ids[:6]}{'…' if len(ids) > 6 else ''} were never "
                "allocated by this agent",
            )
        if alloc.recorded_at is None:
            alloc.recorded_at = time.monotonic()  # the kubelet records an allocation before any start
        self._kick_identity()
        await self.admission.prestart(alloc)  # never fails the start: at worst it warns

    # -- pod identity hook -----------------------------------------------------------------

    def _kick_identity(self) -> None:
        """Resolve pod identity soon, without delaying the kubelet's call."""
        if self._identity_task is not None and not self._identity_task.done():
            self._identity_again = True
            return
        self._identity_task = asyncio.create_task(self._identity_soon())

    async def _identity_soon(self) -> None:
        while True:
            # Coalesce a burst of admissions into one pass (and stay far below the
            # kubelet's pod-resources rate limit).
            await asyncio.sleep(0.2)
            self._identity_again = False
            try:
                await self.reconcile()  # the kubelet has recorded the new allocation by now
                await self._resolve_identity()
            except Exception:  # the reconcile loop tries again; say why this pass failed
                self.metrics.count_reconcile_error()
                log.exception("identity pass after an admission failed")
            if not self._identity_again:
                return

    async def _resolve_identity(self) -> None:
        """Pod identity for new and changed containers (gpufrac.agent.identity.resolve)."""
        from gpufrac.agent.identity import resolve

        try:
            await resolve(self)
        except Exception:
            log.exception("pod identity resolution failed")


class AgentThread:
    """An Agent on its own event loop in a background thread (tests, bench, demo)."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._main, name="gpufrac-agent", daemon=True)
        self._ready = threading.Event()
        self._error: BaseException | None = None

    def _main(self) -> None:
        self.loop = eventloop.new_loop()
        try:
            self.loop.run_until_complete(self._serve())
        except BaseException as e:
            self._error = e
            self._ready.set()
        finally:
            self.loop.close()

    async def _serve(self) -> None:
        self.agent._stopping = asyncio.Event()
        try:
            await self.agent.start()
        finally:
            self._ready.set()
        await self.agent._stopping.wait()
        await self.agent.stop()

    def start(self, timeout: float = 60.0) -> AgentThread:
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("agent did not start")
        if self._error is not None:
            raise self._error
        return self

    def call(self, fn: Callable[[], Coroutine[Any, Any, T]] | Awaitable[T], timeout: float = 30.0) -> T:
        assert self.loop is not None

        async def run() -> T:
            return await (fn() if callable(fn) else fn)

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout)

    def stop(self, timeout: float = 30.0) -> None:
        if self.loop is not None and self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.agent._stopping.set)
            self._thread.join(timeout)


def cmd_agent(args: argparse.Namespace) -> int:
    try:
        cfg = config_mod.load(args.config)
    except config_mod.ConfigError as e:
        print(f"gpufrac agent: {e}", file=sys.stderr)
        return 2
    logs.setup(cfg)
    timing = {
        "reconcile_interval": getattr(args, "reconcile_interval", None) or RECONCILE_INTERVAL,
        "release_grace": RELEASE_GRACE
        if getattr(args, "release_grace", None) is None
        else args.release_grace,
    }
    try:
        eventloop.run(Agent(cfg, **timing).run())
    except Exception as e:
        from gpufrac.agent.inventory import NvmlError

        if isinstance(e, NvmlError):
            log.error("%s", e)
            return 1
        raise
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpufrac.agent.main", description="gpufrac node agent")
    parser.add_argument("--config", help="node config YAML (default: built-in defaults)")
    # Timing knobs for tests and the demo (the DaemonSet keeps the defaults).
    parser.add_argument("--reconcile-interval", type=float, help=f"seconds (default {RECONCILE_INTERVAL})")
    parser.add_argument("--release-grace", type=float, help=f"seconds (default {RELEASE_GRACE})")
    return cmd_agent(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
