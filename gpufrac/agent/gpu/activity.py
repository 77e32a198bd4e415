"""GPU activity per container: how long since it last did GPU work.

Two signals, combined (either one showing work makes the container active):

1. The shim's usage slots (memguard_abi.h): every kernel/graph launch bumps the
   process slot's `launches` and stamps `last_activity_ns` (CLOCK_MONOTONIC,
   no system call). The slot of a process that exits is zeroed, so the tracker
   remembers the last activity it saw rather than re-deriving it every poll.
2. NVML per-process utilisation (nvmlDeviceGetProcessUtilization): catches GPU
   work the launch hooks cannot see (a process outside the shim, copies). NVML
   names host pids; the shim's slots name pids in the container's pid namespace,
   so a host pid is matched to a slot by (innermost NSpid, start time), which
   is the same process in both views.

The usage file is the tenant's to write (docs/security.md): a stamp in the future is
clamped to the poll, and where NVML's per-process samples can be had, the file's launches
count only in a poll window in which the driver itself sampled one of the container's
processes (any utilisation: the process ran something). A slot names a process; the driver's
sample is credited to the container only if the kernel places that process in that very
container (its /proc/<pid>/cgroup names the container's pod UID and one of the container IDs
the pod's status gives it: gpufrac.agent.processes.callers); a slot naming any other process (a host
process in no kubelet pod, a neighbour's, one of a container whose IDs are not known yet) is
ignored and logged once. Stamping its own slots or claiming another's pid therefore buys a
container nothing; without NVML's samples (no driver, MIG and boards that lack them) the
file is all there is, and is used. A file that cannot be read (a broken magic, a short file)
leaves only the driver's samples of the processes the kernel places in the container: its
idle clock runs from when the tracker first met it (or its last good read), never stops.

Idle = neither signal shows work. A container holding memory while its
processes only use the CPU is idle from the GPU's point of view; WHEN that
matters is the idle reaper's business (gpufrac.agent.idle.reaper), not this module's.

The tracker is shared: the idle reaper polls it every `idle.interval`, and the
arbiter may read `idle_seconds(key)` when it picks victims. Reading usage files
and NVML blocks, so `poll()` does that in a worker thread and applies the
result on the agent's loop (docs/architecture.md). Over 500 lines: the two signals and the
rules that keep a tenant's file from outweighing the driver are one judgement, read together.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from gpufrac.agent.processes.callers import PeerError, read_cgroup
from gpufrac.agent.processes.proc import proc_identity
from gpufrac.memguard import abi

log = logging.getLogger(__name__)

NS = 1_000_000_000
# NVML utilisation (percent) at or above which a process counts as doing GPU work.
DEFAULT_UTIL_THRESHOLD = 1


class Clock(Protocol):
    """Time sources, injectable for tests. monotonic() is the tracker's own time
    axis; monotonic_ns() is the clock the shim stamps (CLOCK_MONOTONIC); time() is
    wall time (allocation times, NVML sample timestamps)."""

    def monotonic(self) -> float: ...

    def monotonic_ns(self) -> int: ...

    def time(self) -> float: ...


class SystemClock:
    def monotonic(self) -> float:
        return time.monotonic()

    def monotonic_ns(self) -> int:
        return time.monotonic_ns()

    def time(self) -> float:
        return time.time()


class Trackable(Protocol):
    """A container as poll() takes it (a ledger ContainerAlloc fits)."""

    @property
    def key(self) -> str: ...
    @property
    def directory(self) -> str: ...
    @property
    def gpus(self) -> Sequence[str]: ...
    @property
    def created(self) -> float: ...
    @property
    def pod_uid(self) -> str | None: ...


@dataclass(frozen=True)
class Tracked:
    """What the tracker needs of one container (a ledger ContainerAlloc fits)."""

    key: str
    directory: str
    gpus: tuple[str, ...]
    created: float  # wall time the container was allocated
    pod_uid: str | None = None  # its pod, to check a process's cgroup against
    # The kubelet container IDs its pod's status gives it (a restart adds one): a process
    # whose cgroup names none of them is not this container's.
    container_ids: frozenset[str] = frozenset()


@dataclass(frozen=True)
class ContainerActivity:
    """One container's GPU activity as of the last poll."""

    key: str
    last_active: float  # tracker clock (monotonic s) of the last GPU work seen
    why: str  # what showed it: "launch", "nvml", "start" (no work seen since the tracker met it)
    launches: int  # launches counted by its live processes
    processes: int  # live processes under the shim
    used_bytes: int  # GPU memory its processes hold
    polled: float  # tracker clock of the poll

    def idle_seconds(self, now: float | None = None) -> float:
        return max(0.0, (self.polled if now is None else now) - self.last_active)


