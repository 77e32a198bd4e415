"""The arbiter's NVML cache: free memory per GPU and what each container's processes hold.

Grants rest on what the driver reports, read in a worker thread and kept for a moment: a
reading younger than NVML_FRESH is used as is (the common burst takes no task); an older one
starts a new reading; one older than NVML_STALE makes a request wait for the new one.

One reading at a time is under way, and each records when it was taken (its read began):
whoever needs a reading taken after some moment (`taken_since`: a RECLAIM after the driver
failed it, a kill, a swap) shares the one under way if it began late enough, else the next,
so a flood of such requests costs one reading per reading time, and an older sample never
replaces a newer one. How long a reading is used (NVML_FRESH, NVML_STALE) counts from when it
came in: a slow one must not be stale on arrival, or nothing could ever be decided on it.

The last readings of each container's processes are kept for a while (CONFIRM_WINDOW): memory
a container holds above its request without a grant makes it an eviction victim only if two
distinct readings at least CONFIRM_SPACING apart both show it (`steady_used`: the smaller of
the two), so a moment's spike (a module loaded lazily, a scratch buffer) is not taken for
ungranted memory, and a holder that stays above in both is caught whatever it does between.

What hidden processes hold (a GPU process whose cgroup file the kernel refuses:
gpufrac.agent.gpu.processes.Observed.hidden) is kept per GPU (`hidden_on`): that memory is no
container's, and no shortfall that evicts or swaps anyone covers it (Resolution.coverable).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Protocol

from gpufrac.agent.booking.ledger import ContainerAlloc
from gpufrac.agent.gpu import truth
from gpufrac.agent.gpu.processes import Lookup, Observed

log = logging.getLogger(__name__)

NVML_FRESH = 0.1  # an NVML reading younger than this is used as is
NVML_STALE = 1.0  # older than this, a request waits for a new one
# Two process readings this far apart, both showing a container above request + grant, rule
# out a moment's spike; readings older than CONFIRM_WINDOW are no longer used for that.
CONFIRM_SPACING = 0.2
CONFIRM_WINDOW = 10.0


class MemoryReading(Protocol):
    """One GPU's memory as NVML reports it (gpufrac.agent.gpu.inventory.MemoryUsage)."""

    @property
    def free(self) -> int: ...


ReadMemory = Callable[[], Mapping[str, MemoryReading]]
ReadProcesses = Callable[[], list[Observed]]


