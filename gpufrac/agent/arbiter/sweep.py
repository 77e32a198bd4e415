"""The grant sweep: every RECLAIM_INTERVAL, grants come back that the shims did not give back
themselves: at once when a container's grant_returned counter moved (a process released its
grant on exit), after GRANT_STALE_AFTER when a grant lies unused (grants.GrantSweep decides).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

from gpufrac.agent.arbiter.grants import GrantSweep
from gpufrac.agent.ledger import ContainerAlloc
from gpufrac.core.units import format_bytes
from gpufrac.memguard import abi

log = logging.getLogger(__name__)

RECLAIM_INTERVAL = 1.0  # seconds between two sweeps


def sweep(
    containers: Iterable[ContainerAlloc],
    usage_of: Callable[[ContainerAlloc], abi.UsageStruct | None],
    driver_used: Callable[[ContainerAlloc], int | None],
    release: Callable[[ContainerAlloc], object],
    state: GrantSweep,
    now: float,
) -> None:
    """One sweep over the booked containers: `release` takes back what each does not use."""
    for alloc in containers:
        u = usage_of(alloc)
        if u is None:
            continue
        g = alloc.config.grant_bytes
        if state.returned_now(alloc.key, int(u.grant_returned)) and g > 0:
            release(alloc)
            continue
        if g <= 0:
            state.used(alloc.key)
            continue
        unused = alloc.request_bytes + g - max(int(u.total_used), driver_used(alloc) or 0)
        if state.stale(alloc.key, unused, now):
            log.info("taking back %s of unused grant from %s", format_bytes(unused), alloc.who())
            release(alloc)


async def sweep_forever(once: Callable[[], None]) -> None:
    """`once` every RECLAIM_INTERVAL until cancelled; a failed sweep is logged, the next runs."""
    while True:
        await asyncio.sleep(RECLAIM_INTERVAL)
        try:
            once()
        except Exception:
            log.exception("arbiter: grant sweep failed")
