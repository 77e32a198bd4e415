"""GPU processes as the driver lists them, each with the kubelet container its cgroup names.

NVML's per-process memory (nvmlDeviceGetComputeRunningProcesses) is what the watchdog holds
each container to and what the arbiter counts a container as holding (gpufrac.agent.gpu.truth):
a tenant can write its own usage file, not the driver's count. Reading it blocks (NVML, one
/proc read per process): callers run it in a worker thread.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
from dataclasses import dataclass
from typing import Protocol

import pynvml  # nvidia-ml-py ships no types

from gpufrac.agent.gpu.inventory import query_gpus
from gpufrac.agent.processes.callers import (
    CgroupIdentity,
    CgroupUnreadable,
    ContainerOwner,
    PeerError,
    ProcessGone,
    cgroup_of,
)
from gpufrac.agent.processes.proc import start_time

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GpuProcess:
    """One process's memory on one GPU, as NVML reports it."""

    pid: int
    gpu: str  # GPU UUID
    used: int  # bytes
    start: int = 0  # start time in clock ticks after boot (/proc/<pid>/stat): newest first


@dataclass(frozen=True)
class Observed:
    """A GPU process and the kubelet container its cgroup names (None: not in one, or not
    known: `unreadable` then says why). `hidden`: it lives, and the kernel refuses its cgroup
    file (a path past PATH_MAX, made on purpose): no one's, and the watchdog's to kill
    (gpufrac.agent.watchdog.service). Not hidden for a reason that is the agent's own (out of files)."""

    proc: GpuProcess
    cgroup: CgroupIdentity | None
    unreadable: str = ""
    hidden: bool = False


class Lookup(Protocol):
    """Which gpufrac container a kubelet container is, with its allocations
    (gpufrac.agent.processes.callers.PeerLookup)."""

    def owner(self, pod_uid: str, container_id: str) -> ContainerOwner | None: ...


def read_gpu_processes() -> list[GpuProcess]:
    """Compute processes and their used memory on every GPU (blocking NVML calls).
    Processes whose memory NVML cannot attribute (usedGpuMemory unavailable) count as 0."""
    out: list[GpuProcess] = []
    for _, uuid, procs in query_gpus("watchdog: processes", pynvml.nvmlDeviceGetComputeRunningProcesses):
        for p in procs:
            used = p.usedGpuMemory
            out.append(GpuProcess(int(p.pid), uuid, int(used) if isinstance(used, int) else 0))
    return out


@functools.cache
def _say_cannot_pin(error: str) -> None:
    """Said once per kind of error: a node out of files would say it at every reading."""
    log.warning("GPU processes: cannot pin a process (%s): left out of the reading", error)


def _pidfd(pid: int) -> int | None:
    """A pidfd of the process that has `pid` now, None when there is none or none can be
    had (out of files or memory: that process is left out of this reading)."""
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        return None
    except OSError as e:
        _say_cannot_pin(e.strerror or str(e))
        return None


def _alive(pidfd: int) -> bool:
    """Whether the process a pidfd names has not exited (a signal 0 through the pidfd: it
    cannot reach a process that merely has the same pid number)."""
    try:
        signal.pidfd_send_signal(pidfd, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists; the agent may not signal it (not root: tests, a dev box)
    return True


def observe(proc_root: str = "/proc") -> list[Observed]:
    """NVML's GPU processes, each with its container's cgroup identity (blocking).

    NVML names processes by pid, and a pid names another process once the first has exited
    and been reaped: read naively, a pid reused between NVML's listing and the /proc read
    would charge one container's memory to another (a neighbour watchdog-killed or evicted
    for it). So every pid is pinned:

    1. NVML lists the processes (L1); a pidfd is opened for each pid listed;
    2. each process's cgroup and start time are read through /proc;
    3. NVML lists them again (L2), and each pidfd is asked whether its process is alive.

    A process counts only if its pidfd's process is still alive after L2 and L2 lists its
    pid; its memory is L2's figure. A process alive through (1)..(3) held the pid all that
    time, so the cgroup read in (2) and L2's line are that one process's. What cannot be
    confirmed is left out of this reading (counted again in the next one), never attributed.

    A process that lives but whose cgroup file the kernel refuses (gpufrac.agent.processes.callers
    .cgroup_of) is not left out: it counts as hidden, with no container and the reason, for
    the watchdog to kill or report; one the agent could not look at (out of files) counts with
    no container and the reason, reported.

    A pid reused between L1 and the pidfd_open right after it gives a pidfd of the new
    process: its own cgroup is read, and L2 (taken later) lists the pid with its own memory
    or not at all, so nothing is charged to the wrong container.

    What remains: L2's line for a pid is taken to be the process that holds the pid then. A
    driver still listing a process after it exited and its pid went to another (teardown
    lagging behind the reaping) would charge the dead one's memory to the new holder's
    container; the driver releases a process's contexts as it exits, before its parent can
    reap it. And a pidfd pins a process, not its pid number once that process is reaped:
    the liveness check therefore comes after L2, never before."""
    first = read_gpu_processes()
    pinned: dict[int, int] = {}  # pid -> pidfd
    read_at: dict[int, tuple[CgroupIdentity | None, int, str, bool]] = {}
    try:
        for pid in dict.fromkeys(p.pid for p in first):
            fd = _pidfd(pid)
            if fd is not None:
                pinned[pid] = fd
        for pid in pinned:
            why, hidden = "", False
            try:
                ident = cgroup_of(pid, proc_root)
            except ProcessGone:
                continue  # exited since NVML listed it
            except CgroupUnreadable as e:
                ident, why, hidden = None, str(e), True
            except PeerError as e:
                ident, why = None, str(e)  # alive, its container unknown: reported, not dropped
            read_at[pid] = (ident, start_time(pid, proc_root), why, hidden)
        second = read_gpu_processes() if read_at else []
        confirmed = {pid for pid in read_at if _alive(pinned[pid])}
    finally:
        for fd in pinned.values():
            os.close(fd)
    out = []
    for p in second:
        if p.pid not in confirmed:
            continue  # not pinned in L1, or gone (its pid may be another process's now)
        ident, start, why, hidden = read_at[p.pid]
        out.append(Observed(GpuProcess(p.pid, p.gpu, p.used, start), ident, why, hidden))
    return out
