"""The gpufrac node agent: device plugins, the allocation ledger, health, recovery.

One asyncio loop owns all agent state (docs/architecture.md): the ledger, the two
device-plugin servers, the reconciler with the kubelet's pod-resources
(gpufrac.agent.booking.reconcile), the state file (gpufrac.agent.booking.persist) and GPU health
(gpufrac.agent.gpu.healthsync, whose blocking NVML wait runs in a worker thread).

This module is the composition root: Agent.start() builds every part once, in dependency
order, and hands each its collaborators (typed Protocols declared next to the code that
needs them); Agent.stop() stops them in order. Parts that may be missing on a node are
`X | None`, decided here: no apiserver (kube.connect fails) leaves the pod cache, the Event
recorder, the evictor and the node labeler out; no arbiter socket leaves the arbiter out.
No part reaches into the Agent or sets attributes on it. The device-plugin servers are
the front end of the allocation service (gpufrac.agent.booking.allocation_service); in mode
dra the DRA driver (gpufrac.dra.server) is, over the same service, with the claims' parts
(gpufrac.agent.booking.claims, claim_identity, cdi) and the node's ResourceSlice
(gpufrac.agent.gpu.dra_slices): a node is in one mode, never both.

Run it with `gpufrac agent --config node.yaml` or `python -m gpufrac.agent.main`;
tests, the bench and the demo may also run `Agent` in-process (gpufrac.agent.runner).
Over 500 lines: the composition root builds every part of both modes, in order, in one place
on purpose (docs/architecture.md, "How the agent is put together").
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from kubernetes.client import ApiClient

from gpufrac.agent.arbiter.admission import Admission
from gpufrac.agent.arbiter.recovery import adopt_grants, published_grants
from gpufrac.agent.arbiter.service import Arbiter
from gpufrac.agent.booking.allocation_service import AllocationService
from gpufrac.agent.booking.cdi import CdiSpecs
from gpufrac.agent.booking.claim_identity import ClaimIdentity
from gpufrac.agent.booking.claims import ClaimService
from gpufrac.agent.booking.container_dirs import ContainerDirs
from gpufrac.agent.booking.ledger import ContainerAlloc, Ledger
from gpufrac.agent.booking.ledger_store import (
    StateStore,
    read_claim_records,
    restore,
    restore_claim_records,
    write_claim_record,
)
from gpufrac.agent.booking.persist import Persister
from gpufrac.agent.booking.pods import PodIdentity
from gpufrac.agent.booking.reconcile import RECONCILE_INTERVAL, RELEASE_GRACE, ReconcileLoop, Reconciler
from gpufrac.agent.compute import leftover
from gpufrac.agent.compute.loop import ComputeLoop
from gpufrac.agent.gpu import nodelabels
from gpufrac.agent.gpu.activity import ActivityTracker
from gpufrac.agent.gpu.dra_slices import SliceKeeper
from gpufrac.agent.gpu.health import HealthMonitor
from gpufrac.agent.gpu.healthsync import HealthSource, HealthSync
from gpufrac.agent.gpu.inventory import NvmlError, read_inventory
from gpufrac.agent.gpu.nodelabels import NodeLabels
from gpufrac.agent.gpu.utilisation import UtilisationFeed
from gpufrac.agent.idle import reaper as idle
from gpufrac.agent.idle.actions import swap_via
from gpufrac.agent.idle.reaper import IdleReaper
from gpufrac.agent.kube.claims import ClaimReader
from gpufrac.agent.kube.client import KubeConfigError, connect
from gpufrac.agent.kube.evict import PodEvictor
from gpufrac.agent.kube.nodes import NodeLabeler
from gpufrac.agent.kube.podcache import PodCache
from gpufrac.agent.kube.recorder import EventRecorder
from gpufrac.agent.kube.resourceslices import SlicePublisher
from gpufrac.agent.metrics.registry import Metrics
from gpufrac.agent.processes.callers import PeerLookup, namer_from_pods
from gpufrac.agent.status import server as status_mod
from gpufrac.agent.watchdog.service import Watchdog
from gpufrac.core import config as config_mod
from gpufrac.core import eventloop, logs, slices
from gpufrac.core.config import Config, arbiter_socket, dra_plugin_socket, dra_registration_socket
from gpufrac.core.gpus import GpuHealth, Inventory
from gpufrac.deviceplugin.podresources import PodResourcesClient
from gpufrac.deviceplugin.server import DevicePlugin, PluginServer
from gpufrac.dra.server import DraPluginServer

log = logging.getLogger("gpufrac.agent")
# How long start() waits for the apiserver client before it goes on without one.
CONNECT_TIMEOUT = 30.0


class AgentHealth(HealthSource, Protocol):
    """GPU health as the agent holds it (gpufrac.agent.gpu.health.HealthMonitor): followed
    (gpufrac.agent.gpu.healthsync), shown (XID counts, gpufrac status) and closed at stop."""

    def current(self) -> dict[str, GpuHealth]: ...
    def xid_counts(self) -> dict[tuple[str, int], int]: ...
    def close(self) -> None: ...


class Agent:
    """The agent. `inventory` and `health` may be injected (tests); by default they
    come from NVML (gpufrac.agent.gpu.inventory / gpufrac.agent.gpu.health)."""

    def __init__(
        self,
        config: Config,
        *,
        inventory: Inventory | None = None,
        health: AgentHealth | None = None,
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
        self.plugins: dict[str, DevicePlugin] = {}
        # The front ends registered with the kubelet: a device-plugin server per resource, or
        # (mode dra) the DRA driver under its name.
        self.servers: dict[str, PluginServer | DraPluginServer] = {}
        self.started = asyncio.Event()
        self._stopping = asyncio.Event()
        # Container directories: written, deleted and swept in order, off the loop.
        self.dirs = ContainerDirs(config.paths.containers_dir, config.paths.state_dir)
        self._notified_generation = -1
        # Any: the tasks' results, which nothing reads (stop() cancels and awaits them).
        self._tasks: list[asyncio.Task[Any]] = []
        # /metrics, /healthz, /readyz (gpufrac.agent.metrics) and the status socket (gpufrac.agent.status).
        self.metrics = Metrics()
        self.status_server: status_mod.StatusServer | None = None
        # The parts start() builds, in this order (None until then, or where the node lacks
        # what the part needs: the apiserver, the arbiter socket, NVML).
        self.reconciler: Reconciler | None = None  # the ledger against pod-resources
        self.leftovers: leftover.Leftovers | None = None  # what a killed agent's compute shares left
        self.persister: Persister[Ledger] | None = None  # the ledger's state file, batched
        self.health_sync: HealthSync | None = None  # GPU health into ledger, Events, labels
        self.events: EventRecorder | None = None  # Events on pods and the Node (apiserver)
        self.pods: PodIdentity | None = None  # pod identity and each container's policy
        self.reconcile_loop: ReconcileLoop | None = None  # reconciles, then pod identity
        self.arbiter: Arbiter | None = None  # burst grants, on the node-wide socket
        self.watchdog: Watchdog | None = None  # NVML's per-process memory against the limits
        self.utilisation: UtilisationFeed | None = None  # NVML's per-process utilisation, one reader
        self.activity: ActivityTracker | None = None  # per-container GPU activity
        self.compute: ComputeLoop | None = None  # compute shares: launch paces from measured use
        self.reaper: IdleReaper | None = None  # gives the GPU back from idle pods
        self.admission: Admission | None = None  # reclaim at admission
        self.node_labels: NodeLabels | None = None  # gpufrac.dev/ labels on this Node
        self.service: AllocationService | None = None  # the front ends' Backend
        # Mode dra: the claims' bookings, their policies and consumers, the node's ResourceSlice
        # and the DRA driver's servers (None in device-plugin mode, and the slice without an apiserver).
        self.claims: ClaimService | None = None
        self.claim_identity: ClaimIdentity | None = None
        self.slices: SliceKeeper | None = None
        self.slice_publisher: SlicePublisher | None = None
        self.dra: DraPluginServer | None = None

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
        ledger = self.ledger = Ledger(cfg, inventory, retire=self.dirs.discard)
        reconciler = self.reconciler = Reconciler(
            ledger, self.pod_resources, self.dirs, self.metrics, release_grace=self.release_grace
        )
        log.info(
            "agent on %s: %d GPUs, policy %s, memory unit %d bytes, reserved %d bytes per GPU",
            cfg.node_name,
            len(inventory.gpus),
            cfg.allocation_policy,
            cfg.memory_unit,
            cfg.reserved_per_gpu,
        )
        await self._recover(ledger, reconciler)
        # What a killed agent's compute shares left (processes stopped, paces), undone before
        # anything of this one may stop or pace a container, compute shares on or off.
        self.leftovers = leftover.Leftovers(ledger)
        await self.leftovers.undo()
        self._other_mode(ledger)
        persister = self.persister = Persister(ledger, self.state)
        ledger.add_listener(self.leftovers.changed)
        ledger.add_listener(self._on_change)
        ledger.add_listener(persister.changed)
        if self.health is None:
            self.health = await asyncio.to_thread(self._open_health)
        if self.health is not None:
            self.health_sync = HealthSync(self.health, ledger, cfg.node_name, cfg.health.poll_interval)
            self.health_sync.apply()
            self._tasks.append(asyncio.create_task(self.health_sync.run(), name="health"))
        api, no_api = await connecting
        # Pod identity and Events: on the apiserver, or without it (limits stay at the request).
        pod_cache: PodCache | None = None
        if api is not None:
            pod_cache = PodCache(api, cfg.node_name)
            pod_cache.start()
            self.events = EventRecorder(api, cfg.node_name)
        else:
            log.error("pod annotations unavailable, every container keeps limit = request: %s", no_api)
        if self.health_sync is not None:
            self.health_sync.post_to(self.events)
        self.pods = PodIdentity(cfg, ledger, pod_cache, self.events, self.pod_resources, metrics=self.metrics)
        self.reconcile_loop = ReconcileLoop(
            reconciler, self.pods, self.metrics, interval=self.reconcile_interval
        )
        # The activity tracker first: the arbiter judges swap and evict victims idle by it too.
        # It and compute shares read one feed of the driver's per-process utilisation.
        self.utilisation = await self._open_utilisation()
        self.activity = await self._open_activity(self.utilisation)
        await self._start_arbiter(ledger, pod_cache, self.activity)  # before any container can ask
        self._start_watchdog(ledger, pod_cache)
        if cfg.mode == "dra":
            # Claims' policies come from their parameters, device-plugin containers' from their
            # pods: the reaper and compute shares ask both through this one.
            self.claim_identity = ClaimIdentity(
                cfg, ledger, pod_cache, self.events, metrics=self.metrics, fallback=self.pods
            )
        identity = self.claim_identity or self.pods
        self._start_compute(ledger, identity, pod_cache, self.utilisation)
        reaper = self._open_reaper(ledger, identity, self.activity, api, no_api)
        self.admission = Admission(self.arbiter.resolution if self.arbiter else None, ledger, self.events)
        if api is None:
            log.error("node labels unavailable: %s", no_api)
        labeler = NodeLabeler(api, cfg.node_name, nodelabels.OWNED) if api is not None else None
        self.node_labels = NodeLabels(cfg, inventory, ledger.healthy, labeler)
        if self.claim_identity is not None:
            self.claims = await self._open_claims(ledger, inventory, persister, self.claim_identity, api)
        self.service = AllocationService(
            cfg,
            ledger,
            inventory,
            reconciler,
            self.dirs,
            self.admission,
            self.reconcile_loop,
            claims=self.claims,
        )
        if self.claims is not None:  # mode dra: the DRA driver is the front end, no device plugin
            self.dra = DraPluginServer(
                self.service,
                driver_name=cfg.dra.driver_name,
                plugin_socket=dra_plugin_socket(cfg),
                registration_socket=dra_registration_socket(cfg),
            )
            self.servers[cfg.dra.driver_name] = self.dra
            await self.dra.start()
            self._tasks.append(
                asyncio.create_task(self.claims.run_checks(cfg.dra.claim_check_interval), name="claim-check")
            )
        else:
            for resource in slices.RESOURCES:
                plugin = self.plugins[resource] = DevicePlugin(resource, self.service)
                server = self.servers[resource] = PluginServer(plugin, cfg.paths.device_plugin_dir)
                await server.start()
        self._tasks.append(asyncio.create_task(persister.run(), name="persist"))
        self._tasks.append(asyncio.create_task(self.reconcile_loop.run(), name="reconcile"))
        if reaper is not None:
            self._tasks.append(asyncio.create_task(self._idle_loop(reaper), name="idle"))
        if self.health_sync is not None:
            self.health_sync.publish_to(self.node_labels)  # from here on, labels follow health
        self.node_labels.refresh()
        self.started.set()

    async def _open_claims(
        self,
        ledger: Ledger,
        inventory: Inventory,
        persister: Persister[Ledger],
        identity: ClaimIdentity,
        api: ApiClient | None,
    ) -> ClaimService:
        """Mode dra: the node's ResourceSlice (published on the apiserver), the CDI specs and
        the claim service, its bookings' specs brought in line with the ledger restored."""
        cfg = self.config
        if api is not None:
            self.slice_publisher = SlicePublisher(
                api, cfg.node_name, cfg.dra.driver_name, check_interval=cfg.dra.slice_check_interval
            )
            publisher: SlicePublisher | None = self.slice_publisher
        else:
            log.error("DRA driver: no apiserver, so no ResourceSlice and no claim can be read")
            publisher = None
        keeper = SliceKeeper(
            inventory,
            ledger.geometry,
            ledger,
            publisher if publisher is not None else _NoPublisher(),
            node=cfg.node_name,
            driver=cfg.dra.driver_name,
        )
        if publisher is not None:
            self.slices = keeper
            keeper.refresh()
        specs = CdiSpecs(
            cfg.dra.cdi_spec_dir,
            cfg.dra.driver_name,
            shim_host_path=cfg.paths.shim_host_path,
            container_dir=cfg.paths.container_dir,
            nvidia_cdi=cfg.device_list_strategy == "cdi",
        )
        service = ClaimService(
            ledger,
            inventory,
            ClaimReader(api) if api is not None else _NoClaims(),
            self.dirs,
            specs,
            _ClaimRecords(),
            persister,
            identity,
            self.admission or Admission(None, ledger, None),
            self.metrics,
            driver=cfg.dra.driver_name,
            pool=cfg.node_name,
            device_names=keeper.device_names(),
        )
        await service.recover()
        return service

    async def _connect(self) -> tuple[ApiClient | None, str]:
        """The agent's one apiserver client, or None and why not (the node runs without one).
        Bounded: a kubeconfig's exec plugin that hangs must not keep the device plugins from
        registering (containers are then admitted with limit = request, as without one)."""
        try:
            api = connect(self.config.api_server, self.config.kubeconfig)
            return await asyncio.wait_for(api, CONNECT_TIMEOUT), ""
        except KubeConfigError as e:
            return None, str(e)
        except asyncio.TimeoutError:  # TimeoutError itself from Python 3.11 on
            return (
                None,
                f"no apiserver client within {CONNECT_TIMEOUT:g} s (a kubeconfig exec plugin hanging?)",
            )

    async def _start_arbiter(
        self, ledger: Ledger, pod_cache: PodCache | None, activity: ActivityTracker | None
    ) -> None:
        """The burst arbiter: each container's own socket (gpufrac.agent.arbiter.listeners)
        and the node-wide one (the agent's tools, containers an older agent admitted). Its
        callers are named through the pod cache."""
        path = arbiter_socket(self.config)
        arbiter = Arbiter(
            self.config,
            ledger,
            PeerLookup(ledger, namer_from_pods(pod_cache)),
            path,
            events=self.events,
            metrics=self.metrics,
            activity=activity,
        )
        try:
            await arbiter.start()
        except OSError as e:  # the shim then refuses bursts: safe, and the rest still works
            log.error("burst arbiter unavailable: %s", e)
            return
        self.arbiter = arbiter
        self._kick_identity()  # callers are identified through the pod cache: fill it now
        # Checkpoint API detection (blocking, in a thread) and takeover of containers a
        # previous agent swapped out, whether or not this agent's resolvers name swap (they
        # must come back); bursts do not wait for it.
        self._tasks.append(asyncio.create_task(arbiter.swap.start(), name="swap-start"))

    def _start_watchdog(self, ledger: Ledger, pod_cache: PodCache | None) -> None:
        """NVML's per-process memory against each container's limit (gpufrac.agent.watchdog.service).
        Containers are told apart as the arbiter tells its callers apart."""
        peers = (
            self.arbiter.peers if self.arbiter is not None else PeerLookup(ledger, namer_from_pods(pod_cache))
        )
        self.watchdog = Watchdog(self.config.watchdog, ledger, peers, self.events, metrics=self.metrics)
        task = self.watchdog.start()
        if task is not None:
            self._tasks.append(task)

    async def _open_utilisation(self) -> UtilisationFeed | None:
        """NVML's per-process utilisation (gpufrac.agent.gpu.utilisation); None, logged, without
        NVML: no compute shares, and activity from the shim's launch counters alone."""
        try:
            return await asyncio.to_thread(UtilisationFeed.open)
        except Exception as e:
            log.warning("NVML unavailable for per-process utilisation (%s): no compute shares, "
                        "activity from the shim's launch counters", e)  # fmt: skip
            return None

    async def _open_activity(self, feed: UtilisationFeed | None) -> ActivityTracker | None:
        """The activity tracker over the utilisation feed (launches alone without it); None,
        logged, when it cannot be had (the rest of the agent goes on without it: no idle
        reaping, victims judged by file)."""
        try:
            return ActivityTracker(nvml=feed.view() if feed is not None else None)
        except Exception:
            log.exception("activity tracker unavailable: no idle reaping, victims judged by their files")
            return None

    def _start_compute(
        self,
        ledger: Ledger,
        pods: PodIdentity | ClaimIdentity,
        pod_cache: PodCache | None,
        feed: UtilisationFeed | None,
    ) -> None:
        """Compute shares (gpufrac.agent.compute): the driver's measured use, through the
        controller, to each container's launch pace. Containers are told apart as the arbiter
        tells its callers apart."""
        if not self.config.compute.enabled:
            log.info("compute shares are off (compute.enabled: false)")
            return
        if feed is None:
            log.error("compute shares unavailable: no per-process utilisation from NVML")
            return
        peers = (
            self.arbiter.peers if self.arbiter is not None else PeerLookup(ledger, namer_from_pods(pod_cache))
        )
        self.compute = ComputeLoop(self.config, ledger, pods, peers, feed, self.events)
        self._tasks.append(asyncio.create_task(self.compute.run(), name="compute"))

    def _open_reaper(
        self,
        ledger: Ledger,
        pods: PodIdentity | ClaimIdentity,
        tracker: ActivityTracker | None,
        api: ApiClient | None,
        no_api: str,
    ) -> IdleReaper | None:
        """The idle reaper over the activity tracker; None without a tracker."""
        cfg = self.config
        if tracker is None:
            return None
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
            swapper=lambda alloc, reason: swap_via(self.arbiter, alloc, reason),
            metrics=self.metrics,
        )
        return self.reaper

    async def _idle_loop(self, reaper: IdleReaper) -> None:
        """Activity tracking and idle reaping, every idle.interval (gpufrac.agent.idle.reaper)."""
        if self.config.idle.enabled:
            log.info("%s", idle.describe(self.config))
        try:
            await reaper.run()
        except Exception:  # the rest of the agent goes on without it
            log.exception("idle reaper stopped")

    def _open_health(self) -> AgentHealth | None:
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
        if self.claims is not None:
            self.claims.log_summary()
        if self.admission is not None:
            await self.admission.stop()
        if self.arbiter is not None:
            await self.arbiter.stop()  # waiters are answered (denied), the socket removed
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self.reconcile_loop is not None:
            self.reconcile_loop.close()
        if self.claim_identity is not None:
            await self.claim_identity.close()
        if self.slice_publisher is not None:
            await self.slice_publisher.close()  # the slice stays: prepared claims live on
        if self.pods is not None:
            with contextlib.suppress(Exception):
                await self.pods.close()  # the pod cache's watch and the Event recorder
        await self.pod_resources.close()
        if self.ledger is not None:
            await self.state.save(self.ledger)
        if self.compute is not None:  # its paces lifted: no one is held back by a stopped agent
            await self.compute.close()
        if self.activity is not None:  # after the arbiter and the reaper, which read it
            await asyncio.to_thread(self.activity.close)
        if self.utilisation is not None:  # after its readers
            await asyncio.to_thread(self.utilisation.close)
        if self.health is not None:
            await asyncio.to_thread(self.health.close)
        if self.node_labels is not None:
            await self.node_labels.close()
        if self.status_server is not None:
            await self.status_server.stop()
        await self.metrics.stop()
        await self.dirs.close()  # queued deletions finish

    def request_stop(self) -> None:
        """Have run() or serve() stop the agent (call on its loop)."""
        self._stopping.set()

    async def serve(self, started: Callable[[], None]) -> None:
        """Start, call `started` (also when starting failed), serve until request_stop(),
        then stop (gpufrac.agent.runner.AgentThread, on its own loop)."""
        self._stopping = asyncio.Event()
        try:
            await self.start()
        finally:
            started()
        await self._stopping.wait()
        await self.stop()

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

    async def _recover(self, ledger: Ledger, reconciler: Reconciler) -> None:
        """Rebuild the ledger: persisted state, reconciled with what the kubelet says."""
        entries = await asyncio.to_thread(self.state.load)
        restored = restore(ledger, entries or [])
        if restored:
            log.info("state: %d allocations restored from %s", len(restored), self.state.path)
        # DRA claims prepared after the last state save: their records, in their directories.
        records = await asyncio.to_thread(read_claim_records, self.config.paths.containers_dir)
        late = restore_claim_records(ledger, records)
        if late:
            log.info("state: %d claims restored from their directories' records", len(late))
        answered = await reconciler.reconcile(grace=0.0, materialize=False)
        if not answered:
            log.warning(
                "pod-resources (%s) not reachable at start: keeping %d persisted allocations and every "
                "container directory until it answers",
                self.config.paths.pod_resources_socket,
                len(ledger.containers()),
            )
        # Grants published after the last state save must survive rewriting the config files.
        booked = [(a.key, a.directory, a.config.gpu_uuid, a.request_bytes) for a in ledger.containers()]
        adopt_grants(ledger, await asyncio.to_thread(published_grants, booked))
        await reconciler.materialize_all()
        if answered:
            # Only what the kubelet's answer leaves unbooked is an orphan. Without an answer the
            # ledger may lack live containers (a lost state file): their directories hold the
            # files their shims have mapped, their arbiter sockets and swap records, and they are
            # adopted from the first answer (the reconcile loop sweeps only after one, too).
            await reconciler.sweep_orphans()
        await self.state.save(ledger)

    def _other_mode(self, ledger: Ledger) -> None:
        """Say so when the state holds bookings of the other mode (a node whose mode changed
        before it was drained): they are kept, so no GPU memory is booked twice, and the
        front end of this mode cannot release them."""
        dra = self.config.mode == "dra"
        other = [a for a in ledger.containers() if (a.claim is None) == dra]
        if other:
            log.warning(
                "%d bookings of %s are in the state of this node in mode %s: their memory stays booked "
                '(never twice); drain a node before changing its mode (README.md, "DRA mode")',
                len(other),
                "device-plugin containers" if dra else "DRA claims",
                self.config.mode,
            )

    # -- change propagation -------------------------------------------------------------

    def _on_change(self) -> None:
        assert self.ledger is not None
        # Only bookings and health change the device lists; identity, limits and grants
        # change configs, which the state file follows (gpufrac.agent.booking.persist) but
        # ListAndWatch need not resend.
        if self.ledger.capacity_generation != self._notified_generation:
            self._notified_generation = self.ledger.capacity_generation
            for plugin in self.plugins.values():
                plugin.notify()
            if self.dra is not None:
                self.dra.notify()  # the health stream: device health may have changed
            if self.slices is not None:
                self.slices.refresh()  # the ResourceSlice: an unhealthy GPU is tainted

    # -- pod identity hook -----------------------------------------------------------------

    def _kick_identity(self) -> None:
        """Resolve pod identity soon, without delaying the kubelet's call."""
        assert self.reconcile_loop is not None  # built with the pod identity, before any caller
        self.reconcile_loop.kick()


