"""The swap resolver: idle, swappable containers moved to host RAM and back (docs/design.md, section 2).

Swap-out (a resolver in the arbiter's chain, gpufrac.agent.arbiter.resolvers): when a burst
needs more than is free on a GPU, pick idle containers (no kernel launch for
`swap.idleThreshold`, default `evictIdleThreshold`) whose pods allow swapping
(FLAG_SWAPPABLE) and that hold memory there; take the fewest, least important
ones that free enough, within the host-RAM budget; for each, checkpoint every
CUDA process of the container with the driver's checkpoint API (lock with a
timeout, then checkpoint; gpufrac.agent.arbiter.swap.checkpoint) and set the `swapped` flag of
their usage slots. The pod stays Running: its processes are merely blocked in
the driver until they are restored. `SwapResolver.swap_out` swaps one chosen
container the same way on request (the idle reaper's `swap` action).

What a swap wins is what the arbiter's arithmetic wins: the victim's memory no
longer counts as used on the GPU, its burst grant is taken back, and its
guarantee stays reserved for it (lent to others only with lendUnusedRequests),
so a guarantee is never lost by being swapped.

Swap-in: the victim's next CUDA call (any driver entry point: each passes the shim's swap-in
gate, through a hook or a gate trampoline) sees the flag in the shim, which asks the arbiter
(op SWAP_IN on its socket). The arbiter passes that to
`SwapResolver.swap_in`, which arbitrates it like any other request - the memory
must be free (the chain may wait or evict others; the swap resolver never picks
the requester itself) - then restores and unlocks the processes, clears the
flags and answers. A victim whose swap-in cannot be arbitrated in time is told
"denied"; its shim asks again (its process cannot run until restored anyway). So is one
whose processes nobody can tell about (the checkpoint API unusable): a flag is cleared only
once the driver reports its process running.

Everything here runs on the agent's loop; checkpoint calls, /proc scans and
usage-file writes go to worker threads. Its parts: the choice of victims (swap/choice.py,
pure), the flags and records on disk (swap/files.py), the takeover of containers a previous
agent swapped (swap/takeover.py). This module is the resolver itself, one class over 500
lines: swap-out, swap-in and the takeover share the per-container busy marks that keep
them from interleaving (_busy_with), and split apart each would have to reach into the
others' state.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

import psutil

from gpufrac.agent.arbiter.resolvers import Chain, Holding, Need, Outcome
from gpufrac.agent.arbiter.swap.checkpoint import (
    DETECT_RETRY,
    Checkpointer,
    CheckpointError,
    ProcessState,
    Support,
    process_state,
)
from gpufrac.agent.arbiter.swap.choice import pick, win
from gpufrac.agent.arbiter.swap.files import (
    SlotId,
    Swapped,
    drop_size,
    launches_of,
    set_swapped,
    write_size,
)
from gpufrac.agent.arbiter.swap.takeover import Takeover, Unavailable, Unknown
from gpufrac.agent.booking.ledger import ContainerAlloc, Ledger
from gpufrac.agent.kube.events import (
    NORMAL,
    REASON_FREED_BY_SWAP,
    REASON_SWAPPED_IN,
    REASON_SWAPPED_OUT,
    Booked,
    container_name,
)
from gpufrac.agent.processes.callers import AgentOutOfResources, PeerLookup
from gpufrac.agent.processes.proc import proc_identity
from gpufrac.core.annotations import SWAPPABLE
from gpufrac.core.config import Config
from gpufrac.core.units import format_bytes
from gpufrac.memguard import abi, wire
from gpufrac.memguard.abi import FLAG_SWAPPABLE, FLAG_WHOLE_GPU, FormatError

log = logging.getLogger(__name__)


class SwapMetrics(Protocol):
    """Where swaps are counted (gpufrac.agent.metrics)."""

    def count_swap(self, container: ContainerAlloc, direction: str) -> None: ...


class SwapHost(Protocol):
    """What the swap resolver needs of the arbiter's resolution context (arbiter/context.py)."""

    config: Config
    ledger: Ledger
    peers: PeerLookup

    @property
    def metrics(self) -> SwapMetrics: ...
    def holdings(self, gpu: str) -> list[Holding]: ...
    def usage_readable(self, alloc: ContainerAlloc) -> bool: ...
    def claim(self, need: Need) -> AbstractContextManager[None]: ...
    def revoke_burst(self, alloc: ContainerAlloc) -> None: ...
    def event(self, alloc: Booked, type_: str, reason: str, message: str) -> None: ...
    def swap_in_need(self, alloc: ContainerAlloc, gpu: str, nbytes: int) -> Need: ...
    async def resolve_until(self, need: Need) -> bool: ...
    async def refresh_memory(self) -> None: ...


