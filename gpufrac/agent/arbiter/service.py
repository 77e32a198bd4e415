"""The arbiter: burst grants for the memguard shim's slow path (docs/arbiter-protocol.md).

A request acts only for the caller's own container, which comes from SO_PEERCRED -> cgroup ->
pod (gpufrac.agent.callers), never from the message. This class decides; its parts each do
one job: the socket (server), the grant arithmetic (grants, pure), the order of requests on a
GPU (queue), the NVML cache (readings), the containers' files (usage), the resolvers that free
memory (chain), restarts (recovery). A burst is granted only if the grant model says the GPU
has the bytes and nobody ranks ahead; it is published in the container's config
(ledger.update_config) before the reply.

Runs entirely on the agent's event loop; NVML reads and kills go to worker threads.

Over 500 lines as one class: it is the one object the resolvers, the swap resolver and
admission's reclaim talk to (ResolverContext, SwapHost), and each of their entry points here
is a few lines over the parts above.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import socket
import time
from collections.abc import Coroutine
from contextlib import AbstractContextManager
from typing import Any, Protocol

from gpufrac.agent import activity as activity_mod
from gpufrac.agent import kill, truth
from gpufrac.agent import swap as swap_mod
from gpufrac.agent.admission import reclaim_guarantee
from gpufrac.agent.arbiter import grants, recovery
from gpufrac.agent.arbiter import sweep as grant_sweep
from gpufrac.agent.arbiter.chain import build_chain
from gpufrac.agent.arbiter.listeners import ContainerSockets
from gpufrac.agent.arbiter.queue import LAST, WaitQueue
from gpufrac.agent.arbiter.readings import NVML_FRESH, NVML_STALE, DriverReadings, ReadMemory, ReadProcesses
from gpufrac.agent.arbiter.server import RefusalLog, RequestMetrics, Result, SocketServer, Stats
from gpufrac.agent.arbiter.usage import ContainerFiles
from gpufrac.agent.callers import AgentOutOfResources, Caller, PeerError, PeerLookup
from gpufrac.agent.events import container_ref
from gpufrac.agent.fairness import Fairness, LimitMetrics
from gpufrac.agent.gpu_processes import observe
from gpufrac.agent.inventory import read_memory
from gpufrac.agent.kube import ObjectRef
from gpufrac.agent.ledger import ContainerAlloc, Ledger
from gpufrac.agent.resolvers import Chain, Holding, Need, ResolverMetrics, guarantee_chain
from gpufrac.agent.swap import SwapMetrics
from gpufrac.core.config import Config
from gpufrac.core.units import format_bytes
from gpufrac.memguard import wire
from gpufrac.memguard.abi import FLAG_DISABLED
from gpufrac.memguard.wire import BurstRequest

log = logging.getLogger(__name__)

# The readings one container's RECLAIMs force are at least this far apart (Arbiter._reclaim_reading_at).
RECLAIM_SPACING = 0.1


class EventSink(Protocol):
    """Where the arbiter's Kubernetes Events and pod conditions go
    (gpufrac.agent.kube.EventRecorder)."""

    def record(self, ref: ObjectRef, type_: str, reason: str, message: str) -> None: ...
    def disruption(self, ref: ObjectRef, reason: str, message: str) -> None: ...


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
        events: EventSink | None = None,
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
        self.events = events
        self.metrics = metrics
        self.evict_idle_threshold = config.evict_idle_threshold
        # The agent's activity tracker: how idle a swap or evict victim is (the driver's word
        # where it can be had, not the tenant's stamps); None: the usage file, clamped to now.
        self.activity = activity
        self.read_timeout = read_timeout if read_timeout is not None else config.arbiter_timeout
        self.stats = Stats()
        self.queue = WaitQueue(
            self._refresh_soon, NVML_FRESH, self._wait_timed_out, config.head_of_line_bound
        )
        # One context allowance per container (docs/watchdog.md), as the watchdog's.
        self.readings = DriverReadings(
            memory, processes, peers, config.watchdog.tolerance, self.queue.notify_all
        )
        self.files = ContainerFiles(ledger)
        self.sweeper = grants.GrantSweep()
        self.chain = resolvers if resolvers is not None else build_chain(config.resolvers, self)
        # A guarantee is reclaimed with an evict step even where `resolvers` leaves it out.
        self.guarantee_chain = guarantee_chain(self.chain, self)
        # The swap resolver: the chain's when configured, else one that only brings back what
        # an earlier agent swapped out. Its containers' memory is in host RAM, not on the GPU.
        self.swap = swap_mod.restorer(self.chain, self)
        self.fairness = Fairness.from_config(config, peers.proc, metrics=metrics)
        self.server = SocketServer(self, socket_path, config.arbiter_limits.listen_backlog)
        # Each container's own socket (its connections share the server's bookkeeping).
        self.sockets = ContainerSockets(self.server, self.fairness, config.arbiter_limits.listen_backlog)
        self._refusals = RefusalLog()
        self._seq = itertools.count(1)
        self._tasks: list[asyncio.Task[None]] = []
        self._granted_at: dict[str, float] = {}  # container key -> time.monotonic() of its last grant
        self._settling: set[str] = set()  # keys whose lowered release waits out GRANT_SETTLE
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
            self.chain.names,
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
        recovery.reconcile(self.ledger, self._used)

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
            return wire.BURST_GRANTED, self._release(caller.alloc)
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
        used = self._used(alloc)
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
        if not self.queue.ahead(alloc.gpus[0], (-alloc.config.priority, LAST)) and self._grant(alloc, target):
            return wire.BURST_GRANTED, self.files.generation(alloc)
        deadline = asyncio.get_running_loop().time() + alloc.config.wait_timeout_ms / 1000.0
        need = Need(
            requester=alloc,
            gpu=alloc.gpus[0],
            bytes=target - self._burst_held(alloc, used),
            priority=alloc.config.priority,
            deadline=deadline,
            kind="burst",
            try_grant=lambda: False,
            shortfall=lambda: 0,
            seq=self.next_seq(),
        )
        need.try_grant = lambda: self._try_grant(need, target)
        need.shortfall = lambda: self.coverable(
            need.gpu, target - self._burst_held(alloc) - self._free_for(alloc)
        )
        return self._burst_resolve(need)

    async def _burst_resolve(self, need: Need) -> Result:
        """Wait for memory or have the resolvers free it, until the caller's wait timeout."""
        alloc = need.requester
        # The shim stops listening after its wait timeout: answer by then, whatever a resolver does.
        left = need.deadline - asyncio.get_running_loop().time()
        try:
            ok = await asyncio.wait_for(self.chain.resolve(need), max(0.0, left) + 0.05)
        except asyncio.TimeoutError:
            ok = need.granted
        if ok:
            return wire.BURST_GRANTED, self.files.generation(alloc)
        self.stats.denied += 1
        log.info(
            "denied %s of burst to %s on GPU %s (%s%s)",
            format_bytes(need.bytes),
            alloc.who(),
            need.gpu,
            "; ".join(need.notes) or "no resolver freed enough",
            self._hidden_note(need.gpu),
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
        used, driver = self._used(alloc), self.driver_used(alloc)
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
        left = await reclaim_guarantee(self, alloc, alloc.gpus[0], deadline, nbytes)
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
            else f"{format_bytes(left)} missing" + self._hidden_note(alloc.gpus[0]),
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

    # -- grants ----------------------------------------------------------------------------------

    def _try_grant(self, need: Need, target: int) -> bool:
        """A need's grant, unless it asks for burst bytes while a request ranks ahead of it on
        its GPU and still holds it back (WaitQueue.ahead: a waiter, for at most the node's
        headOfLineBound since the need came). It is granted once, whoever tries. No new bytes
        (a swap-in within its guarantee) never queue: a guarantee never waits."""
        asks_more = target > need.requester.config.grant_bytes
        if (
            not need.granted
            and not (asks_more and self.queue.ahead(need.gpu, need.order, need, need.arrived))
            and self._grant(need.requester, target)
        ):
            need.granted = True
        return need.granted

    def _grant(self, alloc: ContainerAlloc, target: int) -> bool:
        """Grant `target` bytes above request to the container if the GPU has them now."""
        if self.ledger.get(alloc.key) is not alloc:
            return False  # released meanwhile
        cur = alloc.config.grant_bytes
        if target > cur:
            extra = target - self._burst_held(alloc)
            if extra > self._free_for(alloc):
                return False
            self.ledger.update_config(alloc.key, grant_bytes=target)
        self.stats.granted += 1
        self.sweeper.used(alloc.key)
        self._granted_at[alloc.key] = time.monotonic()
        return True

    def claim(self, need: Need) -> AbstractContextManager[None]:
        """While a resolver frees memory for `need`, nobody who ranks below it is granted on
        its GPU (gpufrac.agent.arbiter.queue.WaitQueue.claim)."""
        return self.queue.claim(need)

    async def wait_turn(self, need: Need) -> bool:
        """Queue the need on its GPU until a release grants it or its deadline passes."""
        return await self.queue.wait_turn(need)

    def notify(self, gpu: str) -> None:
        """Something was freed on `gpu`: grant waiters in order while they fit."""
        self.queue.notify(gpu)

    def next_seq(self) -> int:
        """The next arrival number (FIFO among equal priorities)."""
        return next(self._seq)

    def _wait_timed_out(self) -> None:
        self.stats.wait_timeouts += 1

    # -- accounting ------------------------------------------------------------------------------

    def driver_used(self, alloc: ContainerAlloc) -> int | None:
        """What NVML counts for the container's processes on its GPU, less one context
        allowance; None without a recent process reading (gpufrac.agent.arbiter.readings)."""
        return self.readings.driver_used(alloc)

    def _used(self, alloc: ContainerAlloc) -> int | None:
        """What the container holds on its GPU: the larger of its usage file (clamped to what
        it was given) and the driver's count (gpufrac.agent.truth). None when the file cannot
        be read. A swapped-out container: the driver's count alone (`_swapped_used`)."""
        swapped = self._swapped_used(alloc)
        if swapped is not None:
            return swapped
        used = self.files.file_used(alloc)
        if used is None:
            return None
        return max(truth.clamp_file(alloc, used), self.driver_used(alloc) or 0)

    def _swapped_used(self, alloc: ContainerAlloc) -> int | None:
        """For a swapped-out container, what NVML counts for its live processes (its
        checkpointed ones hold nothing on the GPU, its file still counts what they had in
        host RAM); None for one that is not swapped out. Never a flat 0: a process it starts
        after the swap-out (without the shim: it asks the agent nothing) holds GPU memory
        that must weigh as any other's, or it could take a neighbour's guarantee and be no
        eviction victim for it."""
        if not self.swap.is_swapped(alloc.key):
            return None
        return self.driver_used(alloc) or 0

    def _held(self, alloc: ContainerAlloc) -> int:
        """`_used`, or, for a container whose usage file cannot be read (the tenant's to
        break), the driver's count, else all it may hold: breaking its own bookkeeping must
        shield it from no reclaim and inflate no one else's shortfall."""
        used = self._used(alloc)
        if used is not None:
            return used
        driver = self.driver_used(alloc)
        return driver if driver is not None else alloc.request_bytes + alloc.config.grant_bytes

    def _share(self, alloc: ContainerAlloc, used: int | None) -> grants.Share:
        return grants.Share(used, alloc.request_bytes, alloc.config.grant_bytes)

    def _burst_held(self, alloc: ContainerAlloc, used: int | None = None) -> int:
        used = self._used(alloc) if used is None else used
        return self._share(alloc, used).burst

    def _on_gpu(self, gpu: str) -> list[ContainerAlloc]:
        return [a for a in self.ledger.containers() if gpu in a.gpus]

    def _free_for(self, alloc: ContainerAlloc) -> int:
        """Bytes that may be newly granted on the requester's GPU (grants.free_for)."""
        gpu = alloc.gpus[0]
        return grants.free_for(
            [self._share(a, self._used(a)) for a in self._on_gpu(gpu)],
            self.ledger.geometry[gpu].allocatable,
            self.readings.free(gpu),
            self.config.grant_margin,
            self.config.lend_unused_requests,
        )

    def free_for(self, alloc: ContainerAlloc) -> int:
        return self._free_for(alloc)

    def try_grant(self, need: Need, target: int) -> bool:
        return self._try_grant(need, target)

    async def grantable(self, alloc: ContainerAlloc) -> int:
        """Bytes a burst of `alloc` could be granted right now (metrics, tests, the bench)."""
        await self.readings.fresh()
        return self._free_for(alloc)

    def holdings(self, gpu: str) -> list[Holding]:
        now = time.monotonic_ns()
        out = []
        for a in self._on_gpu(gpu):
            u = self.files.usage_of(a)
            used = self._held(a)
            # An unreadable usage file gives no activity either: the container counts as idle.
            last = max((int(s.last_activity_ns) for s in u.slots if s.pid > 0), default=0) if u else 0
            idle_s = activity_mod.holding_idle_s(self.activity, a.key, last, now) if u else float("inf")
            out.append(
                Holding(
                    alloc=a,
                    used=used,
                    request=a.request_bytes,
                    grant=a.config.grant_bytes,
                    burst=self._burst_held(a, used),
                    priority=a.config.priority,
                    flags=a.config.flags,
                    idle_s=idle_s,
                    steady=self.readings.steady_used(a) or 0,
                )
            )
        return out

    def usage_readable(self, alloc: ContainerAlloc) -> bool:
        """Whether the container's usage file can be read now (the swap resolver leaves a
        container whose file is broken out of its victims: its shim could not be told back)."""
        return self.files.file_used(alloc) is not None

    async def second_reading(self) -> None:
        """A new NVML reading, distinct from the last (gpufrac.agent.arbiter.readings)."""
        await self.readings.second_reading()

    def guarantee_shortfall(self, alloc: ContainerAlloc, gpu: str, inflight: int = 0) -> int | None:
        """Bytes of `alloc`'s request on `gpu` that are not physically there now: its request
        less what it uses (less `inflight`, counted but not given by the driver), beyond NVML free
        less the margin less what every other container may still charge within its request +
        grant. None without an NVML reading (used by gpufrac.agent.admission.reclaim_guarantee).
        What each holds lowers what is taken here: it counts NVML's whole count for it, no
        allowance (readings.DriverReadings.whole_count), or a zeroed counter would make the
        shortfall look larger by as much."""
        free = self.readings.free(gpu)
        if free is None:
            return None
        pending = 0
        for a in self._on_gpu(gpu):
            if a.key != alloc.key:
                # Not started yet (nothing held): it may still charge all it was promised.
                held_by = max(self._held(a), self.readings.whole_count(a) or 0)
                pending += grants.pending_of(a.request_bytes, a.config.grant_bytes, held_by)
        # What it holds now: the file less what it counted but the driver refused, or the
        # driver's whole count, whichever is larger: a zeroed counter cannot make its
        # guarantee look missing.
        driver = self.readings.whole_count(alloc) or 0
        file_used = self.files.file_used(alloc) or 0
        held = max(truth.clamp_file(alloc, file_used) - inflight, driver, 0)
        if self.swap.is_swapped(alloc.key):
            held = driver  # what is in host RAM is not on the GPU; what its live processes hold is
        return grants.guarantee_shortfall(alloc.request_bytes, held, free, self.config.grant_margin, pending)

    def coverable(self, gpu: str, missing: int) -> int:
        """What of `missing` bytes on `gpu` evicting or swapping others may free (Need.shortfall):
        none of what hidden processes hold there in the last reading (grants.coverable). The
        requester waits instead: in enforce mode the watchdog kills them within an interval."""
        return grants.coverable(missing, self.readings.hidden_on(gpu))

    def hidden_bytes(self, gpu: str) -> int:
        """What hidden processes hold on `gpu` in the last reading (readings.DriverReadings.hidden_on)."""
        return self.readings.hidden_on(gpu)

    def _hidden_note(self, gpu: str) -> str:
        """For a denial's log line: what hidden processes hold on `gpu`, if anything."""
        hidden = self.hidden_bytes(gpu)
        if not hidden:
            return ""
        return f"; {format_bytes(hidden)} held by hidden GPU processes, never taken from others for it"

    # -- NVML --------------------------------------------------------------------------------------

    async def refresh_memory(self) -> None:
        """A fresh NVML reading now (after a swap or a kill moved memory); waiters are re-checked."""
        await self.readings.refresh()

    def _refresh_soon(self) -> None:
        """Start a new NVML reading now unless one is under way; it notifies waiters when done."""
        self.readings.refresh_soon()

    # -- swap (gpufrac.agent.swap: the SWAP_IN op and what the swap resolver asks) ----------------

    async def _swap_in(self, caller: Caller) -> Result:
        status = await swap_mod.handle_swap_in(self.swap, caller.alloc)
        return status, self.files.generation(caller.alloc)

    # -- releases ----------------------------------------------------------------------------------

    def release_unused(self, alloc: ContainerAlloc) -> None:
        """Take back the part of `alloc`'s grant it does not use (as the shim's release does);
        a reclaim waits on what this frees, so NVML is read again at once."""
        self._release(alloc)
        self._refresh_soon()

    def _release(self, alloc: ContainerAlloc, used: int | None = None) -> int:
        """Take back the part of a container's grant it does not use (`used`, or as `_used`
        counts it); wakes waiters."""
        used = self._used(alloc) if used is None else used
        g = alloc.config.grant_bytes
        if used is not None and g > 0:
            keep = grants.kept_on_release(used, alloc.request_bytes, g)
            young = grants.settle_left(self._granted_at.get(alloc.key), time.monotonic())
            if keep < g and young > 0:
                # Another process's free (or the returned counter) right after a grant: the
                # shim given it may not have charged its allocation yet. Lower it once it has.
                self._settle_later(alloc, young)
            elif keep < g:
                self.ledger.update_config(alloc.key, grant_bytes=keep)
        self.sweeper.used(alloc.key)
        gpu = alloc.gpus[0]
        self.notify(gpu)
        if self.queue.has_waiters(gpu):
            # The freed bytes show in NVML only after a new reading. Without waiters there is no
            # hurry: a reading from before the free under-counts free memory (never grants too
            # much), and the next burst after NVML_FRESH takes a new one. Reading all GPUs on
            # every release would sit on the fast path of the bursts that follow.
            self._refresh_soon()
        return self.files.generation(alloc)

    def _settle_later(self, alloc: ContainerAlloc, delay: float) -> None:
        if alloc.key in self._settling:
            return
        self._settling.add(alloc.key)

        def settled() -> None:
            self._settling.discard(alloc.key)
            if self.ledger.get(alloc.key) is alloc:
                self._release(alloc)

        asyncio.get_running_loop().call_later(delay, settled)

    def revoke_burst(self, alloc: ContainerAlloc) -> None:
        """Evicted or swapped out: the container keeps its guarantee, loses every burst byte.
        Waiters are woken; during a claim (the resolver that revokes it) only once the
        requester has had its turn."""
        if self.ledger.get(alloc.key) is not None and alloc.config.grant_bytes:
            self.ledger.update_config(alloc.key, grant_bytes=0)
        self.notify(alloc.gpus[0])

    def _on_ledger_change(self) -> None:
        # Containers come and go only with a booking change (capacity_generation); a grant or
        # a limit (every burst) changes a config and needs no sweep of the handles kept here.
        if self.ledger.capacity_generation != self._handles_generation:
            self._handles_generation = self.ledger.capacity_generation
            self.files.forget_released(self.sweeper.forget)
            self.sockets.sync(self.ledger.get)
            booked = self.ledger.get
            for key in [k for k in self._granted_at if booked(k) is None]:
                del self._granted_at[key]
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
            self._release,
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

    # -- eviction support ----------------------------------------------------------------------------

    async def kill_container(self, alloc: ContainerAlloc) -> int:
        """SIGKILL every process of the container (gpufrac.agent.kill, in a worker thread);
        returns the count once they are gone. Their dead usage slots are reaped here, since no
        shim of that container may be left to do it."""
        # The processes the driver counts for it go first (gpufrac.agent.kill: a victim
        # whose GPU processes live on was not evicted).
        driver = self.readings.driver
        counted = driver.pids_of(alloc.key) if driver is not None else []
        try:
            killed = await asyncio.to_thread(kill.kill_container, self.peers, alloc, counted)
        finally:
            # Also after a KillFailed: what was killed is reaped and read as free all the same.
            await self._after_kill(alloc)
        return killed

    async def _after_kill(self, alloc: ContainerAlloc) -> None:
        try:
            left = await asyncio.to_thread(self.peers.pids_of, alloc)
        except AgentOutOfResources as e:
            log.error("after killing %s: cannot tell if a process is left (%s): slots kept", alloc.who(), e)
        else:
            if not left:
                self.files.reap_all(alloc)
        await self.readings.refresh()  # the victims' memory is free now: let the grant see it

    def event(self, alloc: ContainerAlloc, type_: str, reason: str, message: str) -> None:
        ref = container_ref(alloc)
        if self.events is not None and ref is not None:
            self.events.record(ref, type_, reason, message)

    def disrupted(self, alloc: ContainerAlloc, reason: str, message: str) -> None:
        """Mark the pod of `alloc` DisruptionTarget (gpufrac.agent.kube.EventRecorder.disruption)."""
        ref = container_ref(alloc)
        if self.events is not None and ref is not None:
            self.events.disruption(ref, reason, message)
