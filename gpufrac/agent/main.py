"""The gpufrac node agent: device plugins, the allocation ledger, health, recovery.

One asyncio loop owns all agent state (docs/architecture.md): the ledger, the two
device-plugin servers, the reconciler with the kubelet's pod-resources and the
health monitor (whose blocking NVML wait runs in a worker thread).

This module is the composition root: Agent.start() builds every part once, in dependency
order, and hands each its collaborators (typed Protocols declared next to the code that
needs them). Parts that may be missing on a node are `X | None`, decided here: no
apiserver (kube.connect fails) leaves the pod cache, the Event recorder, the evictor and
the node labeler out; no arbiter socket leaves the arbiter out. No part reaches into the
Agent or sets attributes on it.

One file over the usual size: Agent is the root and also the device plugins' Backend, and
its reconcile, persistence and health loops all turn on the one ledger and the kubelet's
last listing that this class owns; split apart they would have to reach into each other.

Run it with `gpufrac agent --config node.yaml` or `python -m gpufrac.agent.main`;
tests, the bench and the demo may also run `Agent` in-process (AgentThread).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Hashable, Sequence
from typing import Any, Protocol, TypeVar

import grpc
from kubernetes.client import ApiClient

from gpufrac.agent import config as config_mod
from gpufrac.agent import eventloop, events, idle, kube, logs, nodelabels
from gpufrac.agent import metrics as metrics_mod
from gpufrac.agent.activity import ActivityTracker
from gpufrac.agent.admission import Admission
from gpufrac.agent.allocations import (
    ContainerAlloc,
    Ledger,
    keyed,
)
from gpufrac.agent.arbiter import Arbiter, adopt_grants, published_grants
from gpufrac.agent.callers import PeerLookup, namer_from_pods
from gpufrac.agent.config import Config, arbiter_socket
from gpufrac.agent.container_dirs import ContainerDirs
from gpufrac.agent.gpus import GpuHealth, Inventory
from gpufrac.agent.health import HealthMonitor
from gpufrac.agent.idle import IdleReaper
from gpufrac.agent.inventory import NvmlError, read_inventory
from gpufrac.agent.kube import EventRecorder, NodeLabeler, PodCache, PodEvictor
from gpufrac.agent.nodelabels import NodeLabels
from gpufrac.agent.pods import PodIdentity
from gpufrac.agent.state import StateStore, restore
from gpufrac.agent.status import server as status_mod
from gpufrac.agent.watchdog import Watchdog
from gpufrac.core.errors import AllocationError, ErrorKind
from gpufrac.deviceplugin import preferred as preferred_mod
from gpufrac.deviceplugin import slices
from gpufrac.deviceplugin.podresources import PodResourcesClient
from gpufrac.deviceplugin.server import DevicePlugin, PluginServer
from gpufrac.deviceplugin.slices import ContainerDevices

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


class HealthSource(Protocol):
    """GPU health as the agent follows it (gpufrac.agent.health.HealthMonitor); `poll` blocks
    (run in a worker thread) and returns the changes, empty when none, None when unknown."""

    def current(self) -> dict[str, GpuHealth]: ...
    def poll(self, timeout_ms: int) -> Sequence[object] | None: ...
    def next_change_in(self) -> float | None: ...
    def xid_counts(self) -> dict[tuple[str, int], int]: ...
    def close(self) -> None: ...


class Agent:
    """The agent. `inventory` and `health` may be injected (tests); by default they
    come from NVML (gpufrac.agent.inventory / gpufrac.agent.health)."""

    def __init__(
        self,
        config: Config,
        *,
        inventory: Inventory | None = None,
        health: HealthSource | None = None,
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
        self._identity_again = False
        # /metrics, /healthz, /readyz (gpufrac.agent.metrics) and the status socket (gpufrac.agent.status).
        self.metrics = metrics_mod.Metrics()
        self.status_server: status_mod.StatusServer | None = None
        # The parts start() builds, in this order (None until then, or where the node lacks
        # what the part needs: the apiserver, the arbiter socket, NVML).
        self.events: EventRecorder | None = None  # Events on pods and the Node (apiserver)
        self.pods: PodIdentity | None = None  # pod identity and each container's policy
        self.arbiter: Arbiter | None = None  # burst grants, on the node-wide socket
        self.watchdog: Watchdog | None = None  # NVML's per-process memory against the limits
        self.activity: ActivityTracker | None = None  # per-container GPU activity
        self.reaper: IdleReaper | None = None  # gives the GPU back from idle pods
        self.admission: Admission | None = None  # reclaim at admission
        self.node_labels: NodeLabels | None = None  # gpufrac.dev/ labels on this Node

    # -- lifetime --------------------------------------------------------------------

    async def start(self) -> None:
        """Build and start every part, in dependency order."""
        cfg = self.config
        # First: the probes answer (not ready) while NVML and recovery take their time.
        await self.metrics.start(self)
        self.status_server = await status_mod.start(self)
        await self.dirs.start()
        # The one API client, made while NVML and recovery run (a kubeconfig may run an exec plugin).
        connecting = asyncio.create_task(self._connect(), name="kube-connect")
        if self.inventory is None:
            self.inventory = await asyncio.to_thread(read_inventory)
        inventory = self.inventory
        ledger = self.ledger = Ledger(cfg, inventory)
        ledger.retire = self.dirs.discard
        log.info(
            "agent on %s: %d GPUs, policy %s, memory unit %d bytes, reserved %d bytes per GPU",
            cfg.node_name,
            len(inventory.gpus),
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
        api, no_api = await connecting
        # Pod identity and Events: on the apiserver, or without it (limits stay at the request).
        pod_cache: PodCache | None = None
        if api is not None:
            pod_cache = PodCache(api, cfg.node_name)
            pod_cache.start()
            self.events = EventRecorder(api, cfg.node_name)
        else:
            log.error("pod annotations unavailable, every container keeps limit = request: %s", no_api)
        self.pods = PodIdentity(cfg, ledger, pod_cache, self.events, self.pod_resources, metrics=self.metrics)
        await self._start_arbiter(ledger, pod_cache)  # before any container can start and ask
        self._start_watchdog(ledger, pod_cache)
        reaper = await self._open_reaper(ledger, self.pods, api, no_api)
        self.admission = Admission(self.arbiter, ledger, self.events)
        if api is None:
            log.error("node labels unavailable: %s", no_api)
        labeler = NodeLabeler(api, cfg.node_name, nodelabels.OWNED) if api is not None else None
        self.node_labels = NodeLabels(cfg, inventory, ledger.healthy, labeler)
        for resource in slices.RESOURCES:
            plugin = self.plugins[resource] = DevicePlugin(resource, self)
            server = self.servers[resource] = PluginServer(plugin, cfg.paths.device_plugin_dir)
            await server.start()
        self._tasks.append(asyncio.create_task(self._persist_loop(), name="persist"))
        self._tasks.append(asyncio.create_task(self._reconcile_loop(), name="reconcile"))
        if reaper is not None:
            self._tasks.append(asyncio.create_task(self._idle_loop(reaper), name="idle"))
        self.node_labels.refresh()
        self.started.set()

    async def _connect(self) -> tuple[ApiClient | None, str]:
        """The agent's one apiserver client, or None and why not (the node runs without one)."""
        try:
            return await kube.connect(self.config.api_server), ""
        except kube.KubeConfigError as e:
            return None, str(e)

    async def _start_arbiter(self, ledger: Ledger, pod_cache: PodCache | None) -> None:
        """The burst arbiter on one node-wide socket (bind-mounted into each container).
        Its callers are named through the pod cache."""
        path = arbiter_socket(self.config)
        arbiter = Arbiter(
            self.config,
            ledger,
            PeerLookup(ledger, namer_from_pods(pod_cache)),
            path,
            events=self.events,
            metrics=self.metrics,
        )
        try:
            await arbiter.start()
        except OSError as e:  # the shim then refuses bursts: safe, and the rest still works
            log.error("burst arbiter unavailable: cannot listen on %s: %s", path, e)
            return
        self.arbiter = arbiter
        self._kick_identity()  # callers are identified through the pod cache: fill it now
        if arbiter.swap is not None:
            # Checkpoint API detection (blocking, in a thread) and takeover of containers a
            # previous agent swapped out; bursts do not wait for it.
            self._tasks.append(asyncio.create_task(arbiter.swap.start(), name="swap-start"))

    def _start_watchdog(self, ledger: Ledger, pod_cache: PodCache | None) -> None:
        """NVML's per-process memory against each container's limit (gpufrac.agent.watchdog).
        Containers are told apart as the arbiter tells its callers apart."""
        peers = (
            self.arbiter.peers if self.arbiter is not None else PeerLookup(ledger, namer_from_pods(pod_cache))
        )
        self.watchdog = Watchdog(self.config.watchdog, ledger, peers, self.events, metrics=self.metrics)
        task = self.watchdog.start()
        if task is not None:
            self._tasks.append(task)

    async def _open_reaper(
        self, ledger: Ledger, pods: PodIdentity, api: ApiClient | None, no_api: str
    ) -> IdleReaper | None:
        """The activity tracker (NVML when it can be had) and the idle reaper over it; None,
        logged, when the tracker cannot be had (the rest of the agent goes on without it)."""
        cfg = self.config
        try:
            tracker = await asyncio.to_thread(ActivityTracker.with_nvml)
        except Exception:
            log.exception("idle reaper stopped")
            return None
        self.activity = tracker
        evictor: PodEvictor | None = None
        if api is not None:
            evictor = PodEvictor(api, allow_delete=cfg.idle.allow_delete)
        elif cfg.idle.enabled and cfg.idle.action == "evict":
            log.error("idle reaper cannot evict (it will only notify): %s", no_api)
        self.reaper = IdleReaper(
            cfg,
            ledger,
            tracker,
            pods,
            evictor=evictor,
            swapper=lambda alloc, reason: idle.swap_via(self.arbiter, alloc, reason),
            metrics=self.metrics,
        )
        return self.reaper

    async def _idle_loop(self, reaper: IdleReaper) -> None:
        """Activity tracking and idle reaping, every idle.interval (gpufrac.agent.idle)."""
        if self.config.idle.enabled:
            log.info("%s", idle.describe(self.config))
        try:
            await reaper.run()
        except Exception:  # the rest of the agent goes on without it
            log.exception("idle reaper stopped")
        finally:
            await asyncio.to_thread(reaper.tracker.close)

    def _open_health(self) -> HealthSource | None:
        try:
            assert self.inventory is not None
            return HealthMonitor(self.config.health, gpus=self.inventory.gpus)
        except Exception as e:  # no health monitoring is better than no agent
            log.error("GPU health monitoring unavailable: %s", e)
            return None

    async def stop(self) -> None:
        self._stopping.set()
        for server in self.servers.values():
            await server.stop()
        if self.admission is not None:
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
        if self.pods is not None:
            with contextlib.suppress(Exception):
                await self.pods.close()  # the pod cache's watch and the Event recorder
        await self.pod_resources.close()
        if self.ledger is not None:
            await self.state.save(self.ledger)
        if self.health is not None:
            await asyncio.to_thread(self.health.close)
        if self.node_labels is not None:
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
            assert self.ledger is not None  # the loop starts after the ledger is built
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
                    self.events,
                    self.config.node_name,
                    events.NORMAL if h.healthy else events.WARNING,
                    events.REASON_GPU_HEALTHY if h.healthy else events.REASON_GPU_UNHEALTHY,
                    text,
                )
        if changed and self.started.is_set() and self.node_labels is not None:
            self.node_labels.refresh()  # gpufrac.dev/gpu.healthy follows

    async def _health_loop(self) -> None:
        health = self.health
        assert health is not None
        interval = self.config.health.poll_interval
        while True:
            # The wait ends at once on an XID; otherwise after the poll interval (loss checks),
            # or sooner when an XID's recovery window closes and the GPU may be Healthy again.
            wait = interval
            recovery = health.next_change_in()
            if recovery is not None:
                wait = min(wait, recovery)
            try:
                changes = await asyncio.to_thread(health.poll, max(10, int(wait * 1000)))
            except Exception as e:
                log.error("health poll failed: %s", e)
                await asyncio.sleep(interval)
                continue
            if changes or changes is None:  # the ledger already holds an unchanged health
                self._apply_health(health.current())

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
                ErrorKind.NODE_FAILURE, f"cannot create container directory {alloc.directory}: {e}"
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
        assert self.admission is not None  # built in start(), before the device-plugin servers
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
                ErrorKind.STATE_CONFLICT,
                f"PreStartContainer: {resource} devices {ids[:6]}{'…' if len(ids) > 6 else ''} were never "
                "allocated by this agent",
            )
        if alloc.recorded_at is None:
            alloc.recorded_at = time.monotonic()  # the kubelet records an allocation before any start
        self._kick_identity()
        assert self.admission is not None
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
        """Pod identity for new and changed containers (gpufrac.agent.pods), from the last
        pod-resources listing."""
        if self.pods is None:
            return  # not built yet: start() builds it after recovery
        try:
            await self.pods.resolve(self.listing)
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
    # `gpufrac agent` (gpufrac.agent.cli) does not define the timing knobs: defaults then.
    interval: float | None = getattr(args, "reconcile_interval", None)
    grace: float | None = getattr(args, "release_grace", None)
    agent = Agent(
        cfg,
        reconcile_interval=interval or RECONCILE_INTERVAL,
        release_grace=RELEASE_GRACE if grace is None else grace,
    )
    try:
        eventloop.run(agent.run())
    except NvmlError as e:
        log.error("%s", e)
        return 1
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
