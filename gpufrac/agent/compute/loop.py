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
from gpufrac.agent.processes.callers import CgroupIdentity, ContainerOwner, PeerError, read_cgroup
from gpufrac.core.annotations import ContainerPolicy, memory_share
from gpufrac.core.config import Config
from gpufrac.core.policy import compute_mode
from gpufrac.core.slices import GpuGeometry
from gpufrac.memguard import abi

log = logging.getLogger(__name__)

SMOOTH = 0.2  # weight of the newest period in a container's shown use (about a second's average)


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
    """The blocking part's result."""

    samples: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # GPU -> (pid, SM %)
    cgroups: dict[int, CgroupIdentity | None] = field(default_factory=dict)
    launches: dict[str, int] = field(default_factory=dict)  # container -> launches its file counts


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
        on_gpu = self.tenants()
        dirs = {a.key: a.directory for pairs in on_gpu.values() for _, a in pairs}
        # Every GPU holding a container is read, whole GPUs too: the activity tracker's view of
        # the feed gets its samples from these reads alone.
        watched = sorted({g for a in self.bookings.containers() for g in a.gpus})
        reading = await asyncio.to_thread(self._read, watched, dirs)
        used = self._attribute(reading)
        decisions: list[control.Decision] = []
        for gpu, pairs in on_gpu.items():
            tenants = [t for t, _ in pairs]
            launches = self._launch_deltas(reading, [t.key for t in tenants])
            made = control.step(tenants, used, launches, period, self._state)
            decisions += made
            self._overcommit(gpu, pairs)
            allocs = {a.key: a for _, a in pairs}
            for d in made:
                self._apply(d, allocs[d.key])
                if d.hold > 0 and self._pids.get(d.key):
                    await self._hold(self._pids[d.key], d.hold * period)
        gone = set(self._state) - set(dirs)
        for key in gone:
            self._forget(key)
        return decisions

    def _read(self, gpus: Sequence[str], dirs: Mapping[str, str]) -> _Reading:
        """The blocking part: NVML (through the feed), the cgroups of the processes it sampled,
        and each container's launch count from its usage file."""
        out = _Reading()
        for gpu in gpus:
            out.samples[gpu] = [(s.pid, s.sm) for s in self.feed.poll(gpu)]
        pids = {pid for samples in out.samples.values() for pid, _ in samples}
        for pid in pids:
            try:
                out.cgroups[pid] = read_cgroup(pid)
            except PeerError:  # gone since it was sampled, or its cgroup refused: no one's
                out.cgroups[pid] = None
        for key, directory in dirs.items():
            try:
                usage = abi.read_usage(directory)
            except abi.FormatError:
                continue  # a broken file seeds no pace: the first pace is the default one
            out.launches[key] = sum(int(s.launches) for s in abi.live_slots(usage))
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

    def _launch_deltas(self, reading: _Reading, keys: Sequence[str]) -> dict[str, int]:
        out: dict[str, int] = {}
        for key in keys:
            now = reading.launches.get(key)
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
        told = frozenset(f"{t.key}={t.share:.4f}" for t, _ in pairs)
        if not total:
            self._told_overcommit.pop(gpu, None)
            return
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
        self.feed.driven = False
