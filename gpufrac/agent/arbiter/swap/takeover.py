"""Taking over containers a previous agent swapped out (the swap resolver's start, and a
SWAP_IN from a container this agent did not swap).

Its usage slots say `swapped`, but that file is the container's to write: what is believed
is the driver's checkpoint state of the processes found in its cgroup, and the size the
previous agent recorded (gpufrac.agent.arbiter.swap.files). Blocking reads go to worker threads.

Finding a container's processes scans every process on the node and asks the driver about
each of the container's: the scans of one container are at least RESCAN_SPACING apart. A
container sets its own flags and may send the arbiter 200 SWAP_INs a second; the ones between
two scans share the last scan's conclusion (see Takeover.rediscover).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from dataclasses import dataclass

from gpufrac.agent.arbiter.swap.checkpoint import DETECT_RETRY, Checkpointer, ProcessState, process_state
from gpufrac.agent.arbiter.swap.files import (
    SlotId,
    Swapped,
    drop_size,
    processes_of,
    read_size,
    set_swapped,
)
from gpufrac.agent.booking.ledger import ContainerAlloc
from gpufrac.agent.processes.callers import PeerLookup
from gpufrac.agent.processes.proc import proc_identity
from gpufrac.core.units import format_bytes
from gpufrac.memguard import abi
from gpufrac.memguard.abi import FormatError

# One logger for everything the swap resolver does: the resolver module's.
log = logging.getLogger("gpufrac.agent.arbiter.swap.resolver")

# The scans for one container's processes begin at least this far apart (seconds): a
# flood of SWAP_INs costs at most 1/RESCAN_SPACING scans a second per container, and a
# container whose processes could not be told yet is looked at again within it.
RESCAN_SPACING = 0.5


class Unknown(Exception):
    """A container's processes cannot be found now: nothing about its swap state may be
    concluded (its flags stay as they are)."""


class Unavailable(Exception):
    """A container is flagged swapped out, and the driver's checkpoint API cannot be used
    here now, so nobody can tell whether its processes are locked: its flags stay set (a
    flag cleared over a locked process sends it into a driver call that never returns)."""


class _Found(enum.Enum):
    """What a scan of a container's processes concluded."""

    NOTHING_HELD = "nothing held"  # the driver runs every process found (flags cleared)
    UNKNOWN = "unknown"  # its processes could not be told yet
    TAKEN = "taken over"  # it held processes: they became a Swapped entry (or the scan failed)


@dataclass
class _Scan:
    alloc: ContainerAlloc  # the container it was for (a key is reused by the next one)
    began: float  # time.monotonic()
    found: _Found


