"""GPU processes as the driver lists them, each with the kubelet container its cgroup names.

NVML's per-process memory (nvmlDeviceGetComputeRunningProcesses) is what the watchdog holds
each container to and what the arbiter counts a container as holding (gpufrac.agent.truth):
a tenant can write its own usage file, not the driver's count. Reading it blocks (NVML, one
/proc read per process): callers run it in a worker thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import pynvml  # nvidia-ml-py ships no types

from gpufrac.agent.callers import CgroupIdentity, PeerError, read_cgroup
from gpufrac.agent.inventory import query_gpus
from gpufrac.agent.ledger import ContainerAlloc


@dataclass(frozen=True)
class GpuProcess:
    """One process's memory on one GPU, as NVML reports it."""

    pid: int
    gpu: str  # GPU UUID
    used: int  # bytes
    start: int = 0  # start time in clock ticks after boot (/proc/<pid>/stat): newest first


@dataclass(frozen=True)
class Observed:
    """A GPU process and the kubelet container its cgroup names (None: not in one)."""

    proc: GpuProcess
    cgroup: CgroupIdentity | None


class Lookup(Protocol):
    """Which gpufrac allocation a kubelet container holds (gpufrac.agent.callers.PeerLookup)."""

    def allocation(self, pod_uid: str, container_id: str) -> ContainerAlloc: ...


def read_gpu_processes() -> list[GpuProcess]:
    """Compute processes and their used memory on every GPU (blocking NVML calls).
    Processes whose memory NVML cannot attribute (usedGpuMemory unavailable) count as 0."""
    out: list[GpuProcess] = []
    for _, uuid, procs in query_gpus("watchdog: processes", pynvml.nvmlDeviceGetComputeRunningProcesses):
        for p in procs:
            used = p.usedGpuMemory
            out.append(GpuProcess(int(p.pid), uuid, int(used) if isinstance(used, int) else 0))
    return out


def start_time(pid: int, proc_root: str = "/proc") -> int:
    """A process's start time (clock ticks after boot), 0 when it is gone."""
    try:
        with open(f"{proc_root}/{pid}/stat", "rb") as f:
            stat = f.read()
        # Field 22; the command name (field 2) may hold spaces and parentheses: split after it.
        return int(stat[stat.rindex(b")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return 0


def observe(proc_root: str = "/proc") -> list[Observed]:
    """NVML's GPU processes, each with its container's cgroup identity (blocking)."""
    out = []
    for p in read_gpu_processes():
        try:
            ident = read_cgroup(p.pid, proc_root)
        except PeerError:
            continue  # exited since NVML listed it
        out.append(Observed(GpuProcess(p.pid, p.gpu, p.used, start_time(p.pid, proc_root)), ident))
    return out