@dataclass(frozen=True)
class _Slot:
    pid: int
    start_time: int
    launches: int
    last_ns: int
    used: int


@dataclass
class _Sample:
    """The blocking part's result, applied on the loop."""

    mono: float
    mono_ns: int
    wall: float
    slots: dict[str, list[_Slot]] = field(default_factory=dict)
    unreadable: dict[str, str] = field(default_factory=dict)
    # Container key -> wall time of the newest NVML sample showing work.
    nvml_active: dict[str, float] = field(default_factory=dict)
    # Containers with any NVML sample in this window (the driver saw them run something).
    driver_ran: set[str] = field(default_factory=set)
    # Containers whose file activity needs the driver's word (NVML samples are had for all
    # their GPUs).
    corroborate: set[str] = field(default_factory=set)
    # (container key, host pid) -> where the kernel places a process a slot of that container
    # claims, when that is not the container itself: the claim was ignored.
    refused: dict[tuple[str, int], str] = field(default_factory=dict)


@dataclass
class _State:
    last_active: float
    why: str
    counts: dict[tuple[int, int], int]  # (pid, start time) -> launches seen
    polled: float  # when these were seen


@dataclass(frozen=True)
class ProcessSample:
    """One of NVML's per-process utilisation samples."""

    pid: int  # host pid
    time: float  # wall time of the sample (s)
    sm: int  # percent of the sample's period the process's kernels ran
    top: int  # the highest of its SM, memory, encoder and decoder figures


def fold_samples(samples: Iterable[ProcessSample], threshold: int) -> dict[int, tuple[float, bool]]:
    """Host pid -> (wall time of its newest sample, whether a sample reached the threshold);
    a sample at the threshold outranks any below it, however new."""
    out: dict[int, tuple[float, bool]] = {}
    for s in samples:
        busy = s.top >= threshold
        was_t, was_busy = out.get(s.pid, (0.0, False))
        if busy and not was_busy:
            out[s.pid] = (s.time, True)
        elif busy == was_busy:
            out[s.pid] = (max(s.time, was_t), busy)
    return out


class ProcessSamples(Protocol):
    """Per-process utilisation samples since the previous call (NvmlUtilisation, or a view of
    the agent's one reader of them, gpufrac.agent.gpu.utilisation)."""

    def supported(self, gpu_uuid: str) -> bool: ...

    def sampled_pids(self, gpu_uuid: str) -> dict[int, tuple[float, bool]]: ...

    def close(self) -> None: ...


class NvmlUtilisation:
    """Per-process GPU utilisation from NVML, remembering each GPU's last sample time
    so every call returns only what happened since the previous one."""

    def __init__(self, threshold: int = DEFAULT_UTIL_THRESHOLD) -> None:
        import pynvml  # nvidia-ml-py ships no type hints

        from gpufrac.agent.gpu.inventory import nvml_init

        self._nvml = pynvml
        self.threshold = threshold
        nvml_init()  # counted: paired with close()
        self._handles: dict[str, object] = {}
        self._last_seen: dict[str, int] = {}
        self._unsupported: set[str] = set()
        # GPUs whose last call failed otherwise: no samples is then no evidence of idleness,
        # so their containers fall back to launch counts until a call succeeds again.
        self._failing: set[str] = set()
        self._closed = False

    def supported(self, gpu_uuid: str) -> bool:
        """Whether this GPU gives per-process samples (as far as known)."""
        return gpu_uuid not in self._unsupported and gpu_uuid not in self._failing

    def sampled_pids(self, gpu_uuid: str) -> dict[int, tuple[float, bool]]:
        """Host pid -> (wall time of its newest sample, whether a sample reached the threshold),
        for every process sampled since the previous call."""
        return fold_samples(self.samples(gpu_uuid), self.threshold)

    def samples(self, gpu_uuid: str) -> list[ProcessSample]:
        """Every per-process sample of the GPU since the previous call (none where NVML has
        none to give: not supported, or the call failed; supported() tells them apart)."""
        nv = self._nvml
        if gpu_uuid in self._unsupported:
            return []
        try:
            handle = self._handles.get(gpu_uuid)
            if handle is None:
                handle = self._handles[gpu_uuid] = nv.nvmlDeviceGetHandleByUUID(gpu_uuid)
            samples = nv.nvmlDeviceGetProcessUtilization(handle, self._last_seen.get(gpu_uuid, 0))
        except nv.NVMLError as e:
            if e.value == nv.NVML_ERROR_NOT_FOUND:
                return []  # no process sampled since the last call
            if e.value == nv.NVML_ERROR_NOT_SUPPORTED:
                # MIG, vGPU and some boards: the launch counters remain.
                log.warning(
                    "GPU %s: no per-process utilisation from NVML (%s); using launches only", gpu_uuid, e
                )
                self._unsupported.add(gpu_uuid)
                return []
            log.warning("GPU %s: nvmlDeviceGetProcessUtilization: %s", gpu_uuid, e)
            self._handles.pop(gpu_uuid, None)
            self._failing.add(gpu_uuid)
            return []
        self._failing.discard(gpu_uuid)
        newest = self._last_seen.get(gpu_uuid, 0)
        out = []
        for s in samples:
            newest = max(newest, int(s.timeStamp))
            top = max(s.smUtil, s.memUtil, s.encUtil, s.decUtil)
            out.append(ProcessSample(int(s.pid), int(s.timeStamp) / 1e6, int(s.smUtil), int(top)))
        self._last_seen[gpu_uuid] = newest
        return out

    def close(self) -> None:
        if not self._closed:
            from gpufrac.agent.gpu.inventory import nvml_shutdown

            self._closed = True
            nvml_shutdown()


