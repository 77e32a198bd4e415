"""What the status model adds from outside the agent's state: NVML's memory and utilisation
per GPU, and each container's memguard usage file. Blocking reads, in whichever thread calls
(an HTTP server's), never on the agent's loop."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from gpufrac.agent.status.model import NodeStatus, UsageView
from gpufrac.memguard import abi

log = logging.getLogger(__name__)


def read_gpu_live(uuids: Iterable[str]) -> dict[str, tuple[int | None, float | None]]:
    """uuid -> (memory used bytes, utilisation 0..1) from NVML; (None, None) where it fails."""
    # nvidia-ml-py ships no type information; NVML is imported where it is used, as the
    # inventory does, so that importing the status model needs no driver.
    import pynvml

    from gpufrac.agent.gpu.inventory import NvmlError, query_gpus

    def live(h: object) -> tuple[int, float]:
        used = int(pynvml.nvmlDeviceGetMemoryInfo(h).used)
        return used, float(pynvml.nvmlDeviceGetUtilizationRates(h).gpu) / 100.0

    wanted = set(uuids)
    out: dict[str, tuple[int | None, float | None]] = dict.fromkeys(wanted, (None, None))
    try:
        # Debug level: every scrape asks, and a GPU without utilisation (MIG) would fill the log.
        for _, uuid, figures in query_gpus("live figures", live, logging.DEBUG):
            if uuid in wanted:
                out[uuid] = figures
    except NvmlError as e:
        log.warning("NVML unavailable for live GPU figures: %s", e)
    return out


def idle_seconds(usage: abi.UsageStruct, since_wall: float, now_mono_ns: int | None = None) -> float:
    """Seconds since the container's last GPU work (a kernel launch by any of its processes);
    since `since_wall` (its allocation) when none of its live processes has launched yet.
    The shim stamps launches with CLOCK_MONOTONIC, the clock of time.monotonic_ns()."""
    now = time.monotonic_ns() if now_mono_ns is None else now_mono_ns
    last = max((int(s.last_activity_ns) for s in abi.live_slots(usage)), default=0)
    if last:
        return max(0.0, (now - last) / 1e9)
    return max(0.0, time.time() - since_wall)


def read_usage_view(directory: str, since_wall: float) -> UsageView | None:
    try:
        u = abi.read_usage(directory)
    except abi.FormatError:
        return None
    live = abi.live_slots(u)
    return UsageView(
        used_bytes=int(u.total_used),
        processes=len(live),
        idle_seconds=idle_seconds(u, since_wall),
        oom_refusals=sum(int(s.oom_refusals) for s in live),
        swapped_bytes=sum(int(s.used_bytes) for s in live if s.swapped),
        slot_refusals={(int(s.pid), int(s.start_time)): int(s.oom_refusals) for s in live},
    )


def enrich(status: NodeStatus) -> dict[str, UsageView]:
    """Fill in NVML and usage-file figures (blocking I/O: never on the loop).
    Returns the usage views by container key for callers that want the detail."""
    live = read_gpu_live(g.uuid for g in status.gpus)
    for g in status.gpus:
        g.memory_used_bytes, g.utilization_ratio = live.get(g.uuid, (None, None))
    views: dict[str, UsageView] = {}
    for c in status.containers:
        v = read_usage_view(c.directory, c.created)
        if v is None:
            continue
        views[c.key] = v
        c.used_bytes, c.processes = v.used_bytes, v.processes
        # The activity tracker's figure (NVML too) unless the usage file shows a fresher launch.
        c.idle_seconds = v.idle_seconds if c.idle_seconds is None else min(c.idle_seconds, v.idle_seconds)
        c.oom_refusals, c.swapped_bytes = v.oom_refusals, v.swapped_bytes
    return views
