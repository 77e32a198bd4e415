"""The resolution context: what the arbiter's requests, its resolvers, swap and admission share.

One object, built by the Arbiter from its queue, its driver readings and the containers'
files, and handed to every resolver (ResolverContext), the swap resolver (SwapHost) and
admission's reclaim (GrantView): what each container holds (the larger of its file and the
driver's count), what may be granted on a GPU (the pure grant model, arbiter/grants.py), a
grant published or taken back, who goes first (the queue), a kill, an Event. A request the
arbiter cannot grant from free memory becomes a Need (burst_need, reclaim_need,
swap_in_need: each knows how it is granted and what others may be made to free for it),
and resolve_until runs a resolver chain on it until its deadline.

Runs on the agent's event loop; kills and NVML reads go to worker threads. About 500 lines
as one class on purpose: every resolver, swap and admission see the same accounting, and each
method is a few lines over the parts it is built from.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

from gpufrac.agent.arbiter import grants
from gpufrac.agent.arbiter.chain import ChainMetrics, build_chain, build_guarantee_chain
from gpufrac.agent.arbiter.queue import WaitQueue
from gpufrac.agent.arbiter.readings import DriverReadings
from gpufrac.agent.arbiter.resolvers import Chain, Holding, Need
from gpufrac.agent.arbiter.server import Stats
from gpufrac.agent.arbiter.swap.resolver import restorer
from gpufrac.agent.arbiter.usage import ContainerFiles
from gpufrac.agent.booking.ledger import ContainerAlloc, Ledger
from gpufrac.agent.gpu import activity as activity_mod
from gpufrac.agent.gpu import truth
from gpufrac.agent.kube.events import Booked, EventSink, container_ref
from gpufrac.agent.kube.objref import ObjectRef
from gpufrac.agent.processes import kill
from gpufrac.agent.processes.callers import AgentOutOfResources, PeerLookup
from gpufrac.core.config import Config
from gpufrac.core.units import format_bytes
from gpufrac.memguard import abi

log = logging.getLogger(__name__)

# How long past a need's deadline a resolver that is finishing (a kill's wait for exit, a
# restore) may run before it is cancelled: the chain checks the deadline before each step, so
# this bounds only a step that overruns it. The shim waits arbiterTimeout past its wait timeout
# for the reply, far more than this.
DEADLINE_GRACE = 0.05

# Need.kind of admission's reclaim: it asks no new bytes, only that the request be free.
RECLAIM = "reclaim"


class ArbiterEvents(EventSink, Protocol):
    """Where the arbiter's Kubernetes Events and pod conditions go
    (gpufrac.agent.kube.recorder.EventRecorder)."""

    def disruption(self, ref: ObjectRef, reason: str, message: str) -> None: ...


# -- how each kind of need is granted ------------------------------------------------------------


@dataclass(frozen=True)
class _Burst:
    """A burst to `target` bytes above the request."""

    ctx: Resolution
    target: int

    def try_grant(self, need: Need) -> bool:
        return self.ctx.try_grant(need, self.target)

    def shortfall(self, need: Need) -> int:
        alloc = need.requester
        return self.ctx.coverable(
            need.gpu, self.target - self.ctx.burst_held(alloc) - self.ctx.free_for(alloc)
        )


@dataclass(frozen=True)
class _SwapIn:
    """A swapped-out container's memory back: its burst part re-granted (`target` above the
    request) once `needed` bytes are free (with lendUnusedRequests, all of it: its guarantee
    part may be lent out)."""

    ctx: Resolution
    target: int
    needed: int
    lend: bool

    def try_grant(self, need: Need) -> bool:
        if need.granted:
            return True
        if self.lend and self.ctx.free_for(need.requester) < self.needed:
            return False
        return self.ctx.try_grant(need, self.target)

    def shortfall(self, need: Need) -> int:
        return self.ctx.coverable(need.gpu, self.needed - self.ctx.free_for(need.requester))


@dataclass(frozen=True)
class _Reclaim:
    """A container's request made physically free (nothing published: it is its own already).
    `inflight`: bytes it counts but the driver refused it."""

    ctx: Resolution
    inflight: int

    def try_grant(self, need: Need) -> bool:
        s = self.ctx.guarantee_shortfall(need.requester, need.gpu, self.inflight)
        if s is not None and s <= 0:
            need.granted = True
        return need.granted

    def shortfall(self, need: Need) -> int:
        # What evicting or swapping may cover: not what hidden processes hold (try_grant still
        # waits for all of it to be free).
        missing = self.ctx.guarantee_shortfall(need.requester, need.gpu, self.inflight) or 0
        return self.ctx.coverable(need.gpu, missing)


# -- the context -----------------------------------------------------------------------------------


class Resolution:
    """Accounting, grants and the resolver chains over the arbiter's parts. `swapped` is not
    a collaborator but its own swap resolver's (built here, as the chain is)."""

    def __init__(
        self,
        config: Config,
        ledger: Ledger,
        peers: PeerLookup,
        *,
        queue: WaitQueue,
        readings: DriverReadings,
        files: ContainerFiles,
        sweeper: grants.GrantSweep,
        stats: Stats,
        metrics: ChainMetrics,
        events: ArbiterEvents | None = None,
        activity: activity_mod.DecisionIdle | None = None,
        resolvers: Chain | None = None,
    ) -> None:
        self.config = config
        self.ledger = ledger
        self.peers = peers
        self.queue = queue
        self.readings = readings
        self.files = files
        self.sweeper = sweeper
        self.stats = stats
        self.events = events
        self.metrics = metrics
        self.evict_idle_threshold = config.evict_idle_threshold
        # The agent's activity tracker: how idle a swap or evict victim is (the driver's word
        # where it can be had, not the tenant's stamps); None: the usage file, clamped to now.
        self.activity = activity
        self._seq = itertools.count(1)
        self.granted_at: dict[str, float] = {}  # container key -> time.monotonic() of its last grant
        self._settling: set[str] = set()  # keys whose lowered release waits out GRANT_SETTLE
        self.chain = resolvers if resolvers is not None else build_chain(config.resolvers, self)
        # A guarantee is reclaimed with an evict step even where `resolvers` leaves it out, after
        # the memory no allocation answers for (arbiter/unbooked.py).
        self.guarantee_chain = build_guarantee_chain(self.chain, self)
        # The swap resolver: the chain's when configured, else one that only brings back what
        # an earlier agent swapped out. Its containers' memory is in host RAM, not on the GPU.
        self.swap = restorer(self.chain, self)

    # -- needs and their resolution ----------------------------------------------------------------

    def burst_need(self, alloc: ContainerAlloc, target: int, used: int | None = None) -> Need:
        """A burst to `target` bytes above the request that free memory cannot grant now
        (`used`: what the container holds, if just counted)."""
        return Need(
            alloc,
            alloc.gpus[0],
            target - self.burst_held(alloc, used),
            alloc.config.priority,
            self._deadline(alloc),
            "burst",
            _Burst(self, target),
            seq=self.next_seq(),
        )

    def swap_in_need(self, alloc: ContainerAlloc, gpu: str, nbytes: int) -> Need:
        """A swapped-out container's `nbytes` back on `gpu`: its burst part re-granted, and all
        of its memory physically free (its guarantee part is held for it already, unless lent)."""
        target = max(0, nbytes - alloc.request_bytes)
        lend = self.config.lend_unused_requests
        needed = nbytes if lend else target
        terms = _SwapIn(self, target, needed, lend)
        return Need(
            alloc,
            gpu,
            needed,
            alloc.config.priority,
            self._deadline(alloc),
            "swap-in",
            terms,
            seq=self.next_seq(),
        )

    def reclaim_need(
        self, alloc: ContainerAlloc, gpu: str, missing: int, priority: int, deadline: float, inflight: int = 0
    ) -> Need:
        """`alloc`'s request on `gpu`, `missing` bytes of it held by others' bursts, taken back by
        loop time `deadline` (admission's reclaim, the shim's RECLAIM)."""
        terms = _Reclaim(self, inflight)
        return Need(alloc, gpu, missing, priority, deadline, RECLAIM, terms, seq=self.next_seq())

    @staticmethod
    def _deadline(alloc: ContainerAlloc) -> float:
        """When a request of `alloc` must be answered: its wait timeout from now (loop time)."""
        return asyncio.get_running_loop().time() + alloc.config.wait_timeout_ms / 1000.0

    async def resolve_until(self, need: Need) -> bool:
        """Run the chain for `need` (the guarantee chain for a reclaim) until its deadline, a
        finishing step given DEADLINE_GRACE more; True once it is granted. At the end, one last
        look: memory a cancelled step freed goes to the need it was freed for."""
        chain = self.guarantee_chain if need.kind == RECLAIM else self.chain
        left = need.deadline - asyncio.get_running_loop().time()
        try:
            return await asyncio.wait_for(chain.resolve(need), max(0.0, left) + DEADLINE_GRACE)
        except asyncio.TimeoutError:
            return need.try_grant()

    def next_seq(self) -> int:
        """The next arrival number (FIFO among equal priorities)."""
        return next(self._seq)

    # -- grants ------------------------------------------------------------------------------------

    def try_grant(self, need: Need, target: int) -> bool:
        """A need's grant, unless it asks for burst bytes while a request ranks ahead of it on
        its GPU and still holds it back (WaitQueue.ahead: a waiter, for at most the node's
        headOfLineBound since the need came). It is granted once, whoever tries. No new bytes
        (a swap-in within its guarantee) never queue: a guarantee never waits."""
        asks_more = target > need.requester.config.grant_bytes
        if (
            not need.granted
            and not (asks_more and self.queue.ahead(need.gpu, need.order, need, need.arrived))
            and self.grant(need.requester, target)
        ):
            need.granted = True
        return need.granted

    def grant(self, alloc: ContainerAlloc, target: int) -> bool:
        """Grant `target` bytes above request to the container if the GPU has them now."""
        if self.ledger.get(alloc.key) is not alloc:
            return False  # released meanwhile
        cur = alloc.config.grant_bytes
        if target > cur:
            extra = target - self.burst_held(alloc)
            if extra > self.free_for(alloc):
                return False
            self.ledger.update_config(alloc.key, grant_bytes=target)
        self.stats.granted += 1
        self.sweeper.used(alloc.key)
        self.granted_at[alloc.key] = time.monotonic()
        return True

    def release(self, alloc: ContainerAlloc, used: int | None = None) -> int:
        """Take back the part of a container's grant it does not use (`used`, or as `used()`
        counts it); wakes waiters. Returns its config's generation (the shim's release reply)."""
        used = self.used(alloc) if used is None else used
        g = alloc.config.grant_bytes
        if used is not None and g > 0:
            keep = grants.kept_on_release(used, alloc.request_bytes, g)
            young = grants.settle_left(self.granted_at.get(alloc.key), time.monotonic())
            if keep < g and young > 0:
                # Another process's free (or the returned counter) right after a grant: the
                # shim given it may not have charged its allocation yet. Lower it once it has.
                self._settle_later(alloc, young)
            elif keep < g:
                self.ledger.update_config(alloc.key, grant_bytes=keep)
        self.sweeper.used(alloc.key)
        gpu = alloc.gpus[0]
        self.queue.notify(gpu)
        if self.queue.has_waiters(gpu):
            # The freed bytes show in NVML only after a new reading. Without waiters there is no
            # hurry: a reading from before the free under-counts free memory (never grants too
            # much), and the next burst after NVML_FRESH takes a new one. Reading all GPUs on
            # every release would sit on the fast path of the bursts that follow.
            self.readings.refresh_soon()
        return self.files.generation(alloc)

    def release_unused(self, alloc: ContainerAlloc) -> None:
        """Take back the part of `alloc`'s grant it does not use (as the shim's release does);
        a reclaim waits on what this frees, so NVML is read again at once."""
        self.release(alloc)
        self.readings.refresh_soon()

    def _settle_later(self, alloc: ContainerAlloc, delay: float) -> None:
        if alloc.key in self._settling:
            return
        self._settling.add(alloc.key)

        def settled() -> None:
            self._settling.discard(alloc.key)
            if self.ledger.get(alloc.key) is alloc:
                self.release(alloc)

        asyncio.get_running_loop().call_later(delay, settled)

    def revoke_burst(self, alloc: ContainerAlloc) -> None:
        """Evicted or swapped out: the container keeps its guarantee, loses every burst byte.
        Waiters are woken; during a claim (the resolver that revokes it) only once the
        requester has had its turn."""
        if self.ledger.get(alloc.key) is not None and alloc.config.grant_bytes:
            self.ledger.update_config(alloc.key, grant_bytes=0)
        self.queue.notify(alloc.gpus[0])

    # -- the queue ---------------------------------------------------------------------------------

    def claim(self, need: Need) -> AbstractContextManager[None]:
        """While a resolver frees memory for `need`, nobody who ranks below it is granted on
        its GPU (gpufrac.agent.arbiter.queue.WaitQueue.claim)."""
        return self.queue.claim(need)

    async def wait_turn(self, need: Need) -> bool:
        """Queue the need on its GPU until a release grants it or its deadline passes."""
        return await self.queue.wait_turn(need)

    # -- what each container holds -----------------------------------------------------------------

    def driver_used(self, alloc: ContainerAlloc) -> int | None:
        """What NVML counts for the container's processes on its GPU, less its part of its pod's
        allowance; None without a recent process reading (gpufrac.agent.arbiter.readings)."""
        return self.readings.driver_used(alloc)

    def used(self, alloc: ContainerAlloc) -> int | None:
        """What the container holds on its GPU: the larger of its usage file (clamped to what
        it was given) and the driver's count (gpufrac.agent.gpu.truth). None when the file cannot
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

    def held(self, alloc: ContainerAlloc) -> int:
        """`used`, or, for a container whose usage file cannot be read (the tenant's to
        break), the driver's count, else all it may hold: breaking its own bookkeeping must
        shield it from no reclaim and inflate no one else's shortfall."""
        used = self.used(alloc)
        if used is not None:
            return used
        driver = self.driver_used(alloc)
        return driver if driver is not None else alloc.request_bytes + alloc.config.grant_bytes

    def _share(self, alloc: ContainerAlloc, used: int | None) -> grants.Share:
        return grants.Share(used, alloc.request_bytes, alloc.config.grant_bytes)

    def burst_held(self, alloc: ContainerAlloc, used: int | None = None) -> int:
        """Bytes the container holds above its request (or is granted: the larger)."""
        used = self.used(alloc) if used is None else used
        return self._share(alloc, used).burst

    def _on_gpu(self, gpu: str) -> list[ContainerAlloc]:
        return [a for a in self.ledger.containers() if gpu in a.gpus]

    def free_for(self, alloc: ContainerAlloc) -> int:
        """Bytes that may be newly granted on the requester's GPU (grants.free_for)."""
        gpu = alloc.gpus[0]
        return grants.free_for(
            [self._share(a, self.used(a)) for a in self._on_gpu(gpu)],
            self.ledger.geometry[gpu].allocatable,
            self.readings.free(gpu),
            self.config.grant_margin,
            self.config.lend_unused_requests,
        )

    def holdings(self, gpu: str) -> list[Holding]:
        """Every container's use of `gpu` now: what the resolvers choose their victims from."""
        now = time.monotonic_ns()
        out = []
        for a in self._on_gpu(gpu):
            u = self.files.usage_of(a)
            used = self.held(a)
            # An unreadable usage file gives no activity either: the container counts as idle.
            last = max((int(s.last_activity_ns) for s in abi.live_slots(u)), default=0) if u else 0
            idle_s = activity_mod.holding_idle_s(self.activity, a.key, last, now) if u else float("inf")
            out.append(
                Holding(
                    alloc=a,
                    used=used,
                    request=a.request_bytes,
                    grant=a.config.grant_bytes,
                    burst=self.burst_held(a, used),
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

    def guarantee_shortfall(self, alloc: ContainerAlloc, gpu: str, inflight: int = 0) -> int | None:
        """Bytes of `alloc`'s request on `gpu` that are not physically there now: its request
        less what it uses (less `inflight`, counted but not given by the driver), beyond NVML free
        less the margin less what every other container may still charge within its request +
        grant. None without an NVML reading (admission.reclaim_guarantee).
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
                held_by = max(self.held(a), self.readings.whole_count(a) or 0)
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

    def unbooked(self, gpu: str, requester: str) -> list[truth.Unbooked]:
        """The processes on `gpu` of containers holding no allocation there (arbiter/unbooked.py),
        none while a booking there other than `requester`'s is not yet tied to its container (the
        memory may be that one's, as the watchdog also waits)."""
        if any(not a.tied and a.key != requester for a in self._on_gpu(gpu)):
            return []
        return self.readings.unbooked_on(gpu)

    async def kill_unbooked(self, p: truth.Unbooked) -> bool:
        """SIGKILL one such process while it is the one the driver listed, in that container
        (processes/kill.py kill_if_seen, in a worker thread); True once it is gone."""
        return await asyncio.to_thread(kill.kill_if_seen, p.proc.pid, p.cgroup, p.proc.start, self.peers.proc)

    def hidden_bytes(self, gpu: str) -> int:
        """What hidden processes hold on `gpu` in the last reading (readings.DriverReadings.hidden_on)."""
        return self.readings.hidden_on(gpu)

    def hidden_note(self, gpu: str) -> str:
        """For a denial's log line: what hidden processes hold on `gpu`, if anything."""
        hidden = self.hidden_bytes(gpu)
        if not hidden:
            return ""
        return f"; {format_bytes(hidden)} held by hidden GPU processes, never taken from others for it"

    # -- NVML --------------------------------------------------------------------------------------

    async def refresh_memory(self) -> None:
        """A fresh NVML reading now (after a swap or a kill moved memory); waiters are re-checked."""
        await self.readings.refresh()

    async def second_reading(self) -> None:
        """A new NVML reading, distinct from the last (gpufrac.agent.arbiter.readings)."""
        await self.readings.second_reading()

    # -- eviction ----------------------------------------------------------------------------------

    async def kill_container(self, alloc: ContainerAlloc) -> int:
        """SIGKILL every process of the container (gpufrac.agent.processes.kill, in a worker thread);
        returns the count once they are gone. Their dead usage slots are reaped here, since no
        shim of that container may be left to do it."""
        # The processes the driver counts for it go first (gpufrac.agent.processes.kill: a victim
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

    def event(self, alloc: Booked, type_: str, reason: str, message: str) -> None:
        ref = container_ref(alloc)
        if self.events is not None and ref is not None:
            self.events.record(ref, type_, reason, message)

    def disrupted(self, alloc: ContainerAlloc, reason: str, message: str) -> None:
        """Mark the pod of `alloc` DisruptionTarget (gpufrac.agent.kube.recorder.EventRecorder.disruption)."""
        ref = container_ref(alloc)
        if self.events is not None and ref is not None:
            self.events.disruption(ref, reason, message)