class ActivityTracker:
    """Seconds since each container's last GPU work. Owned by the agent's loop."""

    def __init__(
        self,
        *,
        nvml: ProcessSamples | None = None,
        clock: Clock | None = None,
        proc: str = "/proc",
    ) -> None:
        self.nvml = nvml
        self.clock = clock or SystemClock()
        self.proc = proc
        self.started = self.clock.monotonic()
        self._states: dict[str, _State] = {}
        self._current: dict[str, ContainerActivity] = {}
        self._warned: set[str] = set()
        self._refused_told: set[tuple[str, int]] = set()  # ignored claims already logged
        # One poll at a time: the reaper and the arbiter may both ask, and NVML's
        # "samples since" cursor must move forward once per sample.
        self._poll_lock = asyncio.Lock()

    @classmethod
    def with_nvml(
        cls, clock: Clock | None = None, threshold: int = DEFAULT_UTIL_THRESHOLD
    ) -> ActivityTracker:
        """A tracker with NVML when it can be had; launches alone otherwise. Blocking."""
        try:
            nvml: NvmlUtilisation | None = NvmlUtilisation(threshold)
        except Exception as e:  # no driver: the shim's counters still tell activity
            log.warning("NVML unavailable for activity tracking (%s); using the shim's launch counters", e)
            nvml = None
        return cls(nvml=nvml, clock=clock)

    # -- reading (on the loop) --------------------------------------------------------------------

    def get(self, key: str) -> ContainerActivity | None:
        return self._current.get(key)

    def idle_seconds(self, key: str) -> float | None:
        """Seconds without GPU work, as of now (None for a container never polled)."""
        a = self._current.get(key)
        return None if a is None else a.idle_seconds(self.clock.monotonic())

    # -- polling ----------------------------------------------------------------------------------

    async def poll(
        self, containers: Iterable[Trackable], container_ids: Mapping[str, Collection[str]] | None = None
    ) -> dict[str, ContainerActivity]:
        """Read every container's usage file and NVML (in a worker thread), then update.
        `container_ids`: container key -> the kubelet container IDs its pod's status names
        for it (the pod cache's; gpufrac.agent.idle.reaper passes them). A container without any
        gets no credit for the driver's samples of the processes its slots claim."""
        ids = container_ids or {}
        tracked = [
            Tracked(c.key, c.directory, tuple(c.gpus), c.created, c.pod_uid, frozenset(ids.get(c.key, ())))
            for c in containers
        ]
        async with self._poll_lock:
            sample = await asyncio.to_thread(self.sample, tracked)
            return self.apply(tracked, sample)

    def sample(self, tracked: list[Tracked]) -> _Sample:
        """The blocking part: usage files and NVML. Touches no tracker state but NVML's cursor."""
        c = self.clock
        out = _Sample(mono=c.monotonic(), mono_ns=c.monotonic_ns(), wall=c.time())
        # (pid, start) as the slots name it -> every container whose file claims it: a file is
        # the tenant's, so a claim on a neighbour's process must not take it from the neighbour.
        owner: dict[tuple[int, int], list[Tracked]] = {}
        for t in tracked:
            try:
                usage = abi.read_usage(t.directory)
            except abi.FormatError as e:
                out.unreadable[t.key] = str(e)
                continue
            slots = [
                _Slot(
                    int(s.pid), int(s.start_time), int(s.launches), int(s.last_activity_ns), int(s.used_bytes)
                )
                for s in abi.live_slots(usage)
            ]
            out.slots[t.key] = slots
            for s in slots:
                owner.setdefault((s.pid, s.start_time), []).append(t)
        nvml = self.nvml
        if nvml is not None:
            # A container whose file cannot be read has no slots to match the driver's samples
            # by: its processes are those the kernel places in it (pod UID and container ID).
            blind = [t for t in tracked if t.key in out.unreadable and t.pod_uid and t.container_ids]
            gpus = sorted({g for t in tracked if t.key in out.slots or t in blind for g in t.gpus})
            for gpu in gpus:
                for host_pid, (when, busy) in nvml.sampled_pids(gpu).items() if owner or blind else ():
                    keys = self._owners_of(host_pid, owner, out.refused) if owner else []
                    for key in keys + (self._placed_in(host_pid, blind) if blind else []):
                        out.driver_ran.add(key)
                        if busy:
                            out.nvml_active[key] = max(out.nvml_active.get(key, 0.0), when)
            out.corroborate = {t.key for t in tracked if t.gpus and all(nvml.supported(g) for g in t.gpus)}
        return out

    def _owners_of(
        self, host_pid: int, owner: dict[tuple[int, int], list[Tracked]], refused: dict[tuple[str, int], str]
    ) -> list[str]:
        """The containers a host pid's process belongs to: those whose slots name it (pid in
        its namespace and start time; a slot whose start time is not stamped yet by its pid
        alone) AND in which the kernel places it (its cgroup names the container's pod and
        one of its container IDs). Claims the kernel does not bear out go into `refused`."""
        ident = proc_identity(host_pid, self.proc)
        if ident is None:
            return []
        # Both kinds of claim: a forged exact claim must not hide a slot not stamped yet.
        claims = owner.get(ident, []) + owner.get((ident[0], 0), [])
        if not claims:
            return []
        try:
            cg = read_cgroup(host_pid, self.proc)
        except PeerError:  # gone since NVML sampled it: one process must not fail the poll
            return []
        out = []
        for t in claims:
            if cg is None:
                refused[(t.key, host_pid)] = "in no kubelet container"
            elif not t.pod_uid or (cg.pod_uid == t.pod_uid and not t.container_ids):
                continue  # its pod or its container IDs are not known yet: no credit, nothing to tell
            elif cg.pod_uid != t.pod_uid or cg.container_id not in t.container_ids:
                refused[(t.key, host_pid)] = f"in pod {cg.pod_uid} container {cg.container_id[:12]}"
            else:
                out.append(t.key)
        return out

    def _placed_in(self, host_pid: int, blind: list[Tracked]) -> list[str]:
        """The containers of `blind` in which the kernel places a host pid's process."""
        try:
            cg = read_cgroup(host_pid, self.proc)
        except PeerError:  # gone since NVML sampled it
            return []
        if cg is None:
            return []
        return [t.key for t in blind if cg.pod_uid == t.pod_uid and cg.container_id in t.container_ids]

    def _first_sight(self, t: Tracked, sample: _Sample) -> _State:
        """A container met for the first time: nothing known before the later of its allocation
        and our start (after an agent restart, activity before the restart is unknown: the
        conservative answer is "active when we started")."""
        now = sample.mono
        since_alloc = now - max(0.0, sample.wall - t.created)
        state = self._states[t.key] = _State(max(since_alloc, self.started), "start", {}, now)
        return state

    def _driver_work(self, state: _State, key: str, sample: _Sample) -> None:
        """Move a container's last activity up to the newest work the driver sampled of it."""
        wall_at = sample.nvml_active.get(key)
        if wall_at is not None:
            now = sample.mono
            at = min(now, now - (sample.wall - wall_at))
            if at > state.last_active:
                state.last_active, state.why = at, "nvml"

    def apply(self, tracked: list[Tracked], sample: _Sample) -> dict[str, ContainerActivity]:
        """Fold a sample into the per-container state (on the loop)."""
        now = sample.mono
        current: dict[str, ContainerActivity] = {}
        for (key, pid), where in sample.refused.items():
            if (key, pid) not in self._refused_told:
                self._refused_told.add((key, pid))
                why = "the driver's samples of it are not that container's GPU work"
                log.warning(
                    "usage file of container %s claims process %d, placed %s: %s", key, pid, where, why
                )
        for t in tracked:
            state = self._states.get(t.key)
            if t.key in sample.unreadable:
                if t.key not in self._warned:
                    self._warned.add(t.key)
                    log.warning(
                        "usage file of %s unreadable (%s): its activity is the driver's samples alone",
                        t.key, sample.unreadable[t.key],
                    )  # fmt: skip
                # The file is the tenant's: breaking it, even before our first read, must not
                # stop the idle clock (no activity would count as busy to the reaper). The clock
                # runs from the first sight, or from what the last good read showed, and only
                # the driver's samples of the container's processes move it; the launch counters
                # are kept (forgotten, they would all look new once the file reads again).
                if state is None:
                    state = self._first_sight(t, sample)
                self._driver_work(state, t.key, sample)
                prev = self._current.get(t.key)
                current[t.key] = ContainerActivity(
                    key=t.key,
                    last_active=state.last_active,
                    why=state.why,
                    launches=prev.launches if prev else 0,
                    processes=prev.processes if prev else 0,
                    used_bytes=prev.used_bytes if prev else 0,
                    polled=now,
                )
                continue
            self._warned.discard(t.key)
            slots = sample.slots.get(t.key, [])
            first = state is None
            if state is None:
                state = self._first_sight(t, sample)
            counts = {(s.pid, s.start_time): s.launches for s in slots}
            # The file's launches are the tenant's word: where the driver can be asked, they
            # count only when it sampled one of the container's processes in this window.
            heard = t.key not in sample.corroborate or t.key in sample.driver_ran
            for s in slots if heard else ():
                # The shim's CLOCK_MONOTONIC stamp, moved onto our time axis; one in the
                # future (a tenant's write) counts as now, never later.
                at = now - max(0, sample.mono_ns - s.last_ns) / NS if s.last_ns > 0 else 0.0
                if (
                    not first
                    and s.launches > state.counts.get((s.pid, s.start_time), 0)
                    and at < state.polled
                ):
                    # The counter moved since the last poll but the stamp says earlier (another
                    # clock domain, a torn read): the work happened since then; say now.
                    at = now
                if at > state.last_active:
                    state.last_active, state.why = at, "launch" if s.launches else "start"
            state.counts, state.polled = counts, now
            self._driver_work(state, t.key, sample)
            current[t.key] = ContainerActivity(
                key=t.key,
                last_active=state.last_active,
                why=state.why,
                launches=sum(s.launches for s in slots),
                processes=len(slots),
                used_bytes=sum(s.used for s in slots),
                polled=now,
            )
        gone = set(self._states) - {t.key for t in tracked}
        for key in gone:
            del self._states[key]
            self._warned.discard(key)
        self._refused_told = {(k, p) for k, p in self._refused_told if k not in gone}
        self._current = current
        return current

    def idle_for_decision(self, key: str, file_last_ns: int) -> float | None:
        """Seconds `key` has been idle, for a decision that costs it (evicted or swapped out as
        idle): the tracker's figure, which the driver vouches for where it can, running on
        since the last poll, except that a launch the usage file shows after that poll (not
        checked yet) stops it at the poll's figure. A tenant's stamps can so hold the clock
        for at most one poll interval, never wind it back; None before the first poll."""
        a = self._current.get(key)
        if a is None:
            return None
        now, now_ns = self.clock.monotonic(), self.clock.monotonic_ns()
        if file_last_ns > 0 and now - max(0, now_ns - file_last_ns) / NS > a.polled:
            return a.idle_seconds()
        return a.idle_seconds(now)

    def close(self) -> None:
        if self.nvml is not None:
            self.nvml.close()
            self.nvml = None


class DecisionIdle(Protocol):
    """What the arbiter asks of the tracker (ActivityTracker.idle_for_decision)."""

    def idle_for_decision(self, key: str, file_last_ns: int) -> float | None: ...


def holding_idle_s(tracker: DecisionIdle | None, key: str, file_last_ns: int, now_ns: int) -> float:
    """Seconds a container counts as idle when the arbiter picks swap and evict victims: the
    activity tracker's figure (NVML's word where it can be had), else the usage file's newest
    stamp clamped to now (a stamp in the future is the tenant's write, not time); no stamp
    at all is idle since ever."""
    file_last_ns = min(file_last_ns, now_ns)
    if tracker is not None:
        idle = tracker.idle_for_decision(key, file_last_ns)
        if idle is not None:
            return idle
    return (now_ns - file_last_ns) / NS if file_last_ns > 0 else float("inf")
