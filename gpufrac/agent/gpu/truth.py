"""What a container really holds on a GPU: the driver's count, and the usage file checked against it.

The usage file is the memguard shim's own bookkeeping, and the container can write it (it is
mounted read-write so that every process of the container can charge it). It is fine for what
a container does to itself (its own burst requests), never enough for a decision that costs
another container: an eviction, a swap, a reclaimed guarantee, a burst denied because the GPU
looks full. For those the arbiter counts

    held = max(file, driver)
    file   = the usage file's total_used, clamped to what the agent gave the container
             (request + grant): a huge counter cannot make the GPU look fuller than the grants
             the agent itself published
    driver = NVML's per-process used memory (nvmlDeviceGetComputeRunningProcesses), summed
             over the processes whose cgroup names the container (gpufrac.agent.gpu.processes.observe,
             gpufrac.agent.processes.callers), less its part of ONE context allowance per pod and GPU
             (measurement skew and lazily loaded modules the shim cannot see; docs/watchdog.md
             sizes it), shared by the pod's containers holding an allocation there
             (DriverUsage.less_allowance): a pod does not buy allowances with containers

for a holder that may lose something (a victim looks no bigger than it is), and the driver's
WHOLE count, no allowance, for the container a decision is made for (a requester's missing
guarantee, what its neighbours may still charge: gpufrac.agent.arbiter.service
Resolution.guarantee_shortfall), so zeroing the counter, or allocating from a process that does
not load the shim, hides nothing, and an inflated counter takes nothing from anyone.

A process counts for its container by GPU (gpufrac.agent.processes.callers.ContainerOwner): a container
holding two allocations on one GPU (it asked for both resources) has its count there split
between them, each its request in turn and the rest to the last, so its burst is seen once; a
container of a gpufrac pod that holds none there is counted under a key of its own, never left
out and never charged to a sibling.

A container whose file and driver count disagree by more than the allowance for longer than
DISAGREE_AFTER is flagged once per episode by the watchdog, which reads both every interval: a
Warning Event on its pod (GpuUsageFileMismatch), a log line and the counter
gpufrac_usage_file_mismatches_total.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from gpufrac.agent.booking.ledger import ContainerAlloc
from gpufrac.agent.gpu.processes import GpuProcess, Lookup, Observed
from gpufrac.agent.processes.callers import CgroupIdentity, ContainerOwner
from gpufrac.core.units import format_bytes
from gpufrac.memguard import abi

log = logging.getLogger(__name__)

# A file and the driver may disagree for a moment (the shim charges before the driver call and
# uncharges after the free): only a disagreement that lasts this long is flagged.
DISAGREE_AFTER = 2.0


@dataclass(frozen=True)
class Unbooked:
    """A GPU process of a gpufrac pod's container that holds no allocation on that GPU (a
    sidecar that sees the GPUs, a container on a GPU it was not given): its limit there is 0."""

    owner: ContainerOwner
    proc: GpuProcess
    cgroup: CgroupIdentity


@dataclass
class DriverUsage:
    """NVML's per-process memory, summed per container and GPU (one reading)."""

    by_container: dict[tuple[str, str], int] = field(default_factory=dict)  # (key, GPU) -> bytes
    pids: dict[tuple[str, str], list[int]] = field(default_factory=dict)  # (key, GPU) -> pids
    # (pod UID, GPU) -> the keys counted there for the pod's containers holding an allocation
    # there: who shares the pod's one allowance on that GPU (`less_allowance`).
    booked: dict[tuple[str, str], list[str]] = field(default_factory=dict)
    # GPU -> the processes there of containers holding no allocation there (`attribute` only).
    unbooked: dict[str, list[Unbooked]] = field(default_factory=dict)
    _net: dict[int, dict[tuple[str, str], int]] = field(default_factory=dict)  # allowance -> net counts

    def bytes_of(self, key: str, gpu: str) -> int:
        return self.by_container.get((key, gpu), 0)

    def less_allowance(self, key: str, gpu: str, allowance: int) -> int:
        """What NVML counts for `key` on `gpu` less its part of ONE allowance per pod and GPU:
        the pod's counts there that hold an allocation share it, the smallest first (each
        covered whole while it lasts); a container holding no allocation there has none."""
        net = self._net.get(allowance)
        if net is None:
            net = self._net[allowance] = dict(self.by_container)
            for (_, g), keys in self.booked.items():
                left = allowance
                for k in sorted(keys, key=lambda k: (self.bytes_of(k, g), k)):
                    take = min(left, self.bytes_of(k, g))
                    net[(k, g)] -= take
                    left -= take
        return net.get((key, gpu), 0)

    def pids_of(self, key: str) -> list[int]:
        """The processes counted for a container, on any GPU."""
        return sorted({p for (k, _), pids in self.pids.items() if k == key for p in pids})


