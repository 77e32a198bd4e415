"""Taking over containers a previous agent swapped out (the swap resolver's start, and a
SWAP_IN from a container this agent did not swap).

Its usage slots say `swapped`, but that file is the container's to write: what is believed
is the driver's checkpoint state of the processes found in its cgroup, and the size the
previous agent recorded (gpufrac.agent.swap_files). Blocking reads go to worker threads.
"""

from __future__ import annotations

import asyncio
import logging

from gpufrac.agent.activity import proc_identity
from gpufrac.agent.callers import PeerLookup
from gpufrac.agent.cuda_checkpoint import Checkpointer, ProcessState, process_state
from gpufrac.agent.ledger import ContainerAlloc
from gpufrac.agent.swap_files import (
    SlotId,
    Swapped,
    clear_all_flags,
    drop_size,
    processes_of,
    read_size,
    set_swapped,
)
from gpufrac.core.units import format_bytes
from gpufrac.memguard import abi
from gpufrac.memguard.abi import FormatError

log = logging.getLogger("gpufrac.agent.swap")  # one logger for everything the swap resolver does


class Unknown(Exception):
    """A container's processes cannot be found now: nothing about its swap state may be
    concluded (its flags stay as they are)."""


class Takeover:
    def __init__(self, ckpt: Checkpointer, peers: PeerLookup) -> None:
        self.ckpt = ckpt
        self._peers = peers
        self._unknown_said: set[str] = set()  # containers whose processes could not be told apart yet

    async def rediscover(self, alloc: ContainerAlloc) -> Swapped | None:
        """A container flagged swapped that this agent did not swap (a previous agent did):
        its locked or checkpointed processes become a Swapped entry again. Its flags are
        cleared only once its processes are known (by cgroup) and the driver reports none of
        them locked or checkpointed: a flag cleared over a locked process leaves that process
        blocked in the driver with nobody to ask for it. Unknown when its processes cannot
        be found yet."""
        try:
            usage = await asyncio.to_thread(abi.read_usage, alloc.directory)
        except FormatError:
            return None
        flagged = [s for s in usage.slots if s.pid > 0 and s.swapped]
        if not flagged:
            return None
        if not self.ckpt.available:
            # No checkpoint API: nothing here can have been checkpointed by us (flags a
            # container set on itself, its usage file being writable to it).
            n = await asyncio.to_thread(clear_all_flags, alloc.directory)
            await asyncio.to_thread(drop_size, alloc.directory)
            log.info("swap: cleared %d swapped flag(s) of %s (no checkpoint API here)", n, alloc.who())
            return None

        def find() -> list[tuple[int, SlotId, ProcessState]] | None:
            pids = processes_of(alloc, self._peers)
            if pids is None:
                return None
            out: list[tuple[int, SlotId, ProcessState]] = []
            for pid in pids:
                state = process_state(pid, self.ckpt)
                ident = proc_identity(pid)
                if state in (ProcessState.CHECKPOINTING, ProcessState.RESTORING):
                    return None  # the driver is still moving it: look again later
                if ident is not None and state in (ProcessState.LOCKED, ProcessState.CHECKPOINTED):
                    out.append((pid, ident, state))
            return out

        procs = await asyncio.to_thread(find)
        if procs is None:
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
        if not procs:
            n = await asyncio.to_thread(clear_all_flags, alloc.directory)
            await asyncio.to_thread(drop_size, alloc.directory)
            log.info(
                "swap: cleared %d stale swapped flag(s) of %s (no process of it is locked)", n, alloc.who()
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
