"""Compute shares on the agent's loop: each control period, the driver's per-process utilisation,
attributed to containers by the kernel's cgroups, goes through the controller
(gpufrac.agent.compute.control) to the launch paces in the containers' configs (docs/compute.md).

What a container is measured by is what the driver says its processes ran (NVML's per-process
utilisation, the agent's one reader: gpufrac.agent.gpu.utilisation), each process placed in a
container by its cgroup (a tenant can write neither). A container's usage file gives only the
launches of the period, which seed the first pace of a container about to be held back: a lie
there slows or speeds its own first pace, and the next period corrects it from the driver.

Reading NVML, the cgroups and the usage files blocks: that part runs in a worker thread; the
controller, the paces (a store in each mapped config) and the Events run on the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from gpufrac.agent.booking.ledger import ContainerAlloc
from gpufrac.agent.compute import control, hold
from gpufrac.agent.gpu.utilisation import UtilisationFeed
from gpufrac.agent.kube import events
from gpufrac.agent.kube.events import EventSink
from gpufrac.agent.processes.callers import CgroupIdentity, ContainerOwner
from gpufrac.agent.processes.placements import Placements
from gpufrac.core.annotations import ContainerPolicy, memory_share
from gpufrac.core.config import Config
from gpufrac.core.policy import compute_mode
from gpufrac.core.slices import GpuGeometry
from gpufrac.memguard import abi

log = logging.getLogger(__name__)

SMOOTH = 0.2  # weight of the newest period in a container's shown use (about a second's average)
AT_REST = 1e-3  # a shown or remembered use this small is 0 (a GPU whose every figure is so is at rest)
# A node at rest is looked at whole (its containers, shares, Events) once in this many periods;
# in the others the driver alone is asked whether anything ran, and the first that did is whole.
REST_PERIODS = 10


class Bookings(Protocol):
    """The containers and their GPUs (gpufrac.agent.booking.ledger.Ledger), and where a pace goes."""

    @property
    def geometry(self) -> Mapping[str, GpuGeometry]: ...

    def containers(self) -> Sequence[ContainerAlloc]: ...

    def set_compute_pace(self, key: str, pace_ns: int) -> None: ...


class Policies(Protocol):
    """Each container's policy, its compute share among it (gpufrac.agent.booking.pods.PodIdentity)."""

    def policy(self, key: str) -> ContainerPolicy | None: ...


class Owners(Protocol):
    """Which container a kubelet container is (gpufrac.agent.processes.callers.PeerLookup)."""

    def owner(self, pod_uid: str, container_id: str) -> ContainerOwner | None: ...


@dataclass(frozen=True)
class ComputeFigures:
    """One container's compute share as the status and the metrics show it."""

    share: float  # of its GPU, 0..1
    mode: str  # fair or strict
    used: float  # its measured use of the GPU, about the last second (0..1)
    target: float  # what it may use now (0..1)
    pace_ns: int  # 0: its launches are not held
    throttled_s: float  # time its launches were paced, since the agent started
    unheld: bool  # over what it may use though paced to the slowest (docs/compute.md)
    hold: float  # share of each period its GPU processes are stopped (unheld only)


@dataclass
class _Reading:
    """The driver's part of a period (blocking): its samples, and where the kernel places the
    processes they name."""

    samples: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # GPU -> (pid, SM %)
    cgroups: dict[int, CgroupIdentity | None] = field(default_factory=dict)


