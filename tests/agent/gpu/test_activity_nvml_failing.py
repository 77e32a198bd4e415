"""A GPU whose NVML per-process utilisation call fails does not make busy containers idle.

Where NVML gives per-process samples, the activity tracker (gpufrac.agent.gpu.activity) counts a
container's launch counters only when the driver sampled one of its processes in the same
window. When nvmlDeviceGetProcessUtilization fails with an error other than NOT_FOUND (no
samples) or NOT_SUPPORTED (never any), no samples are no evidence of idleness: the container's
launches must still count for that poll, or a container that keeps working is reaped as idle.

The failure is simgpu's own fault injection (gpufrac.simgpu.faults.fall_off_bus): the GPU
falls off the bus and every NVML call on it answers NVML_ERROR_GPU_IS_LOST, as the driver
does. nvidia-ml-py loads simgpu's fake libnvidia-ml in this process; the tracker's clock is a
manual one, so the test waits for nothing.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pynvml

from gpufrac.agent.gpu.activity import ActivityTracker, NvmlUtilisation, Tracked
from gpufrac.memguard import abi
from gpufrac.simgpu import faults
from tests.fixtures.simnode import SimNode


class ManualClock:
    """The tracker's time sources, moved only by the test."""

    def __init__(self) -> None:
        self.mono = 1000.0
        self.wall = time.time()

    def monotonic(self) -> float:
        return self.mono

    def monotonic_ns(self) -> int:
        return int(self.mono * 1e9)

    def time(self) -> float:
        return self.wall

    def advance(self, s: float) -> None:
        self.mono += s
        self.wall += s


def launch(directory: Path, clock: ManualClock) -> None:
    """What the shim does on a kernel launch: bump the slot's counter and stamp it."""
    u = abi.UsageFile(directory)
    try:
        slot = u.usage.slots[0]
        slot.pid = os.getpid()
        slot.start_time = 1
        slot.launches += 1
        slot.last_activity_ns = clock.monotonic_ns()
        del slot  # a view into the mapping: gone before it closes
    finally:
        u.close()


def test_a_gpu_whose_utilisation_call_fails_leaves_its_containers_to_their_launch_counts(
    in_process_nvml: SimNode, tmp_path: Path
) -> None:
    uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(0))
    abi.create_usage(tmp_path, durable=False)
    clock = ManualClock()
    busy = Tracked("busy", str(tmp_path), (uuid,), clock.time())

    async def main() -> None:
        nvml = await asyncio.to_thread(NvmlUtilisation)
        tracker = ActivityTracker(nvml=nvml, clock=clock)
        try:
            launch(tmp_path, clock)
            await tracker.poll([busy])  # the GPU answers: no samples yet (NOT_FOUND)
            faults.fall_off_bus(in_process_nvml.path, 0)
            for _ in range(3):
                clock.advance(60)
                launch(tmp_path, clock)
                await tracker.poll([busy])
                got = tracker.get("busy")
                assert got is not None
                assert (got.why, tracker.idle_seconds("busy")) == ("launch", 0.0)
        finally:
            await asyncio.to_thread(nvml.close)

    asyncio.run(main())