class _ClaimRecords:
    """A claim booking's record in its directory (gpufrac.agent.booking.ledger_store)."""

    def write(self, alloc: ContainerAlloc) -> None:
        write_claim_record(alloc)


class _NoPublisher:
    """Where the slice goes without an apiserver: nowhere (said once at start)."""

    def update(self, body: dict[str, Any]) -> None:
        pass


class _NoClaims:
    """ResourceClaims without an apiserver: none can be read, so none is prepared."""

    async def get(self, namespace: str, name: str) -> dict[str, Any] | None:
        raise KubeConfigError("no apiserver client: the claim cannot be read")


def cmd_agent(args: argparse.Namespace) -> int:
    try:
        cfg = config_mod.load(args.config, overlays=getattr(args, "config_overlay", None) or ())
    except config_mod.ConfigError as e:
        print(f"gpufrac agent: {e}", file=sys.stderr)
        return 2
    logs.setup(cfg)
    # `gpufrac agent` (gpufrac.agent.cli.commands) does not define the timing knobs: defaults then.
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
    parser.add_argument(
        "--config-overlay",
        action="append",
        default=[],
        metavar="PATH",
        help="a node config YAML merged over --config",
    )
    # Timing knobs for tests and the demo (the DaemonSet keeps the defaults).
    parser.add_argument("--reconcile-interval", type=float, help=f"seconds (default {RECONCILE_INTERVAL})")
    parser.add_argument("--release-grace", type=float, help=f"seconds (default {RELEASE_GRACE})")
    return cmd_agent(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
