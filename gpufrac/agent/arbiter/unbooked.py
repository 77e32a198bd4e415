"""A guarantee takes back first the GPU memory no allocation answers for there.

A container of a gpufrac pod that holds no allocation on a GPU (a sidecar that sees the GPUs,
or a container using a GPU it was not given) has a limit of 0 there and no allowance
(gpufrac.agent.watchdog.service.plan): every byte it holds there is booked to nobody, yet it takes
physical memory a neighbour was guaranteed. It is no burst (it holds no allocation for the
arbiter to weigh), so the evict and swap resolvers never see it, and before this step a
neighbour's allocation within its guarantee failed for it ("could not reclaim ... missing")
whenever the watchdog had not killed it yet, or would not (report mode).

So the chain a guarantee is reclaimed with (gpufrac.agent.arbiter.chain.build_guarantee_chain)
begins here: such processes on the GPU, newest first, are killed until what they held covers
what is missing, before any container's burst is touched; whatever the watchdog's mode, for
the guarantee is kept in every mode (docs/watchdog.md, "Report mode"). Each is killed through
a pidfd only while it is the process the driver listed (its start time) and still in that
container (gpufrac.agent.processes.kill.kill_if_seen), and announced by an Event on its pod. Nothing is
done on a GPU where a booking is not yet tied to its container: the memory may be that
container's (the watchdog waits there too).
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager
from typing import Protocol

from gpufrac.agent.arbiter.resolvers import Need, Outcome
from gpufrac.agent.gpu.truth import Unbooked
from gpufrac.agent.kube.events import REASON_EVICTED, WARNING, Booked, container_name
from gpufrac.agent.processes.kill import KillFailed
from gpufrac.core.units import format_bytes

log = logging.getLogger(__name__)


class UnbookedHost(Protocol):
    """What the step needs of the arbiter (its resolution context, arbiter/context.py)."""

    def unbooked(self, gpu: str, requester: str) -> list[Unbooked]: ...
    async def kill_unbooked(self, p: Unbooked) -> bool: ...
    async def refresh_memory(self) -> None: ...
    def claim(self, need: Need) -> AbstractContextManager[None]: ...
    def event(self, alloc: Booked, type_: str, reason: str, message: str) -> None: ...


class UnbookedResolver:
    """The first step of a guarantee's reclaim (kind "reclaim"; any other need is left alone)."""

    name = "unbooked"

    def __init__(self, host: UnbookedHost) -> None:
        self.host = host

    async def resolve(self, need: Need) -> Outcome:
        if need.kind != "reclaim":
            return Outcome()
        missing = need.shortfall()
        if missing <= 0:
            return Outcome()
        found = self.host.unbooked(need.gpu, need.requester.key)
        if not found:
            return Outcome()
        freed, killed = 0, 0
        with self.host.claim(need):
            for p in sorted(found, key=lambda p: (-p.proc.start, -p.proc.pid)):
                if freed >= missing:
                    break
                try:
                    gone = await self.host.kill_unbooked(p)
                except KillFailed as e:
                    log.error("could not kill process %d of %s: %s", p.proc.pid, p.owner.who(), e)
                    continue
                if not gone:
                    continue  # exited, or not that process any more: its memory is free or not its
                killed += 1
                freed += p.proc.used
                self._announce(p, need)
            if killed:
                await self.host.refresh_memory()
            satisfied = need.try_grant()
        if not killed:
            return Outcome(detail="no process holding memory without an allocation could be killed")
        return Outcome(
            freed=freed,
            satisfied=satisfied,
            detail=f"killed {killed} process(es) holding {format_bytes(freed)} without an allocation",
        )

    def _announce(self, p: Unbooked, need: Need) -> None:
        message = (
            f"process {p.proc.pid} of container {container_name(p.owner)} killed: it held "
            f"{format_bytes(p.proc.used)} of GPU memory on GPU {p.proc.gpu}, where the container holds "
            f"no gpufrac allocation (its limit there is 0), and {need.who()} needed "
            f"{format_bytes(need.bytes)} within its guarantee"
        )
        log.warning("%s: %s", p.owner.who(), message)
        self.host.event(p.owner, WARNING, REASON_EVICTED, message)
