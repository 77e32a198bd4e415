"""The grant sweep: every RECLAIM_INTERVAL, grants come back that the shims did not give back
themselves: at once when a container's grant_returned counter moved (a process released its
grant on exit), after GRANT_STALE_AFTER when a grant lies unused (grants.GrantSweep decides).

"Unused" is judged on the driver's count (NVML, all of it: the most the container can be said
to hold), not on the usage file, which is the tenant's to write: a counter kept at request +
grant must not keep a grant nobody uses out of its neighbours' reach forever. Taking back a
grant costs only its holder, so the larger-of rule of gpufrac.agent.gpu.truth (for decisions that
cost others) does not apply here. The file is used only without a reading (NVML failing).
Managed pages resident in host RAM are in the file, not in NVML's count: a grant only they
hold is taken back too (docs/arbiter-protocol.md says why that is right).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable

from gpufrac.agent.arbiter.grants import GrantSweep
from gpufrac.agent.booking.ledger import ContainerAlloc
from gpufrac.core.units import format_bytes
from gpufrac.memguard import abi

log = logging.getLogger(__name__)

RECLAIM_INTERVAL = 1.0  # seconds between two sweeps
# A sweep judges on a driver reading at most this old (the sweep takes one if needed): younger
# than readings.NVML_STALE, past which the driver's count is not used.
READING_AGE = 0.5


def sweep(
    containers: Iterable[ContainerAlloc],
    usage_of: Callable[[ContainerAlloc], abi.UsageStruct | None],
    driver_total: Callable[[ContainerAlloc], int | None],
    release: Callable[[ContainerAlloc, int | None], object],
    state: GrantSweep,
    now: float,
) -> None:
    """One sweep over the booked containers: `release(alloc, used)` lowers each grant to what
    the container uses (`used`; None: as the arbiter counts it). `driver_total`: NVML's whole
    count for a container, None without a recent reading."""
    for alloc in containers:
        u = usage_of(alloc)
        g = alloc.config.grant_bytes
        if u is not None and state.returned_now(alloc.key, int(u.grant_returned)) and g > 0:
            release(alloc, None)
            continue
        if g <= 0:
            state.used(alloc.key)
            continue
        driver = driver_total(alloc)
        if driver is not None:
            held = driver
        elif u is not None:
            held = int(u.total_used)
        else:
            continue  # neither the driver nor its file says anything: judged next time
        unused = alloc.request_bytes + g - held
        if state.stale(alloc.key, unused, now):
            log.info("taking back %s of unused grant from %s", format_bytes(unused), alloc.who())
            release(alloc, held)


async def sweep_forever(once: Callable[[], None], reading: Callable[[], Awaitable[None]]) -> None:
    """`once` every RECLAIM_INTERVAL until cancelled, after `reading` (a driver reading recent
    enough to judge on); a failed sweep is logged, the next runs."""
    while True:
        await asyncio.sleep(RECLAIM_INTERVAL)
        try:
            await reading()
            once()
        except Exception:
            log.exception("arbiter: grant sweep failed")
