"""Reclaim at admission: a newly booked container's request must be physically free.

The device plugin admits a container against the GPU's unrequested memory, but the
arbiter may have lent that memory out as burst grants. When the ledger books a
container (Allocate) the agent starts taking it back; PreStartContainer (the kubelet
waits for it before starting the container) awaits that, bounded by PRESTART_WAIT.

Per GPU of the newcomer: shortfall = its request - (NVML free - grantMargin - what the
other containers may still charge within their request + grant) (Resolution.guarantee_shortfall,
arbiter/context.py).
To close it: unused grants are taken back at once, then the arbiter's guarantee chain
(Resolution.guarantee_chain: first the memory of containers holding no allocation on the GPU,
sidecars, gpufrac.agent.arbiter.unbooked; then the configured resolvers, with an evict step even where
the node config leaves it out) runs a Need of kind "reclaim" whose priority is above every pod's, so
evict admits any borrower, preemptible or not (preemptible ones first), and the newcomer is
first in line among waiters. Resolvers only ever win burst bytes (memory above a
container's request), so nobody's guarantee is touched, and never for memory hidden processes
hold on the GPU (Resolution.coverable: no container's, the watchdog's to kill): for that part
the newcomer waits.

If it cannot free enough (memory held outside gpufrac), the container still starts (a pod
start never fails for this): one log line, and a Warning Event on its pod naming who holds
the memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Protocol

from gpufrac.agent.arbiter.resolvers import Holding, Need
from gpufrac.agent.booking.ledger import ContainerAlloc
from gpufrac.agent.kube import events
from gpufrac.agent.kube.events import EventSink
from gpufrac.core.units import format_bytes

log = logging.getLogger(__name__)

RECLAIM_PRIORITY = 1 << 31  # above every pod priority (int32): a guarantee outranks any burst
PRESTART_WAIT = 20.0  # the kubelet gives PreStartContainer 30 s
EVENT_WAIT = 60.0  # how long a warning waits for the pod's identity before it is only logged
IDENTITY_POLL = 0.5


class Bookings(Protocol):
    """The ledger's bookings (gpufrac.agent.booking.ledger.Ledger)."""

    def containers(self) -> list[ContainerAlloc]: ...
    def get(self, key: str) -> ContainerAlloc | None: ...


class GrantView(Protocol):
    """What reclaiming a guarantee needs of the arbiter's resolution context
    (arbiter/context.py Resolution): the grants it lent out, NVML's free memory, and the chain
    that takes bursts back."""

    @property
    def ledger(self) -> Bookings: ...

    async def refresh_memory(self) -> None: ...
    def guarantee_shortfall(self, alloc: ContainerAlloc, gpu: str, inflight: int = 0) -> int | None: ...
    def hidden_bytes(self, gpu: str) -> int: ...
    def release_unused(self, alloc: ContainerAlloc) -> None: ...
    def holdings(self, gpu: str) -> list[Holding]: ...
    def reclaim_need(
        self, alloc: ContainerAlloc, gpu: str, missing: int, priority: int, deadline: float, inflight: int = 0
    ) -> Need: ...
    async def resolve_until(self, need: Need) -> bool: ...