def attribute(seen: Iterable[Observed], lookup: Lookup) -> DriverUsage:
    """Sum NVML's processes per gpufrac container and GPU (their cgroup's container, through
    `lookup`); processes of no gpufrac pod are left out. Runs on the loop (the ledger's owner)."""
    known: dict[tuple[str, str], ContainerOwner | None] = {}
    owned: list[tuple[ContainerOwner, GpuProcess]] = []
    unbooked: dict[str, list[Unbooked]] = {}
    for o in seen:
        if o.cgroup is None:
            continue
        ident = (o.cgroup.pod_uid, o.cgroup.container_id)
        if ident not in known:
            known[ident] = lookup.owner(*ident)
        owner = known[ident]
        if owner is not None:
            owned.append((owner, o.proc))
            if not owner.holding(o.proc.gpu):
                unbooked.setdefault(o.proc.gpu, []).append(Unbooked(owner, o.proc, o.cgroup))
    out = tally(owned)
    out.unbooked = unbooked
    return out


def tally(owned: Iterable[tuple[ContainerOwner, GpuProcess]]) -> DriverUsage:
    """Processes already tied to their containers, summed per key and GPU (`split`)."""
    per: dict[tuple[str, str], tuple[ContainerOwner, int, list[int]]] = {}  # (owner key, GPU) ->
    for owner, proc in owned:
        at = (owner.key, proc.gpu)
        _, used, pids = per.get(at, (owner, 0, []))
        pids.append(proc.pid)
        per[at] = (owner, used + proc.used, pids)
    out = DriverUsage()
    for (_, gpu), (owner, used, pids) in per.items():
        for key, share in split(owner, gpu, used):
            if (key, gpu) not in out.by_container and owner.holding(gpu):
                out.booked.setdefault((owner.pod_uid, gpu), []).append(key)
            out.by_container[(key, gpu)] = out.by_container.get((key, gpu), 0) + share
            out.pids.setdefault((key, gpu), []).extend(pids)
    return out


def split(owner: ContainerOwner, gpu: str, used: int) -> list[tuple[str, int]]:
    """A container's count on one GPU, per key it is looked up by: all of it under the
    container's own key unless two or more of its allocations hold that GPU; then each of
    those its request in turn (by key) and the rest to the last, so the container's burst
    (all it holds past its requests there) is counted once."""
    here = owner.holding(gpu)
    if len(here) < 2:
        return [(here[0].key if here else owner.key, used)]
    out, left = [], used
    for a in here[:-1]:
        share = min(left, a.request_bytes)
        out.append((a.key, share))
        left -= share
    out.append((here[-1].key, left))
    return out


def file_on_gpu(directory: str) -> int | None:
    """What a usage file says the container holds on the GPU now, for the mismatch check; None
    when the file is unusable, or while any of its processes is swapped out or moving (its
    memory is in host RAM, or on its way, and NVML's count follows only when it lands; the
    arbiter's decisions use its own swap state, never this flag). Blocking (a pread)."""
    try:
        u = abi.read_usage(directory)
    except abi.FormatError:
        return None
    if any(s.swapped for s in abi.live_slots(u)):
        return None
    return int(u.total_used)


def clamp_file(alloc: ContainerAlloc, total_used: int) -> int:
    """A usage file's total as it may count against others: at most what the agent gave the
    container (its request and grant; a whole-GPU container, its limit)."""
    cap = alloc.config.limit_bytes if alloc.whole_gpu else alloc.request_bytes + alloc.config.grant_bytes
    return max(0, min(int(total_used), cap))


@dataclass
class MismatchTracker:
    """Flags containers whose usage file and driver count disagree (once per episode)."""

    allowance: int
    since: dict[str, float] = field(default_factory=dict)  # key -> when the disagreement began
    flagged: set[str] = field(default_factory=set)  # keys flagged in this episode
    flags: int = 0  # how many times any container was flagged (tests)

    def check(
        self, alloc: ContainerAlloc, file_used: int, driver_used: int, now: float | None = None
    ) -> str | None:
        """The message to flag `alloc` with now, or None. `file_used` unclamped, `driver_used`
        NVML's raw sum for the container on its GPU.

        Under-reporting (the file below the driver's count) is what hides usage. A file above
        it is flagged only past what the agent granted (request + grant): a slot of a killed
        process keeps its bytes until a shim or the agent reaps it, within that."""
        now = time.monotonic() if now is None else now
        granted = clamp_file(alloc, file_used)
        gap = file_used - max(driver_used, granted) if file_used > driver_used else file_used - driver_used
        if abs(gap) <= self.allowance:
            self.since.pop(alloc.key, None)
            if alloc.key in self.flagged:
                self.flagged.discard(alloc.key)
                log.info("usage file of %s agrees with the driver again", alloc.who())
            return None
        began = self.since.setdefault(alloc.key, now)
        if now - began < DISAGREE_AFTER or alloc.key in self.flagged:
            return None
        self.flagged.add(alloc.key)
        self.flags += 1
        how = "under-reports" if gap < 0 else "over-reports"
        return (
            f"the memguard usage file of container {alloc.who()} {how} its GPU memory: it says "
            f"{format_bytes(file_used)}, the driver (NVML) counts {format_bytes(driver_used)} for its "
            f"processes (allowance {format_bytes(self.allowance)}); decisions about other containers "
            f"use the larger figure"
        )

    def forget(self, keys: Iterable[str]) -> None:
        for k in keys:
            self.since.pop(k, None)
            self.flagged.discard(k)