class DriverReadings:
    """The latest NVML reading, renewed on demand. `on_reading` runs after each one (a fresh
    reading may let waiters in that a stale one kept out). `allowance`: one per pod and GPU,
    shared by its containers holding an allocation there: what NVML counts and the shim does
    not (contexts, lazily loaded modules: docs/watchdog.md, truth.DriverUsage.less_allowance)."""

    def __init__(
        self,
        read_memory: ReadMemory,
        read_processes: ReadProcesses,
        lookup: Lookup,
        allowance: int,
        on_reading: Callable[[], None],
    ) -> None:
        self.read_memory = read_memory
        # NVML's processes with their cgroups (gpufrac.agent.gpu.truth): what each container holds.
        self.read_processes = read_processes
        self._lookup = lookup
        self.allowance = allowance
        self._on_reading = on_reading
        self.memory: Mapping[str, MemoryReading] | None = None
        self.driver: truth.DriverUsage | None = None
        self.at = -1e9  # time.monotonic() when the current reading was taken (its read began)
        self._landed = -1e9  # ... and when it came in (how long it is used counts from here)
        # (time taken, reading) of the recent process readings, oldest first.
        self._past: deque[tuple[float, truth.DriverUsage]] = deque()
        self._task: asyncio.Task[None] | None = None  # the reading under way, if any
        self._attributed: set[str] = set()  # GPUs where the reading gives a container memory
        self._hidden: dict[str, int] = {}  # GPU -> what hidden processes hold there (last reading)
        self._confirm: asyncio.Task[None] | None = None  # second_reading's, shared
        self._error_logged = False
        self._driver_error_logged = False

    def free(self, gpu: str) -> int | None:
        """NVML's free memory on `gpu` in the last reading; None without one."""
        mem = (self.memory or {}).get(gpu)
        return None if mem is None else int(mem.free)

    def hidden_on(self, gpu: str) -> int:
        """What NVML counts for hidden processes on `gpu` in the last process reading (0
        without one): memory that is nobody's, the watchdog's to kill (enforce mode) or report."""
        return self._hidden.get(gpu, 0)

    def unbooked_on(self, gpu: str) -> list[truth.Unbooked]:
        """The processes on `gpu` of containers holding no allocation there, in the last process
        reading (none without a recent one): memory booked to nobody (gpufrac.agent.arbiter.unbooked)."""
        if self.driver is None or time.monotonic() - self._landed > NVML_STALE:
            return []
        return list(self.driver.unbooked.get(gpu, ()))

    def ready(self) -> bool:
        """Whether the reading may be used now; starts a new one if it is getting old."""
        age = time.monotonic() - self._landed
        if age <= NVML_FRESH:
            return True
        self.refresh_soon()
        return age <= NVML_STALE

    async def fresh(self) -> None:
        """A usable reading (waits for a new one only when the last is stale)."""
        if not self.ready():
            assert self._task is not None
            await asyncio.shield(self._task)

    def refresh_soon(self) -> None:
        """Start a new reading now unless one is under way."""
        if self._task is None or self._task.done():
            self._begin()

    def _begin(self) -> asyncio.Task[None]:
        self._task = asyncio.create_task(self._reading(time.monotonic()))
        return self._task

    async def taken_since(self, t: float) -> None:
        """Until the current reading was taken at `t` (time.monotonic()) or later: the
        reading under way if it began by then, else the next one, shared with every caller
        that waits meanwhile (a reading at a time)."""
        while self.at < t:
            wait = t - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)  # again if the loop's timer woke it a hair early
                continue
            task = self._task
            if task is None or task.done():
                task = self._begin()
            # One that began before `t` is waited out (it may predate what the caller needs
            # to see), and the next one begins after it.
            await asyncio.shield(task)

    def driver_used(self, alloc: ContainerAlloc) -> int | None:
        """What NVML counts for the container's processes on its GPU, less its part of its pod's
        allowance (gpufrac.agent.gpu.truth); None without a recent process reading (decisions take
        a fresh one first; a stale count must not hold a grant that was given back)."""
        if self.driver is None or time.monotonic() - self._landed > NVML_STALE:
            return None
        return max(0, self.driver.less_allowance(alloc.key, alloc.gpus[0], self.allowance))

    def driver_total(self, alloc: ContainerAlloc) -> int | None:
        """What NVML counts for the container's processes on its GPU, all of it (the most it
        can be said to use: what taking back its unused grant is judged on). None without a
        recent process reading, or while NVML gives no container's process on that GPU any
        memory: where it cannot attribute memory to processes (it reports them, memory
        unavailable, counted 0) a 0 says nothing, and a grant in use must not look unused."""
        gpu = alloc.gpus[0]
        if self.driver is None or time.monotonic() - self._landed > NVML_STALE or gpu not in self._attributed:
            return None
        return self.driver.bytes_of(alloc.key, gpu)

    def whole_count(self, alloc: ContainerAlloc) -> int | None:
        """What NVML counts for the container's processes on its GPU, all of it, where what
        the container holds lowers what is taken from others (a reclaim's requester; what a
        neighbour may still charge within its request + grant). The allowance makes a holder
        look smaller, conservative toward a victim; there it is the wrong side (a zeroed
        counter would overstate the shortfall by as much). Where `driver_total` has no figure
        (no recent reading: None; memory NVML cannot attribute: 0) this is `driver_used`'s."""
        total = self.driver_total(alloc)
        return total if total is not None else self.driver_used(alloc)

    def steady_used(self, alloc: ContainerAlloc) -> int | None:
        """What NVML counted for the container in BOTH the current process reading and the
        newest one taken at least CONFIRM_SPACING before it (the smaller, less its part of its
        pod's allowance); None without two such readings (gpufrac.agent.arbiter.resolvers.EvictResolver
        then asks for a second one: `second_reading`)."""
        if self.driver is None or not self._past or time.monotonic() - self._landed > NVML_STALE:
            return None
        at, now = self._past[-1]
        earlier = next((d for t, d in reversed(self._past) if t <= at - CONFIRM_SPACING), None)
        if now is not self.driver or earlier is None:
            return None
        gpu = alloc.gpus[0]
        return max(0, min(d.less_allowance(alloc.key, gpu, self.allowance) for d in (now, earlier)))

    async def second_reading(self) -> None:
        """A new reading at least CONFIRM_SPACING after the last one (a distinct sample of the
        driver: a spike seen in the last one has had time to end). One for every caller that
        asks meanwhile: a flood of reclaims must not multiply the driver's readings."""
        if self._confirm is None or self._confirm.done():
            self._confirm = asyncio.create_task(self._confirm_reading())
        await asyncio.shield(self._confirm)

    async def _confirm_reading(self) -> None:
        await self.taken_since(self.at + CONFIRM_SPACING)

    def _read(self) -> tuple[Mapping[str, MemoryReading], list[Observed] | Exception]:
        """Blocking: NVML's memory per GPU, then its processes with their cgroups."""
        mem = self.read_memory()
        try:
            procs: list[Observed] | Exception = self.read_processes()
        except Exception as e:
            procs = e
        return mem, procs

    async def refresh(self) -> None:
        """A reading taken from now on (shared with others who asked meanwhile)."""
        await self.taken_since(time.monotonic())

    async def _reading(self, taken: float) -> None:
        """One reading in a worker thread, begun at `taken`."""
        try:
            memory, procs = await asyncio.to_thread(self._read)
        except Exception as e:
            if taken < self.at:
                return
            self.memory = None  # no reading, no grants
            self.driver = None
            self.at, self._landed = taken, time.monotonic()
            if not self._error_logged:
                self._error_logged = True
                log.error("arbiter: NVML memory reading failed, bursts are refused until it works: %s", e)
        else:
            if taken < self.at:
                return  # an older sample never replaces a newer one
            self.memory, self.at, self._landed = memory, taken, time.monotonic()
            self._error_logged = False
            self._take_processes(procs, taken)
        self._on_reading()

    def _take_processes(self, procs: list[Observed] | Exception, taken: float) -> None:
        """A new per-process reading, taken at `taken`: each container's driver count."""
        if isinstance(procs, Exception):
            self._hidden = {}
            self.driver = None  # until it works: reclaims refused, other decisions use the files (clamped)
            if not self._driver_error_logged:
                self._driver_error_logged = True
                log.error(
                    "arbiter: NVML per-process reading failed; reclaims are refused and usage files "
                    "(clamped) are trusted until it works: %s",
                    procs,
                )
            return
        self._driver_error_logged = False
        self.driver = truth.attribute(procs, self._lookup)
        self._attributed = {gpu for (_, gpu), n in self.driver.by_container.items() if n > 0}
        hidden: dict[str, int] = {}
        for o in procs:
            if o.hidden:
                hidden[o.proc.gpu] = hidden.get(o.proc.gpu, 0) + o.proc.used
        self._hidden = hidden
        self._past.append((taken, self.driver))
        while self._past and taken - self._past[0][0] > CONFIRM_WINDOW:
            self._past.popleft()
