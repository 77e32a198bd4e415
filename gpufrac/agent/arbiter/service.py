"""The arbiter: burst grants for the memguard shim's slow path (docs/arbiter-protocol.md).

A request acts only for the caller's own container, which comes from SO_PEERCRED -> cgroup ->
pod (gpufrac.agent.processes.callers), never from the message. This class decides; its parts each do
one job: the socket (server), the grant arithmetic (grants, pure), the order of requests on a
GPU (queue), the NVML cache (readings), the containers' files (usage), the resolvers that free
memory (chain, run by the context), restarts (recovery). A burst is granted only if the grant
model says the GPU has the bytes and nobody ranks ahead; it is published in the container's
config (ledger.update_config) before the reply.

Runs entirely on the agent's event loop; NVML reads and kills go to worker threads.

What the resolvers, swap and admission share with it (what each container holds, grants,
the queue, kills) is the resolution context (arbiter/context.py), built here over the same
parts; the requests here decide on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Coroutine
from typing import Any, Protocol

from gpufrac.agent.arbiter import grants, recovery
from gpufrac.agent.arbiter import sweep as grant_sweep
from gpufrac.agent.arbiter.admission import reclaim_guarantee
from gpufrac.agent.arbiter.context import ArbiterEvents, Resolution
from gpufrac.agent.arbiter.fairness import Fairness, LimitMetrics
from gpufrac.agent.arbiter.listeners import ContainerSockets
from gpufrac.agent.arbiter.queue import LAST, WaitQueue
from gpufrac.agent.arbiter.readings import NVML_FRESH, NVML_STALE, DriverReadings, ReadMemory, ReadProcesses
from gpufrac.agent.arbiter.resolvers import Chain, Need, ResolverMetrics
from gpufrac.agent.arbiter.server import RefusalLog, RequestMetrics, Result, SocketServer, Stats
from gpufrac.agent.arbiter.swap.resolver import SwapMetrics, handle_swap_in
from gpufrac.agent.arbiter.usage import ContainerFiles
from gpufrac.agent.booking.ledger import ContainerAlloc, Ledger
from gpufrac.agent.gpu import activity as activity_mod
from gpufrac.agent.gpu import truth
from gpufrac.agent.gpu.inventory import read_memory
from gpufrac.agent.gpu.processes import observe
from gpufrac.agent.processes.callers import Caller, PeerError, PeerLookup
from gpufrac.core.config import Config
from gpufrac.core.units import format_bytes
from gpufrac.memguard import wire
from gpufrac.memguard.abi import FLAG_DISABLED
from gpufrac.memguard.wire import BurstRequest

log = logging.getLogger(__name__)

# The readings one container's RECLAIMs force are at least this far apart (Arbiter._reclaim_reading_at).
RECLAIM_SPACING = 0.1


class ArbiterMetrics(RequestMetrics, LimitMetrics, ResolverMetrics, SwapMetrics, Protocol):
    """What the arbiter and its resolvers count (gpufrac.agent.metrics.Metrics)."""


class Arbiter:
    """Burst grants on one node. Collaborators: the ledger, who callers are (`peers`), where
    Events go (`events`, None: log only), what is counted (`metrics`), and the two NVML reads
    (`memory`, `processes`: blocking, run in a worker thread)."""

    def __init__(
        self,
        config: Config,
        ledger: Ledger,
        peers: PeerLookup,
        socket_path: str,
        *,
        events: ArbiterEvents | None = None,
        metrics: ArbiterMetrics,
        memory: ReadMemory = read_memory,
        processes: ReadProcesses = observe,
        resolvers: Chain | None = None,
        read_timeout: float | None = None,
        activity: activity_mod.DecisionIdle | None = None,
    ) -> None:
        self.config = config
        self.ledger = ledger
        self.peers = peers
        self.socket_path = socket_path
        self.metrics = metrics
        self.read_timeout = read_timeout if read_timeout is not None else config.arbiter_timeout
        self.stats = Stats()
        self.queue = WaitQueue(
            self._refresh_soon, NVML_FRESH, self._wait_timed_out, config.head_of_line_bound
        )
        # One context allowance per pod and GPU (docs/watchdog.md), as the watchdog's.
        self.readings = DriverReadings(
            memory, processes, peers, config.watchdog.tolerance, self.queue.notify_all
        )
        self.files = ContainerFiles(ledger)
        self.sweeper = grants.GrantSweep()
        # What the requests, the resolvers, swap and admission share (and the chains it runs).
        self.resolution = Resolution(
            config,
            ledger,
            peers,
            queue=self.queue,
            readings=self.readings,
            files=self.files,
            sweeper=self.sweeper,
            stats=self.stats,
            metrics=metrics,
            events=events,
            activity=activity,
            resolvers=resolvers,
        )
        self.swap = self.resolution.swap
        self.fairness = Fairness.from_config(config, peers.proc, metrics=metrics)
        self.server = SocketServer(self, socket_path, config.arbiter_limits.listen_backlog)
        # Each container's own socket (its connections share the server's bookkeeping).
        self.sockets = ContainerSockets(self.server, self.fairness, config.arbiter_limits.listen_backlog)
        self._refusals = RefusalLog()
        self._tasks: list[asyncio.Task[None]] = []
        self._reclaim_at: dict[str, float] = {}  # key -> when its last RECLAIM's reading is taken
        self._handles_generation = -1  # the ledger's capacity_generation at the last handle sweep

    # -- lifetime --------------------------------------------------------------------------------

    async def start(self) -> None:
        self.reconcile()
        self.fairness.fit_fd_limit()  # before the first connection: the cap must fit the file limit
        try:
            await self.server.start()
        except OSError as e:  # every container's own socket still serves it
            log.error(
                "arbiter: cannot listen on the node-wide socket %s: %s (the agent's tools and containers "
                "admitted by an older agent cannot ask for bursts)",
                self.socket_path,
                e,
            )
        self.sockets.open_all(self.ledger.containers(), self.ledger.attached)
        self.ledger.add_attach_listener(self.sockets.open)
        self.ledger.add_listener(self._on_ledger_change)
        self._tasks.append(
            asyncio.create_task(
                grant_sweep.sweep_forever(self.sweep, self._sweep_reading), name="arbiter-reclaim"
            )
        )
        log.info(
            "arbiter listening on %d containers' sockets%s (resolvers %s)",
            len(self.sockets.listeners),
            f" and {self.socket_path}" if self.server.listening else "",
            self.resolution.chain.names,
        )

    async def stop(self) -> None:
        self.queue.close()  # a stopping agent grants nothing
        self.sockets.close()
        self.server.close()
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        await self.server.wait_closed()
        self.files.close()
        self.fairness.close()

    def reconcile(self) -> None:
        """After an agent restart: grants above what a container now uses are taken back."""
        recovery.reconcile(self.ledger, self.resolution.used)

    # -- requests --------------------------------------------------------------------------------

    def handle(
        self, req: BurstRequest, sock: socket.socket, expected: str | None = None
    ) -> Result | Coroutine[Any, Any, Result]:
        """A request's answer now, or a coroutine that finds it (waiting, resolvers, swap-in).
        `expected`: the container whose own socket it came on (None: the node-wide socket)."""
        if not wire.well_formed(req):
            return wire.BURST_INVALID, 0
        try:
            caller = self.peers.identify(sock)
            if expected is not None and caller.alloc.key != expected:
                raise PeerError(
                    f"pid {caller.creds.pid} of container {caller.alloc.key} asked on {expected}'s socket"
                )
        except PeerError as e:
            self.stats.refused += 1
            self._refusals.say(str(e))
            return wire.BURST_REFUSED, 0
        if req.op == wire.BURST_OP_IDENTIFY:
            # Its own pid as the kernel named it to us (the host's namespace, NVML's): what
            # lets its shim read the driver's per-process figures exactly in a pid namespace.
            return wire.BURST_GRANTED, caller.creds.pid
        if req.op == wire.BURST_OP_RELEASE:
            return wire.BURST_GRANTED, self.resolution.release(caller.alloc)
        if req.op == wire.BURST_OP_SWAP_IN:
            return self._swap_in(caller)
        if req.op == wire.BURST_OP_RECLAIM:
            return self._reclaim(caller, int(req.bytes), int(req.total_after))
        return self._burst(caller, int(req.bytes), int(req.total_after))

    def _burst(self, caller: Caller, nbytes: int, total_after: int) -> Result | Coroutine[Any, Any, Result]:
        alloc = caller.alloc
        cfg = alloc.config
        if nbytes <= 0 or alloc.whole_gpu or cfg.flags & FLAG_DISABLED:
            self.stats.denied += 1
            return wire.BURST_DENIED, 0
        used = self.resolution.used(alloc)
        if used is None:
            self.stats.denied += 1
            return wire.BURST_DENIED, 0
        want = max(total_after, used + nbytes)
        if want > cfg.limit_bytes:
            self.stats.denied += 1
            log.debug(
                "%s: %s would pass the limit %s",
                alloc.who(),
                format_bytes(want),
                format_bytes(cfg.limit_bytes),
            )
            return wire.BURST_DENIED, 0
        target = grants.burst_target(want, alloc.request_bytes)
        if target <= cfg.grant_bytes:
            self.stats.granted += 1  # already granted (the shim raced a config update)
            return wire.BURST_GRANTED, self.files.generation(alloc)
        if self.readings.ready():
            return self._burst_decide(alloc, target, used)  # the common case: no task
        return self._burst_after_reading(caller, nbytes, total_after)

    async def _burst_after_reading(self, caller: Caller, nbytes: int, total_after: int) -> Result:
        await self.readings.fresh()
        # Again with the fresh reading: the driver's count of the caller may have been stale.
        out = self._burst(caller, nbytes, total_after)
        while not isinstance(out, tuple):
            out = await out
        return out

    def _burst_decide(
        self, alloc: ContainerAlloc, target: int, used: int
    ) -> Result | Coroutine[Any, Any, Result]:
        """Granted now if the GPU has the bytes and nobody ranks ahead (a waiter of equal or
        higher priority, a claim); otherwise the wait and the resolvers, as a coroutine."""
        # The common case first, without building a Need: nobody waits ahead and it fits.
        if not self.queue.ahead(alloc.gpus[0], (-alloc.config.priority, LAST)) and self.resolution.grant(
            alloc, target
        ):
            return wire.BURST_GRANTED, self.files.generation(alloc)
        return self._burst_resolve(self.resolution.burst_need(alloc, target, used))

    async def _burst_resolve(self, need: Need) -> Result:
        """Wait for memory or have the resolvers free it, until the caller's wait timeout."""
        alloc = need.requester
        if await self.resolution.resolve_until(need):
            return wire.BURST_GRANTED, self.files.generation(alloc)
        self.stats.denied += 1
        log.info(
            "denied %s of burst to %s on GPU %s (%s%s)",
            format_bytes(need.bytes),
            alloc.who(),
            need.gpu,
            "; ".join(need.notes) or "no resolver freed enough",
            self.resolution.hidden_note(need.gpu),
        )
        return wire.BURST_DENIED, 0

    async def _reclaim(self, caller: Caller, nbytes: int, total_after: int) -> Result:
        """The driver refused `nbytes` within the caller's request: others' bursts hold its guarantee.
        Take it back as at admission, bounded by the container's wait timeout."""
        alloc = caller.alloc
        cfg = alloc.config
        if nbytes <= 0 or alloc.whole_gpu or cfg.flags & FLAG_DISABLED:
            self.stats.denied += 1
            return wire.BURST_DENIED, 0
        deadline = asyncio.get_running_loop().time() + cfg.wait_timeout_ms / 1000.0
        # Refused on the caller's own word first (the message, its own file, clamped): that
        # costs nothing and needs no reading.
        file_used = self.files.file_used(alloc)
        if file_used is None or max(truth.clamp_file(alloc, file_used), total_after) > alloc.request_bytes:
            self.stats.denied += 1
            return wire.BURST_DENIED, 0
        # The driver just failed it: a reading taken before may predate the burst that holds
        # its memory. One taken since, shared with every other request that needs one.
        await self.readings.taken_since(self._reclaim_reading_at(alloc.key))
        # This only decides whether to look: its count here is less the allowance (what the
        # driver counts and the shim cannot see: lazily loaded modules), so a container filling
        # its request is not refused for them. What it may take is guarantee_shortfall's, on
        # its whole count: never more than the part of its request that is really missing.
        used, driver = self.resolution.used(alloc), self.resolution.driver_used(alloc)
        if (
            used is None
            # Without the driver's count only the tenant's file would say what it holds, and a
            # reclaim takes from others: refused.
            or driver is None
            # Past the guarantee: BURST rules apply. The file counts the refused bytes already;
            # the driver's count does not, and a tenant cannot lower it.
            or max(used, total_after, driver + nbytes) > alloc.request_bytes
        ):
            if driver is None:
                log.info(
                    "could not reclaim the guarantee of %s on GPU %s (no NVML memory reading)",
                    alloc.who(),
                    alloc.gpus[0],
                )
            self.stats.denied += 1
            return wire.BURST_DENIED, 0
        left = await reclaim_guarantee(self.resolution, alloc, alloc.gpus[0], deadline, nbytes)
        if left == 0:
            self.stats.granted += 1
            return wire.BURST_GRANTED, self.files.generation(alloc)
        self.stats.denied += 1
        log.info(
            "could not reclaim the guarantee of %s on GPU %s (%s)",
            alloc.who(),
            alloc.gpus[0],
            "no NVML memory reading"
            if left is None
            else f"{format_bytes(left)} missing" + self.resolution.hidden_note(alloc.gpus[0]),
        )
        return wire.BURST_DENIED, 0

    def _reclaim_reading_at(self, key: str) -> float:
        """When the reading a container's RECLAIM decides on must have been taken: after the
        request came, and at least RECLAIM_SPACING after the one its previous RECLAIM needed
        (or that same one, if it has not been taken yet). However many a container sends, the
        readings they force are so at most 1/RECLAIM_SPACING a second; a neighbour's RECLAIM
        is not held to it. A legitimate shim sends one after each allocation the driver refused."""
        at = time.monotonic()
        last = self._reclaim_at.get(key)
        if last is not None and at <= last:
            at = last
        elif last is not None and at < last + RECLAIM_SPACING:
            at = last + RECLAIM_SPACING
        self._reclaim_at[key] = at
        return at

    def _wait_timed_out(self) -> None:
        self.stats.wait_timeouts += 1

    def _refresh_soon(self) -> None:
        """Start a new NVML reading now unless one is under way; it notifies waiters when done."""
        self.readings.refresh_soon()

    async def grantable(self, alloc: ContainerAlloc) -> int:
        """Bytes a burst of `alloc` could be granted right now (metrics, tests, the bench)."""
        await self.readings.fresh()
        return self.resolution.free_for(alloc)

    # -- swap (arbiter.swap.resolver: the SWAP_IN op and what the swap resolver asks) ------------------------

    async def _swap_in(self, caller: Caller) -> Result:
        status = await handle_swap_in(self.swap, caller.alloc)
        return status, self.files.generation(caller.alloc)

    # -- the ledger -------------------------------------------------------------------------------

    def _on_ledger_change(self) -> None:
        # Containers come and go only with a booking change (capacity_generation); a grant or
        # a limit (every burst) changes a config and needs no sweep of the handles kept here.
        if self.ledger.capacity_generation != self._handles_generation:
            self._handles_generation = self.ledger.capacity_generation
            self.files.forget_released(self.sweeper.forget)
            self.sockets.sync(self.ledger.get)
            booked = self.ledger.get
            for key in [k for k in self.resolution.granted_at if booked(k) is None]:
                del self.resolution.granted_at[key]
            for key in [k for k in self._reclaim_at if booked(k) is None]:
                del self._reclaim_at[key]
        self.queue.notify_all()

    # -- the grant sweep (gpufrac.agent.arbiter.sweep) -------------------------------------------

    def sweep(self, now: float | None = None) -> None:
        """Take back returned grants at once and stale ones after GRANT_STALE_AFTER."""
        now = time.monotonic() if now is None else now
        grant_sweep.sweep(
            self.ledger.containers(),
            self.files.usage_of,
            self.readings.driver_total,
            self.resolution.release,
            self.sweeper,
            now,
        )

    async def _sweep_reading(self) -> None:
        """Before a sweep, while any grant is out: a driver reading recent enough that the
        sweep judges grants on the driver's count, not on their holders' files."""
        if any(a.config.grant_bytes > 0 for a in self.ledger.containers()):
            # Bounded: a driver that hangs must not stop the sweep (it then judges on the files).
            with contextlib.suppress(asyncio.TimeoutError):
                reading = self.readings.taken_since(time.monotonic() - grant_sweep.READING_AGE)
                await asyncio.wait_for(reading, NVML_STALE)