class Takeover:
    def __init__(self, ckpt: Checkpointer, peers: PeerLookup) -> None:
        self.ckpt = ckpt
        self._peers = peers
        self._scans: dict[str, _Scan] = {}  # container key -> its last scan
        self._unknown_said: set[str] = set()  # containers whose processes could not be told apart yet
        self._unavailable_said: set[str] = set()  # flagged containers the driver could not be asked about
        self._unfound_said: set[str] = set()  # flagged slots whose processes could not be found

    async def rediscover(self, alloc: ContainerAlloc) -> Swapped | None:
        """A container flagged swapped that this agent did not swap (a previous agent did):
        its locked or checkpointed processes become a Swapped entry again. A flag is cleared
        only once the process it names is found (by cgroup) and the driver reports it running
        (or holding no CUDA state): a flag cleared over a locked process leaves that process
        blocked in the driver with nobody to ask for it. Unknown when its processes cannot
        be found yet; Unavailable when the driver cannot be asked.

        A scan of its processes begins at least RESCAN_SPACING after its previous one; one
        asked for sooner shares that one's conclusion (Unknown again, or None: nothing held
        then, and nothing can have been locked since but by this agent, whose own swap-outs
        are never looked for here). One that took processes over is not shared (they are
        restored and running by now): that call waits out the spacing and scans. Callers
        hold the container to themselves (SwapResolver._busy_with), so a SWAP_IN that comes
        while a scan is under way waits for it, then shares its conclusion."""
        try:
            usage = await asyncio.to_thread(abi.read_usage, alloc.directory)
        except (FormatError, OSError):
            return None  # no flags to read (the container's own file, broken): nothing to take over
        flagged = [s for s in abi.live_slots(usage) if s.swapped]
        if not flagged:
            self._unavailable_said.discard(alloc.key)
            return None
        if not self.ckpt.available:
            if alloc.key not in self._unavailable_said:
                self._unavailable_said.add(alloc.key)  # said once: its shim asks again and again
                log.error(
                    "swap: %s is flagged swapped out but the driver's checkpoint API cannot be used here "
                    "(%s): its flags stay set and its processes wait; they come back once the API is "
                    "found again (looked for at most every %.0fs while they ask)",
                    alloc.who(),
                    self.ckpt.support.reason,
                    DETECT_RETRY,
                )
            raise Unavailable(f"{alloc.who()}: checkpoint API unavailable: {self.ckpt.support.reason}")
        if alloc.key in self._unavailable_said:
            self._unavailable_said.discard(alloc.key)
            log.warning("swap: the checkpoint API is available again: taking over %s", alloc.who())
        last = self._scans.get(alloc.key)
        if last is not None and last.alloc is alloc:
            wait = last.began + RESCAN_SPACING - time.monotonic()
            if wait > 0 and last.found is _Found.UNKNOWN:
                raise Unknown(f"the processes of {alloc.who()} cannot be found yet")
            if wait > 0 and last.found is _Found.NOTHING_HELD:
                return None
            if wait > 0:
                await asyncio.sleep(wait)
        scan = _Scan(alloc, time.monotonic(), _Found.TAKEN)  # until it concludes otherwise
        self._scans[alloc.key] = scan

        def find() -> tuple[list[tuple[int, SlotId, ProcessState]], set[SlotId]] | None:
            """(processes the driver holds, slots of processes it runs), or None when that
            cannot be told now."""
            pids = processes_of(alloc, self._peers)
            if pids is None:
                return None
            held: list[tuple[int, SlotId, ProcessState]] = []
            running: set[SlotId] = set()
            for pid in pids:
                state = process_state(pid, self.ckpt)
                ident = proc_identity(pid)
                if state in (ProcessState.CHECKPOINTING, ProcessState.RESTORING):
                    return None  # the driver is still moving it: look again later
                if ident is None:
                    continue  # exited
                if state in (ProcessState.LOCKED, ProcessState.CHECKPOINTED):
                    held.append((pid, ident, state))
                elif state in (ProcessState.RUNNING, None):  # None: the driver holds no CUDA state of it
                    running.add(ident)
            return held, running

        found = await asyncio.to_thread(find)
        if found is None:
            scan.found = _Found.UNKNOWN
            if alloc.key in self._unknown_said:
                raise Unknown(f"the processes of {alloc.who()} cannot be found yet")
            self._unknown_said.add(alloc.key)  # said once: its shim asks again and again
            log.warning(
                "swap: %s is flagged swapped out but its processes cannot be told yet (pod unknown, "
                "or the driver is still checkpointing or restoring one); its flags stay set",
                alloc.who(),
            )
            raise Unknown(f"the processes of {alloc.who()} cannot be found yet")
        self._unknown_said.discard(alloc.key)
        procs, running = found
        if not procs:
            scan.found = _Found.NOTHING_HELD
            # Nothing of it is held by the driver: clear the flags of the processes it runs.
            # A flagged slot whose process was not found keeps its flag (a dead process's slot
            # is freed, flag and all, by the shim; a live one asks again).
            want = {(int(s.pid), int(s.start_time)) for s in flagged}
            clear = sorted(want & running)
            if clear:
                try:
                    await asyncio.to_thread(set_swapped, alloc.directory, clear, 0)
                except (FormatError, OSError) as e:  # broken meanwhile: its shim asks again
                    log.warning("swap: cannot clear the swapped flags of %s: %s", alloc.who(), e)
            unfound = want - running
            if not unfound:
                await asyncio.to_thread(drop_size, alloc.directory)
            if unfound and alloc.key not in self._unfound_said:
                self._unfound_said.add(alloc.key)
                log.warning(
                    "swap: %s: slot(s) %s flagged swapped out name no process found in its cgroup; "
                    "their flags stay set",
                    alloc.who(),
                    sorted(unfound),
                )
            log.info(
                "swap: cleared %d stale swapped flag(s) of %s (the driver runs its processes)",
                len(clear),
                alloc.who(),
            )
            return None
        want = {(int(s.pid), int(s.start_time)) for s in flagged}
        stray = [pid for pid, ident, _ in procs if ident not in want]
        if stray:
            # Locked or checkpointed without a flag (its slot was reused, or the flag was
            # cleared): it comes back with the others, or it would stay blocked forever.
            log.warning("swap: %s has locked process(es) %s without a swapped flag", alloc.who(), stray)
        # Its size is what the previous agent recorded when it moved it, not the usage
        # file's total, which the container writes (a huge one would fill the host-RAM
        # budget, a small one bring its memory back without room for it). Without a record
        # (an agent that kept none), the file's total, never more than its limit.
        recorded = await asyncio.to_thread(read_size, alloc.directory)
        if recorded is None:
            recorded = min(int(usage.total_used), int(alloc.config.limit_bytes))
        entry = Swapped(
            alloc,
            alloc.gpus[0],
            recorded,
            tuple(p for p, _, _ in procs),
            tuple(ident for _, ident, _ in procs),
            needed_by="a previous agent",
        )
        # Every one of them flagged: its shim asks to come back on its next call.
        await asyncio.to_thread(set_swapped, alloc.directory, entry.slots, 1)
        log.info("swap: %s is swapped out (%s); taken over", alloc.who(), format_bytes(entry.bytes))
        return entry