class Admission:
    """Per-container reclaim tasks, started at Allocate and awaited at PreStartContainer.
    `arbiter`: the arbiter's resolution context; without an arbiter (None) no grants are lent,
    so there is nothing to take back.
    Warnings go to the pod through `events` (None without an apiserver: logged only)."""

    def __init__(self, arbiter: GrantView | None, ledger: Bookings, events: EventSink | None) -> None:
        self.arbiter = arbiter
        self.ledger = ledger
        self.events = events
        self._tasks: dict[str, asyncio.Task[list[str]]] = {}
        self._notices: set[asyncio.Task[None]] = set()

    def start(self, alloc: ContainerAlloc) -> None:
        """Allocate booked `alloc`: begin freeing its request (without delaying the reply)."""
        if self.arbiter is None:
            return  # no grants are handed out without an arbiter: nothing to take back
        old = self._tasks.get(alloc.key)
        if old is not None and not old.done():
            return
        self._tasks[alloc.key] = asyncio.create_task(self._secure(alloc), name=f"admit-{alloc.key}")

    async def prestart(self, alloc: ContainerAlloc) -> None:
        """Before the container starts: its request is free, or a warning says who holds it."""
        if self.arbiter is None:
            return
        task = self._tasks.get(alloc.key)
        if task is None or task.done():  # a container restart, or an agent restarted since Allocate
            self.start(alloc)
            task = self._tasks[alloc.key]
        try:
            short = await asyncio.wait_for(asyncio.shield(task), PRESTART_WAIT + 1.0)
        except asyncio.TimeoutError:
            short = [f"still reclaiming after {PRESTART_WAIT:.0f}s"]
        except Exception:
            log.exception("admission reclaim for %s failed", alloc.who())
            return
        finally:
            if task.done() and self._tasks.get(alloc.key) is task:
                del self._tasks[alloc.key]
        if short:
            message = (
                f"GPU memory of this container's request is held by other containers' bursts that could "
                f"not be reclaimed: {'; '.join(short)}. Its allocations within the request may fail "
                "until they free it."
            )
            log.warning("guarantee at risk for %s: %s", alloc.who(), "; ".join(short))
            notice = asyncio.create_task(self._warn(alloc.key, message), name=f"admit-warn-{alloc.key}")
            self._notices.add(notice)
            notice.add_done_callback(self._notices.discard)

    async def stop(self) -> None:
        for t in [*self._tasks.values(), *self._notices]:
            t.cancel()
        for t in [*self._tasks.values(), *self._notices]:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks.clear()

    async def _secure(self, alloc: ContainerAlloc) -> list[str]:
        """Free `alloc`'s request on each of its GPUs; what is still missing, per GPU (empty: all free)."""
        arb = self.arbiter
        assert arb is not None  # start() begins no reclaim without one
        deadline = asyncio.get_running_loop().time() + PRESTART_WAIT
        short: list[str] = []
        await arb.refresh_memory()
        for gpu in alloc.gpus:
            left = await reclaim_guarantee(arb, alloc, gpu, deadline)
            if left is None:
                short.append(f"GPU {gpu}: no NVML memory reading")
            elif left > 0:
                short.append(f"GPU {gpu}: {format_bytes(left)} missing, {self._holders(gpu, alloc)}")
        return short

    def _holders(self, gpu: str, alloc: ContainerAlloc) -> str:
        held = [
            f"{h.alloc.who()} holds {format_bytes(h.used - h.request)} above its request"
            f"{'' if h.preemptible else ' (not preemptible)'}"
            for h in (self.arbiter.holdings(gpu) if self.arbiter is not None else [])
            if h.alloc.key != alloc.key and h.used > h.request
        ]
        hidden = self.arbiter.hidden_bytes(gpu) if self.arbiter is not None else 0
        if hidden:
            held.append(
                f"hidden GPU processes (their cgroup file refused) hold {format_bytes(hidden)}, "
                "the watchdog's to kill, never taken from others"
            )
        return "; ".join(held) or "no container holds burst memory (memory used outside gpufrac?)"

    async def _warn(self, key: str, message: str) -> None:
        """The Warning Event on the newcomer's pod, once the agent knows which pod it is."""
        loop = asyncio.get_running_loop()
        until = loop.time() + EVENT_WAIT
        while loop.time() < until:
            alloc = self.ledger.get(key)
            if alloc is None:
                return  # released meanwhile
            if events.post(self.events, alloc, events.WARNING, events.REASON_GUARANTEE_AT_RISK, message):
                return
            await asyncio.sleep(IDENTITY_POLL)  # pod identity resolves shortly after admission
        log.warning("no Event posted for %s: its pod is not known", key)


async def reclaim_guarantee(
    arb: GrantView, alloc: ContainerAlloc, gpu: str, deadline: float, inflight: int = 0
) -> int | None:
    """Make `alloc`'s request on `gpu` physically free by taking burst memory back, until the loop
    time `deadline`. `inflight`: bytes `alloc` counts in its usage but the driver has not given it
    (an allocation it refused). Returns what is still missing: 0 all free, None no NVML reading.
    Used at admission (Admission) and when the shim's driver refused memory within the request
    (the arbiter's RECLAIM op)."""
    missing = arb.guarantee_shortfall(alloc, gpu, inflight)
    if missing is None or missing <= 0:
        return missing
    log.info(
        "%s of the request of %s on GPU %s is lent out as bursts; reclaiming",
        format_bytes(missing),
        alloc.who(),
        gpu,
    )
    for a in arb.ledger.containers():
        if gpu in a.gpus and a.key != alloc.key and a.config.grant_bytes > 0:
            arb.release_unused(a)  # a grant above what it uses: back at once

    need = arb.reclaim_need(alloc, gpu, missing, RECLAIM_PRIORITY, deadline, inflight)
    ok = await arb.resolve_until(need)
    return 0 if ok else max(arb.guarantee_shortfall(alloc, gpu, inflight) or 0, 1)