class ComputeLoop:
    """Holds the containers on each GPU to their compute shares. Owned by the agent's loop."""

    def __init__(
        self,
        cfg: Config,
        bookings: Bookings,
        policies: Policies,
        owners: Owners,
        feed: UtilisationFeed,
        events_sink: EventSink | None = None,
    ) -> None:
        self.cfg = cfg
        self.bookings = bookings
        self.policies = policies
        self.owners = owners
        self.feed = feed
        self.events = events_sink
        self.interval = cfg.compute.interval
        self._state: dict[str, control.Paced] = {}
        self._written: dict[str, int] = {}  # the pace last written in each container's config
        self._launches: dict[str, int] = {}  # each container's launch count at the last reading
        self._figures: dict[str, ComputeFigures] = {}
        self._smoothed: dict[str, float] = {}
        self._told_overcommit: dict[str, frozenset[str]] = {}  # GPU -> the shares it was told for
        self._told_pod: dict[str, frozenset[str]] = {}  # container -> the shares its pod was told about
        self._told_unheld: set[str] = set()
        self._pids: dict[str, list[tuple[int, CgroupIdentity]]] = {}  # this period's GPU processes
        self._held: set[tuple[int, ...]] = set()  # pidfds of processes stopped now (hold.stop)
        self._stopping: set[asyncio.Future[list[int]]] = set()  # hold.stop calls under way
        self._failing: str | None = None  # the error the last failed period logged
        self._last: float | None = None
        self._met: set[str] = set()  # containers whose launch count was read at least once
        # GPU -> its tenants when a period found it quiet: nothing ran on it, nobody is paced, every
        # figure is at rest. Its next periods are skipped while it stays so (the decisions stand).
        self._quiet: dict[str, tuple[control.Tenant, ...]] = {}
        self._placements = Placements()
        # A node at rest (every shared GPU quiet): the periods left before the next whole one,
        # and what its periods poll meanwhile (every GPU holding a container; the shared ones).
        self._rest_left = 0
        self._keys: list[str] = []  # the containers booked at the last whole period
        self._watched: list[str] = []
        self._shared: frozenset[str] = frozenset()
        feed.driven = True

    # -- what others read --------------------------------------------------------------------

    def figures(self, key: str) -> ComputeFigures | None:
        return self._figures.get(key)

    # -- the period --------------------------------------------------------------------------

    async def run(self) -> None:
        while True:
            started = time.monotonic()
            try:
                await self.tick()
            except Exception as e:  # one bad period must not end compute shares; said once a kind
                if str(e) != self._failing:
                    self._failing = str(e)
                    log.exception("compute shares: a control period failed")
            else:
                if self._failing is not None:
                    log.info("compute shares: control periods run again")
                    self._failing = None
            await asyncio.sleep(max(0.0, self.interval - (time.monotonic() - started)))

    def tenants(self) -> dict[str, list[tuple[control.Tenant, ContainerAlloc]]]:
        """The containers sharing each GPU, with their shares and modes. Whole GPUs are their
        containers' own: never paced."""
        out: dict[str, list[tuple[control.Tenant, ContainerAlloc]]] = {}
        for a in self.bookings.containers():
            if a.whole_gpu or len(a.gpus) != 1:
                continue
            gpu = a.gpus[0]
            geo = self.bookings.geometry.get(gpu)
            if geo is None:
                continue
            policy = self.policies.policy(a.key)
            share = policy.compute_share if policy is not None else None
            if share is None:
                share = memory_share(a.request_bytes, geo.allocatable)
            mode = compute_mode(self.cfg.policy, a.namespace or "", self.cfg.compute.mode)
            out.setdefault(gpu, []).append((control.Tenant(a.key, share, mode == "strict"), a))
        return out

    async def tick(self) -> list[control.Decision]:
        now = time.monotonic()
        period = self.interval if self._last is None else max(1e-3, now - self._last)
        self._last = now
        reading = None
        booked = self.bookings.containers()
        keys = [a.key for a in booked]
        if self._rest_left > 0 and keys == self._keys:
            # The node at rest, its containers the same: the driver alone is asked whether
            # anything ran on a shared GPU.
            reading = await asyncio.to_thread(self._read, self._watched, place=False)
            if not any(sm > 0 for gpu in self._shared for _, sm in reading.samples.get(gpu, ())):
                self._rest_left -= 1
                return []
            # Something ran: a whole period now, on this reading (a second one would cut the
            # driver's sample short), its processes placed first.
            pids = {pid for samples in reading.samples.values() for pid, _ in samples}
            reading.cgroups = await asyncio.to_thread(self._placements.lookup, pids)
        # A container booked or released ends a rest at once: its GPU may be one not watched.
        self._rest_left = 0
        self._keys = keys
        on_gpu = self.tenants()
        allocs = {a.key: a for pairs in on_gpu.values() for _, a in pairs}
        # Every GPU holding a container is read, whole GPUs too: the activity tracker's view of
        # the feed gets its samples from these reads alone.
        self._watched = sorted({g for a in booked for g in a.gpus})
        self._shared = frozenset(on_gpu)
        if reading is None:
            reading = await asyncio.to_thread(self._read, self._watched)
        used = self._attribute(reading)
        # Launch counts where they can shape a pace: a container that ran something this period
        # (a pace's first length comes from its recent launches), one that is paced, and each
        # one once at first sight (the count its first busy period is measured from). An idle
        # container's count does not move while the driver sees it run nothing, so the next
        # reading's difference is that period's launches.
        need = {
            k: a.directory for k, a in allocs.items() if used.get(k) or k not in self._met or self._paced(k)
        }
        counts = await asyncio.to_thread(self._read_launches, need) if need else {}
        self._met.update(need)
        decisions: list[control.Decision] = []
        for gpu, pairs in on_gpu.items():
            self._overcommit(gpu, pairs)
            tenants = tuple(t for t, _ in pairs)
            if self._quiet.get(gpu) == tenants and not any(used.get(t.key) for t in tenants):
                continue  # nothing ran on it and nothing is held back: the decisions stand
            made = control.step(tenants, used, self._launch_deltas(counts, tenants), period, self._state)
            decisions += made
            allocs_here = {a.key: a for _, a in pairs}
            for d in made:
                self._apply(d, allocs_here[d.key])
                if d.hold > 0 and self._pids.get(d.key):
                    await self._hold(self._pids[d.key], d.hold * period)
            if self._at_rest(tenants):
                self._quiet[gpu] = tenants
            else:
                self._quiet.pop(gpu, None)
        for gpu in set(self._quiet) - set(on_gpu):
            del self._quiet[gpu]
        if self._quiet.keys() == on_gpu.keys():  # every shared GPU quiet: the node is at rest
            self._rest_left = REST_PERIODS - 1
        gone = set(self._state) - set(allocs)
        for key in gone:
            self._forget(key)
        return decisions

    def _paced(self, key: str) -> bool:
        p = self._state.get(key)
        return p is not None and p.pace_ns > 0

    @property
    def at_rest(self) -> bool:
        """Whether the node is at rest: its next periods ask the driver alone (tests read it)."""
        return self._rest_left > 0

    def _at_rest(self, tenants: Sequence[control.Tenant]) -> bool:
        """Whether another period with nothing running would change nothing that matters: no
        one paced, held or using the GPU, every shown use, remembered free use and hold about 0
        (an unheld container's hold fades while it is idle, as the periods skipped would)."""
        for t in tenants:
            p = self._state.get(t.key)
            if p is None or p.pace_ns or p.last_used or (p.free_use or 0.0) > AT_REST or p.hold > AT_REST:
                return False
            if self._smoothed.get(t.key, 1.0) > AT_REST:
                return False
        return True

    def _read(self, gpus: Sequence[str], place: bool = True) -> _Reading:
        """The blocking part: NVML (through the feed) and, with `place`, the cgroups of the
        processes it sampled (kept per process: gpufrac.agent.processes.placements)."""
        out = _Reading()
        for gpu in gpus:
            out.samples[gpu] = [(s.pid, s.sm) for s in self.feed.poll(gpu)]
        if not place:
            return out
        pids = {pid for samples in out.samples.values() for pid, _ in samples}
        if pids:
            out.cgroups = self._placements.lookup(pids)
        return out

    @staticmethod
    def _read_launches(dirs: Mapping[str, str]) -> dict[str, int]:
        """Each container's launch count, from its usage file (blocking); a broken file gives
        none (it seeds no pace: the first pace is the default one)."""
        out: dict[str, int] = {}
        for key, directory in dirs.items():
            try:
                usage = abi.read_usage(directory)
            except abi.FormatError:
                continue
            out[key] = sum(int(s.launches) for s in abi.live_slots(usage))
        return out

    def _attribute(self, reading: _Reading) -> dict[str, float]:
        """Each container's use of its GPU in the period: its processes' samples (the mean of a
        process's samples, NVML's percent of the period), the processes placed by their cgroups."""
        used: dict[str, float] = {}
        self._pids = {}
        for gpu, samples in reading.samples.items():
            per_pid: dict[int, list[int]] = {}
            for pid, sm in samples:
                per_pid.setdefault(pid, []).append(sm)
            for pid, sms in per_pid.items():
                ident = reading.cgroups.get(pid)
                owner = self.owners.owner(ident.pod_uid, ident.container_id) if ident else None
                mine = owner.holding(gpu) if owner is not None else ()
                if mine and ident is not None:
                    key = mine[0].key
                    used[key] = min(1.0, used.get(key, 0.0) + sum(sms) / len(sms) / 100)
                    self._pids.setdefault(key, []).append((pid, ident))
        return used

    def _launch_deltas(self, counts: Mapping[str, int], tenants: Sequence[control.Tenant]) -> dict[str, int]:
        """The launches since each container's count was last read (an idle one's is not
        read: see tick)."""
        out: dict[str, int] = {}
        for key in (t.key for t in tenants):
            now = counts.get(key)
            before = self._launches.get(key)
            if now is not None:
                self._launches[key] = now
                if before is not None and now >= before:
                    out[key] = now - before
        return out

    def _apply(self, d: control.Decision, alloc: ContainerAlloc) -> None:
        if self._written.get(d.key) != d.pace_ns:  # and at first sight
            self.bookings.set_compute_pace(d.key, d.pace_ns)
            self._written[d.key] = d.pace_ns
        shown = self._smoothed.get(d.key)
        shown = d.used if shown is None else (1 - SMOOTH) * shown + SMOOTH * d.used
        self._smoothed[d.key] = shown
        state = self._state[d.key]
        self._figures[d.key] = ComputeFigures(
            share=d.share,
            mode="strict" if d.strict else "fair",
            used=shown,
            target=d.target,
            pace_ns=d.pace_ns,
            throttled_s=state.paced_s,
            unheld=d.unheld,
            hold=d.hold,
        )
        if d.unheld and d.key not in self._told_unheld:
            self._told_unheld.add(d.key)
            message = (
                f"container {events.container_name(alloc)} uses {d.used * 100:.0f}% of GPU {alloc.gpus[0]} "
                f"where its compute share allows {d.target * 100:.0f}%, though its launches are paced to the "
                "slowest: its processes launch work without gpufrac's shim (or work no launch pace holds); "
                "its GPU processes are stopped for part of each period from now on"
            )
            log.warning("%s", message)
            events.post(self.events, alloc, events.WARNING, events.REASON_COMPUTE_UNHELD, message)
        elif not d.unheld:
            self._told_unheld.discard(d.key)

    def _overcommit(self, gpu: str, pairs: Sequence[tuple[control.Tenant, ContainerAlloc]]) -> None:
        """A Warning, on the Node and on each pod of the GPU (once its pod is known), when the
        GPU's shares cannot all be met; once for each set of shares."""
        total = control.overcommitted([t for t, _ in pairs])
        if not total:
            self._told_overcommit.pop(gpu, None)
            return
        told = frozenset(f"{t.key}={t.share:.4f}" for t, _ in pairs)
        message = (
            f"compute shares on GPU {gpu} sum to {total * 100:.0f}% ("
            + ", ".join(f"{events.container_name(a)} {t.share * 100:.0f}%" for t, a in pairs)
            + f"): under contention each gets its share scaled to {100 / total:.0f}% of it"
        )
        if self._told_overcommit.get(gpu) != told:
            self._told_overcommit[gpu] = told
            log.warning("%s", message)
            events.post_node(
                self.events, self.cfg.node_name, events.WARNING, events.REASON_COMPUTE_OVERCOMMITTED, message
            )
        for _, a in pairs:
            if self._told_pod.get(a.key) != told and events.post(
                self.events, a, events.WARNING, events.REASON_COMPUTE_OVERCOMMITTED, message
            ):
                self._told_pod[a.key] = told

    def _forget(self, key: str) -> None:
        self._state.pop(key, None)
        self._written.pop(key, None)
        self._launches.pop(key, None)
        self._met.discard(key)
        self._figures.pop(key, None)
        self._smoothed.pop(key, None)
        self._told_pod.pop(key, None)
        self._told_unheld.discard(key)

    async def _hold(self, processes: Sequence[tuple[int, CgroupIdentity]], seconds: float) -> None:
        """Stop an unheld container's GPU processes now, and continue them `seconds` later."""
        # The stop runs on in its thread if this task is cancelled (the agent stopping): kept
        # here until it is done, so that close() continues what it stopped, never leaving a
        # tenant's processes stopped for good.
        stopping = asyncio.get_running_loop().run_in_executor(None, hold.stop, processes)
        self._stopping.add(stopping)
        fds = tuple(await asyncio.shield(stopping))
        self._stopping.discard(stopping)
        if not fds:
            return
        self._held.add(fds)

        def resume() -> None:
            if fds in self._held:
                self._held.discard(fds)
                asyncio.get_running_loop().run_in_executor(None, hold.resume, fds)

        asyncio.get_running_loop().call_later(seconds, resume)

    async def close(self) -> None:
        """Lift every pace this loop set and continue every process it stopped: an agent that
        stops must not leave containers held back by a contention it no longer watches (what a
        killed agent left, a starting one undoes: gpufrac.agent.compute.leftover).
        Call once run() is cancelled."""
        for stopping in list(self._stopping):  # a stop its cancelled period left running
            with contextlib.suppress(Exception):
                self._held.add(tuple(await stopping))
        self._stopping.clear()
        for fds in list(self._held):
            await asyncio.to_thread(hold.resume, fds)
        self._held.clear()
        for key, pace in list(self._written.items()):
            if pace:
                self.bookings.set_compute_pace(key, 0)
        self._written.clear()
        self._placements.close()
        self.feed.driven = False