@dataclass
class SwapStats:
    """Counters (metrics and tests read them)."""

    swapped_out: int = 0
    swapped_in: int = 0
    failed_out: int = 0
    failed_in: int = 0
    bytes_out: int = 0
    reverted: int = 0  # victims that woke up during their swap-out and were restored at once


class _Skip(Exception):
    """This container cannot be swapped now (the message says why)."""


# -- the resolver ------------------------------------------------------------------------------------


class SwapResolver:
    """The swap resolver. The arbiter always has one: `in_chain` says whether the node's
    `resolvers` name it (then it swaps victims out, for the chain and the idle reaper);
    without, it only takes over and brings back containers an earlier agent swapped out,
    which must come back whatever this agent's config says."""

    name = "swap"

    def __init__(
        self, ctx: SwapHost, checkpointer: Checkpointer | None = None, *, in_chain: bool = True
    ) -> None:
        self.ctx = ctx
        self.config: Config = ctx.config
        self.ckpt = checkpointer or Checkpointer()
        self.in_chain = in_chain
        self.swapped: dict[str, Swapped] = {}
        self.stats = SwapStats()
        self._busy: dict[str, asyncio.Future[None]] = {}  # container key -> swap-out/in in progress
        self._inflight = 0  # bytes of swap-outs under way (host RAM they will take)
        self._detect: asyncio.Future[Support] | None = None
        self._detected_at = 0.0  # time.monotonic() of the last detection started
        self._said: bool | None = None  # the availability last said in the log
        self._denied_said: set[str] = set()  # containers told "not yet" for want of the checkpoint API
        self._takeover = Takeover(self.ckpt, ctx.peers)

    # -- support --------------------------------------------------------------------------------

    async def detect(self) -> Support:
        """Detect the checkpoint API (in a thread) and say what was found, once per change.
        Found, it stays found; not found, it is looked for again at most every DETECT_RETRY
        seconds when asked (a driver still starting, a transient failure): a container an
        earlier agent swapped out can come back only through it."""
        now = time.monotonic()
        if self._detect is None or (
            self._detect.done()
            and not self._support_of(self._detect).available
            and now - self._detected_at >= DETECT_RETRY
        ):
            self._detected_at = now
            self._detect = asyncio.ensure_future(asyncio.to_thread(self.ckpt.detect))
        await asyncio.wait([self._detect])  # a caller cancelled meanwhile leaves it running
        support = self._support_of(self._detect)
        if self._said != support.available:
            if support.available:
                log.info("swap: driver checkpoint API available (driver API %d)", support.driver_version)
            elif self._said is None and self.in_chain:
                log.warning(
                    "swap: unavailable on this node, the resolver chain goes on without it: %s",
                    support.reason,
                )
            elif self._said is None:
                log.info(
                    "swap: not in the resolvers; the driver checkpoint API is unavailable: %s", support.reason
                )
            self._said = support.available
        return support

    @staticmethod
    def _support_of(done: asyncio.Future[Support]) -> Support:
        e = done.exception()
        return (
            Support(False, f"detection failed: {type(e).__name__}: {e}") if e is not None else done.result()
        )

    async def start(self) -> None:
        """At agent start: detect support; take over containers a previous agent swapped
        (whatever this agent's resolvers: they must come back)."""
        await self.detect()
        for alloc in self.ctx.ledger.containers():
            try:
                async with self._busy_with(alloc.key):
                    if alloc.key not in self.swapped and self.ctx.ledger.get(alloc.key) is alloc:
                        await self._rediscover(alloc)
            except (Unknown, Unavailable):
                pass  # its flags stay set; its SWAP_IN asks again (said in the log)
            except Exception:
                log.exception("swap: cannot recover the swap state of %s", alloc.who())

    # -- state the arbiter reads ----------------------------------------------------------------

    def is_swapped(self, key: str) -> bool:
        """Whether the container booked under `key` now is swapped out. A key is the device
        set's: a new container on the same slices has it too, and is not swapped."""
        s = self.swapped.get(key)
        return s is not None and self.ctx.ledger.get(key) is s.alloc

    @property
    def host_ram_used(self) -> int:
        return sum(s.bytes for s in self.swapped.values())

    @property
    def idle_threshold(self) -> float:
        return self.config.swap.idle_threshold or self.config.evict_idle_threshold

    async def _prune(self) -> None:
        """Forget swapped containers that were released or whose processes all exited (the
        driver freed their host copy with them), known by identity, not number: a pid given
        to another process does not keep a container swapped."""
        entries = list(self.swapped.items())
        if not entries:
            return
        living = await asyncio.to_thread(lambda: {key: bool(s.living()) for key, s in entries})
        for key, s in entries:
            if self.swapped.get(key) is not s:
                continue  # restored or replaced meanwhile
            if self.ctx.ledger.get(key) is not s.alloc or not living[key]:
                log.info("swap: %s is gone while swapped out; forgetting it", s.alloc.who())
                del self.swapped[key]

    # -- swap-out (the resolver) ---------------------------------------------------------------

    def candidates(self, need: Need) -> list[Holding]:
        out = []
        for h in self.ctx.holdings(need.gpu):
            a = h.alloc
            if a.key == need.requester.key or a.key in self.swapped or a.key in self._busy:
                continue
            if not h.flags & FLAG_SWAPPABLE or h.flags & FLAG_WHOLE_GPU or a.whole_gpu:
                continue
            if h.used <= 0 or h.idle_s < self.idle_threshold:
                continue
            if not self.ctx.usage_readable(a):
                # Its shim cannot be told to ask for its memory back through a file it broke,
                # and the file's "idle since ever" would put it first: never a victim (the
                # arbiter counts it from the driver for evict and reclaim all the same).
                continue
            out.append(h)
        return out

    def ram_left(self) -> int:
        budget = self.config.swap.host_ram_budget - self.host_ram_used - self._inflight
        # The checkpoint lands in host RAM: never more than the host has free (if psutil
        # cannot tell, the configured budget alone).
        with contextlib.suppress(Exception):
            budget = min(budget, int(psutil.virtual_memory().available))
        return max(0, budget)

    async def resolve(self, need: Need) -> Outcome:
        if not self.in_chain:
            return Outcome(available=False, detail="swap is not in the node's resolvers")
        support = await self.detect()
        if not support.available:
            return Outcome(available=False, detail=support.reason)
        await self._prune()
        missing = need.shortfall()
        if missing <= 0:
            return Outcome()
        lend = self.config.lend_unused_requests
        cands = self.candidates(need)
        chosen = pick(cands, missing, self.ram_left(), lend)
        if not chosen:
            total = sum(win(h, lend) for h in cands)
            return Outcome(
                detail=f"{len(cands)} idle swappable container(s) would free {format_bytes(total)} of "
                f"{format_bytes(missing)} needed within the host RAM left ({format_bytes(self.ram_left())})"
            )
        freed, moved, n = 0, 0, 0
        skipped: set[str] = set()
        # What the swap wins goes to the requester first, then to the waiters (ctx.claim).
        with self.ctx.claim(need):
            while chosen:
                for h in chosen:
                    if await self._swap_victim(h, need):
                        freed += win(h, lend)
                        moved += h.used
                        n += 1
                    else:
                        skipped.add(h.alloc.key)
                if freed >= missing:
                    break
                # A victim that could not be swapped (a process outside the shim, a usage file
                # it broke, a lock that timed out) must not end the swap step: the others are
                # picked from again, for what is still missing, before the chain moves on to
                # evicting or denying. Each round swaps or skips someone, so this ends.
                rest = [h for h in self.candidates(need) if h.alloc.key not in skipped]
                chosen = pick(rest, missing - freed, self.ram_left(), lend)
            if not n:
                return Outcome(detail=f"no victim could be swapped out ({len(skipped)} tried)")
            await self.ctx.refresh_memory()  # NVML now shows the victims' memory free
            satisfied = need.try_grant()
        return Outcome(
            freed=freed,
            satisfied=satisfied,
            detail=f"swapped {n} container(s), {format_bytes(moved)}, to host RAM",
        )

    async def _swap_victim(self, h: Holding, need: Need) -> bool:
        """Swap one victim chosen for a need; the requester is told whose memory made room."""
        cause = (
            f"after {h.idle_s:.0f}s idle: {need.who()} needed {format_bytes(need.bytes)} on GPU {need.gpu}"
        )
        try:
            await self._swap_out(h, need.gpu, cause, needed_by=need.who())
        except _Skip as e:
            log.info("swap: not swapping %s: %s", h.alloc.who(), e)
            return False
        self.ctx.event(
            need.requester,
            NORMAL,
            REASON_FREED_BY_SWAP,
            f"{h.alloc.who()} ({format_bytes(h.used)} of GPU memory) was swapped to host RAM to make room "
            f"for {format_bytes(need.bytes)} needed by this container on GPU {need.gpu}",
        )
        return True

    # -- swap-out on request (the idle reaper's `swap` action) ----------------------------------

    async def swap_out(self, alloc: ContainerAlloc, reason: str) -> tuple[bool, str]:
        """Move one chosen container to host RAM now, by the same path as a victim of the
        chain; `reason` (who asks, and why) goes into its Event. Its next GPU call brings
        it back through the shim's SWAP_IN, arbitrated like any request.

        (True, what was moved) or (False, why not): swap unsupported here, the container
        is gone, has a whole GPU, does not allow swapping, is already swapped (or being
        swapped), holds no GPU memory, would pass the host-RAM budget, or has a CUDA
        process that is not under the shim or not running."""
        if not self.in_chain:
            return False, "swap to host RAM is not in the node's resolvers"
        support = await self.detect()
        if not support.available:
            return False, f"swap to host RAM is unavailable on this node: {support.reason}"
        await self._prune()
        try:
            h = self._requested(alloc)
            await self._swap_out(h, alloc.gpus[0], reason, needed_by=reason)
        except _Skip as e:
            log.info("swap: not swapping %s on request: %s", alloc.who(), e)
            return False, f"{alloc.who()} cannot be swapped: {e}"
        await self.ctx.refresh_memory()  # NVML now shows its memory free; waiters are re-checked
        return True, (
            f"{format_bytes(h.used)} of GPU memory of {alloc.who()} swapped to host RAM; "
            "it comes back on the container's next GPU work"
        )

    def _requested(self, alloc: ContainerAlloc) -> Holding:
        """The holding of a container asked to be swapped out; _Skip when it may not be."""
        if self.ctx.ledger.get(alloc.key) is not alloc:
            raise _Skip("it is no longer allocated on this node")
        if alloc.whole_gpu or alloc.config.flags & FLAG_WHOLE_GPU:
            raise _Skip("it has a whole GPU, which is never swapped")
        if not alloc.config.flags & FLAG_SWAPPABLE:
            raise _Skip(
                f'its pod does not allow swapping (annotation {SWAPPABLE}: "true", '
                "or node config swap.defaultSwappable)"
            )
        self._check_free(alloc.key)
        h = next((h for h in self.ctx.holdings(alloc.gpus[0]) if h.alloc.key == alloc.key), None)
        if h is None:
            raise _Skip("its GPU memory use cannot be read (no usage file)")
        if h.used <= 0:
            raise _Skip("it holds no GPU memory")
        return h

    # -- swap-out (one container; both callers) ------------------------------------------------

    def _check_free(self, key: str) -> None:
        """_Skip unless the container is neither swapped nor being swapped."""
        if key in self.swapped:
            raise _Skip("its GPU memory is already in host RAM")
        if key in self._busy:
            raise _Skip("a swap of it is already under way")

    async def _swap_out(self, h: Holding, gpu: str, cause: str, needed_by: str) -> Swapped:
        """Move one container to host RAM: every one of its CUDA processes locked and
        checkpointed, its slots flagged, its burst revoked, an Event saying `cause`.
        The one swap-out path, for the chain's victims and for requests. _Skip (why)
        when it cannot be done; then nothing of it has changed."""
        alloc = h.alloc
        key = alloc.key
        self._check_free(key)
        left, budget = self.ram_left(), self.config.swap.host_ram_budget
        if h.used > left:
            raise _Skip(
                f"its {format_bytes(h.used)} would not fit in the host RAM left for swap "
                f"({format_bytes(left)} of swap.hostRamBudget {format_bytes(budget)})"
            )
        done = self._mark_busy(key)
        self._inflight += h.used
        try:
            return await self._swap_out_locked(h, gpu, cause, needed_by)
        except _Skip:
            self.stats.failed_out += 1
            raise
        finally:
            self._inflight -= h.used
            self._unmark_busy(key, done)

    def _mark_busy(self, key: str) -> asyncio.Future[None]:
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._busy[key] = done
        return done

    def _unmark_busy(self, key: str, done: asyncio.Future[None]) -> None:
        if self._busy.get(key) is done:
            del self._busy[key]
        done.set_result(None)

    @contextlib.asynccontextmanager
    async def _busy_with(self, key: str) -> AsyncIterator[None]:
        """The container to oneself: after any swap of it under way, and before any await,
        so two swap-ins (or a swap-in and the start's takeover) never interleave."""
        while key in self._busy:
            await asyncio.shield(self._busy[key])
        done = self._mark_busy(key)
        try:
            yield
        finally:
            self._unmark_busy(key, done)

    def _prepare(self, alloc: ContainerAlloc) -> list[tuple[int, SlotId]]:
        """The container's CUDA processes (host pid, usage slot). Every one must be RUNNING
        and under the shim: a process that cannot ask to be swapped back in is never
        swapped. Blocking: /proc scans and driver calls."""
        try:
            pids = self.ctx.peers.pids_of(alloc)
        except AgentOutOfResources as e:  # a process not looked at would be left unswapped
            raise _Skip(f"its processes cannot all be looked at now ({e})") from None
        try:
            usage = abi.read_usage(alloc.directory)
        except (FormatError, OSError) as e:  # the container's own file: it may break it
            raise _Skip(
                f"its usage file cannot be read ({e}): its shim could not be told to come back"
            ) from None
        slots = {(int(s.pid), int(s.start_time)) for s in abi.live_slots(usage)}
        out = []
        for pid in pids:
            state = process_state(pid, self.ckpt)
            if state is None:
                continue  # no CUDA in this process
            ident = proc_identity(pid)
            if ident is None:
                continue  # exited
            if state != ProcessState.RUNNING:
                raise _Skip(f"process {pid} is {state.name}")
            if ident not in slots:
                raise _Skip(
                    f"process {pid} uses CUDA outside the memguard shim and could not ask to come back"
                )
            out.append((pid, ident))
        if not out:
            raise _Skip("no CUDA process found in its cgroup")
        return out

    def _held_by_driver(self, pids: Sequence[int]) -> list[int]:
        """The processes the driver reports locked or checkpointed (blocking: driver calls)."""
        held = (ProcessState.LOCKED, ProcessState.CHECKPOINTED)
        return [p for p in pids if process_state(p, self.ckpt) in held]

    async def _swap_out_locked(self, h: Holding, gpu: str, cause: str, needed_by: str) -> Swapped:
        alloc = h.alloc
        procs = await asyncio.to_thread(self._prepare, alloc)
        pids = [p for p, _ in procs]
        slots = [s for _, s in procs]
        lock_ms = max(1, round(self.config.swap.lock_timeout * 1000))  # config.validate bounds it
        t0 = time.monotonic()
        # Flag first: a launch from now on asks for swap-in (and waits for this swap-out).
        try:
            before = await asyncio.to_thread(set_swapped, alloc.directory, slots, 1)
        except (FormatError, OSError) as e:
            await self._clear_flags(alloc, slots)  # those it may have set before the file broke
            raise _Skip(f"its usage file cannot be written ({e})") from None
        try:
            await asyncio.to_thread(self.ckpt.swap_out, pids, lock_ms)
        except CheckpointError as e:
            # The checkpointer undid what it had done; a flag is cleared only once the driver
            # runs the process again. One it could not undo stays flagged and is kept as
            # swapped out, so its next GPU call asks for it to be restored.
            held = await asyncio.to_thread(self._held_by_driver, pids)
            if not held:
                await self._clear_flags(alloc, slots)
                raise _Skip(str(e)) from None
            log.error(
                "swap: swapping %s out failed (%s) and could not be undone: process(es) %s stay held "
                "by the driver; kept as swapped out, restored on its next GPU call",
                alloc.who(),
                e,
                held,
            )
        # From here its memory is in host RAM: whatever happens, it is restored or recorded.
        entry = Swapped(alloc, gpu, h.used, tuple(pids), tuple(slots), needed_by=needed_by)
        try:
            await asyncio.to_thread(write_size, alloc.directory, h.used)
        except OSError as e:  # the agent's own record; a restarted agent falls back on the limit
            log.warning("swap: cannot record the size of %s's swap-out: %s", alloc.who(), e)
        changed = ""
        try:
            if await asyncio.to_thread(launches_of, alloc.directory, slots) != before:
                changed = "it became active during the swap-out"
        except (FormatError, OSError) as e:
            # The tenant broke its file meanwhile: its flags may be gone with it, and then its
            # shim would call into a locked driver with nobody to ask. Undo the swap-out.
            changed = f"its usage file became unreadable during the swap-out ({e})"
        if changed:
            # It launched work while being swapped; a launch that passed the flag check just
            # before it was set is blocked in the driver with nobody to ask for it: restore now
            # (a swap-out undone, not a swap-in: neither counted nor announced as one). If the
            # restore fails it stays swapped out, recorded below like any other.
            self.stats.reverted += 1
            if await self._restore(entry, reverted=True):
                raise _Skip(changed)
        self.swapped[alloc.key] = entry
        self.ctx.revoke_burst(alloc)  # the burst goes with it; it is arbitrated again on the way back
        self.stats.swapped_out += 1
        self.stats.bytes_out += h.used
        self.ctx.metrics.count_swap(alloc, "out")
        log.warning(
            "swap: %s (%s, idle %.0fs) moved to host RAM from GPU %s in %.2fs (%s)",
            alloc.who(),
            format_bytes(h.used),
            h.idle_s,
            gpu,
            time.monotonic() - t0,
            cause,
        )
        self.ctx.event(
            alloc,
            NORMAL,
            REASON_SWAPPED_OUT,
            f"{format_bytes(h.used)} of GPU memory of container {container_name(alloc)} moved to host "
            f"RAM ({cause}); it comes back on the container's next GPU work",
        )
        return entry

    # -- swap-in (the arbiter's SWAP_IN op) -------------------------------------------------------

    async def swap_in(self, alloc: ContainerAlloc) -> bool:
        """The container asks for its memory back. True once it is restored (or was never
        swapped): the shim may go on. False: not now, the shim asks again."""
        key = alloc.key
        await self.detect()
        async with self._busy_with(key):
            entry = self.swapped.get(key)
            if entry is None:
                try:
                    entry = await self._rediscover(alloc)
                except Unknown:
                    return False  # not yet: its flags stay set and its shim asks again
                except Unavailable as e:
                    if key not in self._denied_said:  # said once: its shim asks every second
                        self._denied_said.add(key)
                        log.warning(
                            "swap: %s asks for its memory back; denied, it asks again: %s", alloc.who(), e
                        )
                    return False
                if entry is None:
                    return True
            return await self._swap_in(entry)

    async def _rediscover(self, alloc: ContainerAlloc) -> Swapped | None:
        """A container a previous agent swapped out becomes a Swapped entry again
        (gpufrac.agent.arbiter.swap.takeover); Unknown when its processes cannot be found yet."""
        entry = await self._takeover.rediscover(alloc)
        if entry is not None:
            self.swapped[alloc.key] = entry
        return entry

    async def _swap_in(self, entry: Swapped) -> bool:
        alloc = entry.alloc
        if self.ctx.ledger.get(alloc.key) is not alloc:
            self.swapped.pop(alloc.key, None)
            return True
        # Its burst part re-granted, and all of its memory physically free (its guarantee part
        # is held for it already, unless lent); never what hidden processes hold is taken from
        # others for it (Resolution.coverable).
        need = self.ctx.swap_in_need(alloc, entry.gpu, entry.bytes)
        await self.ctx.refresh_memory()
        # Refused while a request ranks ahead: then the chain (or the queue).
        ok = need.try_grant() or await self.ctx.resolve_until(need)
        if not ok:
            self.stats.failed_in += 1
            log.info(
                "swap: %s cannot come back yet: %s needed on GPU %s (%s)",
                alloc.who(),
                format_bytes(entry.bytes),
                entry.gpu,
                "; ".join(need.notes) or "not free",
            )
            return False
        if not await self._restore(entry):
            self.ctx.revoke_burst(alloc)  # the grant made for it is not used
            return False
        return True

    async def _clear_flags(self, alloc: ContainerAlloc, slots: Sequence[SlotId]) -> None:
        """Clear the swapped flags of processes the driver runs again (or never locked). A
        usage file its container broke has no flags to clear: said, never raised."""
        try:
            await asyncio.to_thread(set_swapped, alloc.directory, slots, 0)
        except (FormatError, OSError) as e:
            log.warning("swap: cannot clear the swapped flags of %s: %s", alloc.who(), e)

    async def _restore(self, entry: Swapped, *, reverted: bool = False) -> bool:
        """Restore + unlock the processes, clear the flags, forget the entry. `reverted`: the
        swap-out of it is being undone (it was never counted or announced as swapped out)."""
        alloc = entry.alloc
        t0 = time.monotonic()

        def restore() -> None:
            # Its processes by identity: one that exited is left out (its pid may be another
            # process's now, which the driver does not know: NOT_FOUND), the rest come back.
            self.ckpt.swap_in(entry.living(), entry.gone)

        try:
            await asyncio.to_thread(restore)
        except CheckpointError as e:
            self.stats.failed_in += 1
            log.warning("swap: restoring %s failed, it stays in host RAM: %s", alloc.who(), e)
            self.swapped[alloc.key] = entry
            return False
        self.swapped.pop(alloc.key, None)
        await self._clear_flags(alloc, entry.slots)
        await asyncio.to_thread(drop_size, alloc.directory)
        await self.ctx.refresh_memory()
        secs = time.monotonic() - t0
        if reverted:
            log.info("swap: swap-out of %s undone in %.2fs (it became active)", alloc.who(), secs)
            return True
        self.stats.swapped_in += 1
        self.ctx.metrics.count_swap(alloc, "in")
        away = time.monotonic() - entry.since
        log.info(
            "swap: %s back on GPU %s in %.2fs (%s)", alloc.who(), entry.gpu, secs, format_bytes(entry.bytes)
        )
        self.ctx.event(
            alloc,
            NORMAL,
            REASON_SWAPPED_IN,
            f"{format_bytes(entry.bytes)} of GPU memory of container {container_name(alloc)} restored "
            f"to GPU {entry.gpu} from host RAM after {away:.0f}s swapped out",
        )
        return True


def of(chain: Chain) -> SwapResolver | None:
    """The swap resolver in an arbiter's chain, if the config names it."""
    return next((r for r in chain.resolvers if isinstance(r, SwapResolver)), None)


def restorer(chain: Chain, ctx: SwapHost) -> SwapResolver:
    """The arbiter's swap resolver: the chain's, or one that only brings back what an
    earlier agent swapped out (`in_chain` False) when the node's resolvers leave swap out."""
    return of(chain) or SwapResolver(ctx, in_chain=False)


async def handle_swap_in(resolver: SwapResolver, alloc: ContainerAlloc) -> int:
    """The arbiter's handler of the shim's SWAP_IN op: the reply status. GRANTED only once
    nothing of the container is held by the driver (restored, or found running); DENIED
    otherwise, its flags left set: a flag cleared over a locked process sends it into a
    driver call that never returns, while a denied shim asks again, backing off."""
    # Shielded: a shim that stops listening (its timeout) must not cut a restore in half;
    # it asks again and finds the work done.
    return wire.BURST_GRANTED if await asyncio.shield(resolver.swap_in(alloc)) else wire.BURST_DENIED
