"""The watchdog: GPU memory as NVML sees it, per container, against the container's limit.

The memguard shim holds every process that loads it to its container's limit. A
program that bypasses it (a static binary, LD_PRELOAD unset, its own dlopen of
the driver by path) is invisible to the shim but not to NVML: every interval the
watchdog reads NVML's per-process used memory, maps each process to its
container through /proc/<pid>/cgroup (gpufrac.agent.gpu.processes), sums per container
and GPU, and compares with the container's limit plus its part of ONE allowance per pod and GPU
(`tolerance`: the shim charges contexts and modules as measured around the call, which can be a
little off, and lazily loaded modules take memory no hooked call sees; docs/watchdog.md sizes
it). Per pod, not per process or container: an allowance per process would let a container buy
headroom by starting idle CUDA processes, one per container would let a pod buy it with
containers (sidecars). A container that holds no allocation on a GPU has none there.

Modes (config.watchdog.mode):
* off      - not started;
* report   - a container over its limit gets a Warning Event, a log line and a
             metric, once per episode (until it is back under); its memory stays until
             a guarantee needs it: the reclaim then takes it (gpufrac.agent.arbiter.resolvers,
             gpufrac.agent.arbiter.unbooked), as in every mode. Hidden processes are reported
             only (below), and said so at start;
* enforce  - the same, and its processes are killed, newest first, until the rest
             fits, in the scan that found it (within one interval); each kill is an
             Event naming usage and limit.

A container is judged per GPU by its pod's status and the ledger (gpufrac.agent.processes.callers.
ContainerOwner): its limit there is the sum of its allocations' on that GPU (two when it asked
for both resources), and 0 where it holds none, a container of a gpufrac pod that was given no
allocation (a sidecar that sees the GPUs) included. A limit of 0 waits while some booking on
that GPU is not yet tied to its container: it may be this one's.

GPU processes that belong to no gpufrac pod (another device plugin's pod, a process on the
host, one the agent could not look at for want of files) are reported in the log and a metric,
never killed.

A hidden GPU process, one the kernel refuses to say the cgroup of (a cgroup path past PATH_MAX:
cgroups nested on purpose, gpufrac.agent.processes.callers), is nobody's and is never searched for (the
tenant could make any search expensive or fail). In enforce mode it is killed in the scan that
finds it, through a pidfd, only while it is the process seen and its cgroup file is still
refused (gpufrac.agent.processes.kill.kill_if_hidden); in report mode it is reported, once per process.
Either is a log line naming pid and reason and a count (`hidden_kill`, `hidden_report`).

Blocking work (NVML, /proc reads, kill and wait) runs in worker threads; the
decisions are made on the agent's loop, which owns the ledger.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from gpufrac.agent.booking.ledger import Ledger
from gpufrac.agent.gpu import truth
from gpufrac.agent.gpu.inventory import NvmlError
from gpufrac.agent.gpu.processes import GpuProcess, Lookup, Observed, observe
from gpufrac.agent.kube.events import (
    REASON_LIMIT_ENFORCED,
    REASON_OVER_LIMIT,
    REASON_USAGE_MISMATCH,
    WARNING,
    Booked,
    EventSink,
    container_name,
    container_ref,
)
from gpufrac.agent.processes.callers import CgroupIdentity, ContainerOwner
from gpufrac.agent.processes.kill import KillFailed, kill_if_hidden, kill_if_same
from gpufrac.core.config import WatchdogConfig
from gpufrac.core.units import format_bytes
from gpufrac.memguard.abi import FLAG_WHOLE_GPU

log = logging.getLogger(__name__)


@dataclass
class Verdict:
    """A container over its limit on one GPU, and which of its processes must go."""

    owner: ContainerOwner
    gpu: str
    usage: int  # bytes NVML shows for the container on that GPU
    limit: int  # the container's limit there: its allocations' there summed (0 where it has none)
    allowed: int  # limit + its part of its pod's allowance there (none where it holds no allocation)
    procs: list[GpuProcess]  # the container's processes on that GPU, newest first
    kill: list[GpuProcess] = field(default_factory=list)


class WatchdogMetrics(Protocol):
    """Where the watchdog counts what it found and did (gpufrac.agent.metrics.Metrics)."""

    def count_watchdog(self, action: str) -> None: ...
    def set_watchdog_unowned(self, processes: int, used_bytes: int) -> None: ...
    def count_usage_mismatch(self) -> None: ...


# -- the decision (pure) -------------------------------------------------------------------------


def plan(
    owned: Iterable[tuple[ContainerOwner, GpuProcess]],
    tolerance: int,
    enforce: bool,
    unsettled: Collection[str] = (),
) -> list[Verdict]:
    """Containers over limit + allowance on some GPU, and (when enforcing) the processes to
    kill: the newest first, until what is left fits. A container's limit on a GPU is the sum
    of its allocations' there, 0 where it holds none; but not judged at 0 on a GPU in
    `unsettled` (a booking there is not yet tied to its container, and may be this one's).
    Whole-GPU containers are accounted, never limited, on the GPUs they hold whole (on any
    other, as any container: a whole-GPU pod that sees the node's GPUs must not use a shared
    one unlimited).

    The allowance (`tolerance`) is one per pod per GPU where the pod holds an allocation,
    shared by its containers that hold one there (`_allowances`): not multiplied by the
    processes or the containers a pod chooses to run. A container that holds no allocation
    on the GPU (a sidecar that sees it) has none: its memory there is booked to nobody.

    Newest first: the process that pushed the container over is most likely a recent one, and
    the oldest is most likely the container's main work; idle processes started to gain headroom
    go before it."""
    per: dict[tuple[str, str], tuple[ContainerOwner, list[GpuProcess]]] = {}
    for owner, proc in owned:
        if any(a.whole_gpu or a.config.flags & FLAG_WHOLE_GPU for a in owner.holding(proc.gpu)):
            continue
        per.setdefault((owner.key, proc.gpu), (owner, []))[1].append(proc)
    judged = [
        (owner, gpu, procs)
        for (_, gpu), (owner, procs) in per.items()
        if owner.holding(gpu) or gpu not in unsettled
    ]
    shares = _allowances([(o, g, sum(p.used for p in procs)) for o, g, procs in judged], tolerance)
    out = []
    for owner, gpu, procs in judged:
        usage = sum(p.used for p in procs)
        # On a GPU none of its allocations holds, any memory is a breach.
        limit = sum(a.config.limit_bytes for a in owner.holding(gpu))
        allowed = limit + shares.get((owner.key, gpu), 0)
        if usage <= allowed:
            continue
        procs = sorted(procs, key=lambda p: (-p.start, -p.pid))
        v = Verdict(owner, gpu, usage, limit, allowed, procs)
        if enforce:
            left = usage
            for p in procs:
                if left <= allowed:
                    break
                v.kill.append(p)
                left -= p.used
        out.append(v)
    return out


def _allowances(
    usage: Iterable[tuple[ContainerOwner, str, int]], tolerance: int
) -> dict[tuple[str, str], int]:
    """Each container's part of its pod's allowance on each GPU, by (container key, GPU): one
    `tolerance` per pod and GPU, shared by the pod's containers that hold an allocation there
    and use more than their limit, the least over first (so it covers as many of them as it
    can; what it cannot cover is judged). A container holding no allocation on the GPU gets
    none. `usage`: (container, GPU, bytes NVML counts for it there)."""
    over: dict[tuple[str, str], list[tuple[int, str]]] = {}  # (pod, GPU) -> (bytes over, key)
    for owner, gpu, used in usage:
        here = owner.holding(gpu)
        if here:
            past = used - sum(a.config.limit_bytes for a in here)
            over.setdefault((owner.pod_uid, gpu), []).append((past, owner.key))
    out: dict[tuple[str, str], int] = {}
    for (_, gpu), containers in over.items():
        left = tolerance
        for past, key in sorted(containers):
            # All it is over by, while the pod's allowance lasts; then what is left of it.
            take = min(max(0, past), left)
            left -= take
            out[(key, gpu)] = take
    return out


# -- the watchdog --------------------------------------------------------------------------------


class Watchdog:
    """Runs on the agent's loop. `lookup` maps a cgroup identity to its container and allocations
    (gpufrac.agent.processes.callers.PeerLookup); `events` posts Kubernetes Events (None: log only)."""

    def __init__(
        self,
        config: WatchdogConfig,
        ledger: Ledger,
        lookup: Lookup,
        events: EventSink | None = None,
        *,
        metrics: WatchdogMetrics,
        observer: Callable[[], list[Observed]] = observe,
        killer: Callable[[int, CgroupIdentity], bool] = kill_if_same,
        hidden_killer: Callable[[int, int], bool] = kill_if_hidden,
    ) -> None:
        self.config = config
        self.ledger = ledger
        self.lookup = lookup
        self._events = events
        self._metrics = metrics
        self._observe = observer
        self._kill = killer
        self._kill_hidden = hidden_killer  # (pid, start time): whether it was killed
        self._over: set[tuple[str, str]] = set()  # (container key, GPU) over limit now: reported once
        self.unowned: dict[int, GpuProcess] = {}  # GPU processes of no gpufrac container, last scan
        self.hidden: dict[int, GpuProcess] = {}  # hidden GPU processes left alive by the last scan
        # Counters (read by metrics and tests).
        self.scans = 0
        self.kills = 0
        self.reports = 0
        self.errors = 0
        self._task: asyncio.Task[None] | None = None
        # Usage files checked against NVML (gpufrac.agent.gpu.truth), flagged once per episode.
        self.mismatch = truth.MismatchTracker(config.tolerance)

    @property
    def enforcing(self) -> bool:
        return self.config.mode == "enforce"

    def start(self) -> asyncio.Task[None] | None:
        if self.config.mode == "off":
            log.info("watchdog off")
            return None
        log.info(
            "watchdog in %s mode: every %.1fs, tolerance %s (one allowance per pod and GPU)",
            self.config.mode,
            self.config.interval,
            format_bytes(self.config.tolerance),
        )
        if not self.enforcing:
            log.warning(
                "watchdog in report mode: a container past its limit is reported, not killed, until a "
                "guarantee needs its memory (then evicted, as a burst); a hidden GPU process (its cgroup "
                "file refused) is never killed, and an allocation within a guarantee that needs its "
                "memory is refused at its wait timeout (docs/watchdog.md, Report mode)"
            )
        self._task = asyncio.create_task(self._loop(), name="watchdog")
        return self._task

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _loop(self) -> None:
        while True:
            try:
                await self.scan()
            except asyncio.CancelledError:
                raise
            except NvmlError as e:
                self.errors += 1
                log.error("watchdog: NVML: %s", e)
            except Exception:
                self.errors += 1
                log.exception("watchdog scan failed")
            await asyncio.sleep(self.config.interval)

    async def scan(self) -> list[Verdict]:
        """One pass: observe, decide, act. Returns the verdicts (tests, status)."""
        seen = await asyncio.to_thread(self._observe)
        owned: list[tuple[ContainerOwner, GpuProcess]] = []
        idents: dict[int, CgroupIdentity] = {}
        unowned: dict[int, Observed] = {}
        hidden: dict[int, Observed] = {}
        known: dict[tuple[str, str], ContainerOwner | None] = {}
        me = os.getpid()
        for o in seen:
            if o.proc.gpu not in self.ledger.geometry:
                continue  # a GPU gpufrac does not share (MIG mode): its processes are not ours to judge
            if o.hidden:
                if o.proc.pid != me:
                    hidden[o.proc.pid] = o
                continue
            owner = self._owner(o.cgroup, known)
            if owner is None:
                if o.proc.pid != me:
                    unowned[o.proc.pid] = o
                continue
            assert o.cgroup is not None
            idents[o.proc.pid] = o.cgroup
            owned.append((owner, o.proc))
        self._report_unowned(unowned)
        await self._act_on_hidden(hidden)
        await self._check_files(truth.tally(owned))
        # GPUs with a booking not yet tied to its container: no one is held to 0 there.
        unsettled = {g for a in self.ledger.containers() if not a.tied for g in a.gpus}
        verdicts = plan(owned, self.config.tolerance, self.enforcing, unsettled)
        now_over = {(v.owner.key, v.gpu) for v in verdicts}
        for v in verdicts:
            if v.kill:
                await self._enforce(v, idents)
            elif (v.owner.key, v.gpu) not in self._over:
                self._report(v)
        for key in self._over - now_over:
            log.info("watchdog: container %s is back within its limit on GPU %s", key[0], key[1])
        self._over = now_over
        self.scans += 1
        left = [o.proc for o in unowned.values()] + list(self.hidden.values())
        self._metrics.set_watchdog_unowned(len(left), sum(p.used for p in left))
        return verdicts

    async def _check_files(self, driver: truth.DriverUsage) -> None:
        """Each container's usage file against NVML's count for it on its GPU: a disagreement
        beyond the allowance that lasts is flagged (Event, log, metric), once per episode."""
        allocs = [
            a
            for a in self.ledger.containers()
            # Not yet attached: its path may still hold a released container's file.
            if self.ledger.attached(a.key) and not (a.whole_gpu or a.config.flags & FLAG_WHOLE_GPU)
        ]
        if not allocs:
            return
        files = await asyncio.to_thread(lambda: [truth.file_on_gpu(a.directory) for a in allocs])
        for alloc, file_used in zip(allocs, files, strict=True):
            if file_used is None or self.ledger.get(alloc.key) is not alloc:
                continue
            msg = self.mismatch.check(alloc, file_used, driver.bytes_of(alloc.key, alloc.gpus[0]))
            if msg is not None:
                log.warning("watchdog: %s", msg)
                self._event(alloc, REASON_USAGE_MISMATCH, msg)
                self._metrics.count_usage_mismatch()
        self.mismatch.forget([k for k in self.mismatch.since if self.ledger.get(k) is None])

    def _owner(
        self, ident: CgroupIdentity | None, known: dict[tuple[str, str], ContainerOwner | None]
    ) -> ContainerOwner | None:
        if ident is None:
            return None
        at = (ident.pod_uid, ident.container_id)
        if at not in known:
            known[at] = self.lookup.owner(*at)
        return known[at]

    def _report_unowned(self, unowned: dict[int, Observed]) -> None:
        for pid, o in unowned.items():
            if pid not in self.unowned:
                why = f" ({o.unreadable})" if o.unreadable else ""
                log.warning(
                    "watchdog: GPU process %d uses %s on GPU %s and belongs to no gpufrac container%s "
                    "(reported, never killed)",
                    pid,
                    format_bytes(o.proc.used),
                    o.proc.gpu,
                    why,
                )
        self.unowned = {pid: o.proc for pid, o in unowned.items()}

    async def _act_on_hidden(self, hidden: dict[int, Observed]) -> None:
        """Kill (enforce) or report (report, once per process) the GPU processes whose cgroup
        file the kernel refuses; `self.hidden` keeps those left alive."""
        alive: dict[int, GpuProcess] = {}
        for pid, o in hidden.items():
            what = (
                f"GPU process {pid} uses {format_bytes(o.proc.used)} on GPU {o.proc.gpu} and is hidden: the "
                f"kernel will not say which container it is in ({o.unreadable})"
            )
            if not self.enforcing:
                if pid not in self.hidden:
                    self.reports += 1
                    log.warning("watchdog: %s; watchdog in report mode, not killed", what)
                    self._metrics.count_watchdog("hidden_report")
                alive[pid] = o.proc
                continue
            try:
                killed = await asyncio.to_thread(self._kill_hidden, pid, o.proc.start)
            except KillFailed as e:
                self.errors += 1
                log.error("watchdog: %s; could not kill it: %s", what, e)
                alive[pid] = o.proc
                continue
            if not killed:
                # Exited, or its cgroup reads now: then it is judged as that container's next scan.
                log.info("watchdog: %s; not killed: it exited or its cgroup can be read now", what)
                continue
            self.kills += 1
            log.warning("watchdog: %s; killed: memory no container answers for is not kept", what)
            self._metrics.count_watchdog("hidden_kill")
        self.hidden = alive

    def _describe(self, v: Verdict) -> str:
        if v.owner.holding(v.gpu):
            where = ""
        elif v.owner.allocs:
            where = " (a GPU it was not given)"
        else:
            where = " (it holds no gpufrac allocation)"
        if v.owner.holding(v.gpu):
            allowance = f"+{format_bytes(v.allowed - v.limit)} of its pod's allowance there"
        else:
            allowance = "no allowance: no allocation of it is there"
        return (
            f"container {container_name(v.owner)} uses {format_bytes(v.usage)} of GPU memory on GPU "
            f"{v.gpu}{where} as NVML counts it, over its limit {format_bytes(v.limit)} ({allowance})"
        )

    def _report(self, v: Verdict) -> None:
        self.reports += 1
        msg = (
            f"{self._describe(v)}: processes "
            + ", ".join(f"{p.pid} ({format_bytes(p.used)})" for p in v.procs)
            + " bypass the memguard shim"
            + ("" if self.enforcing else "; watchdog in report mode, nothing killed")
        )
        log.warning("watchdog: %s: %s", v.owner.who(), msg)
        self._event(v.owner, REASON_OVER_LIMIT, msg)
        self._metrics.count_watchdog("report")

    async def _enforce(self, v: Verdict, idents: dict[int, CgroupIdentity]) -> None:
        for p in v.kill:
            try:
                killed = await asyncio.to_thread(self._kill, p.pid, idents[p.pid])
            except KillFailed as e:
                # Out of files, say: tried again next scan, the others still go now.
                self.errors += 1
                log.error("watchdog: %s: could not kill process %d: %s", v.owner.who(), p.pid, e)
                continue
            if not killed:
                continue  # exited or changed container meanwhile
            self.kills += 1
            msg = f"{self._describe(v)}: killed process {p.pid} using {format_bytes(p.used)}"
            log.warning("watchdog: %s: %s", v.owner.who(), msg)
            self._event(v.owner, REASON_LIMIT_ENFORCED, msg)
            self._metrics.count_watchdog("kill")

    def _event(self, who: Booked, reason: str, message: str) -> None:
        ref = container_ref(who)
        if self._events is not None and ref is not None:
            self._events.record(ref, WARNING, reason, message)
