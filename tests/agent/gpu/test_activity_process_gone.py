"""A process that exits in the middle of an activity poll fails only its own part of it.

The activity tracker (gpufrac.agent.gpu.activity) asks NVML which processes ran, then reads each
one's /proc identity and cgroup to learn its container. A process may exit between the two
reads; its cgroup file is then gone. That must leave the process out of the poll, never fail
the whole poll: every other container on the node keeps its figures (an idle reaper or the
arbiter reading a poll that raised would see no container's activity at all).

Real workloads under the real shim on simgpu, sampled by simgpu's NVML in this process. The
moment between the two reads cannot be hit on purpose, so the tracker reads /proc from a
copy (its `proc` seam): each workload's `status` and `stat` as the kernel wrote them, and a
`cgroup` file for the neighbour only (naming its pod's container, as the kubelet's runtime
places it), as the exiting tenant's entry would look then.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import shutil
import subprocess
from pathlib import Path
from uuid import uuid4

import pynvml

from gpufrac.agent.gpu.activity import ActivityTracker, NvmlUtilisation, Tracked
from gpufrac.simgpu.runtime import cgroup_relpath
from tests.fixtures.memguard import Shim, holding_workload, until_hold
from tests.fixtures.simnode import SimNode

MiB = 1 << 20
GiB = 1 << 30


def workload(shim: Shim, directory: Path) -> contextlib.AbstractContextManager[subprocess.Popen[str]]:
    """mg_ctest under the shim: allocates and holds; launches one kernel when told (launch)."""
    return holding_workload(shim, directory, "alloc", 64 * MiB, "hold", "launch", "hold")


def launch(p: subprocess.Popen[str]) -> None:
    assert p.stdin is not None
    p.stdin.write("\n")
    p.stdin.flush()
    until_hold(p)


def test_a_process_gone_between_nvml_and_its_cgroup_read_does_not_fail_the_poll(
    in_process_nvml: SimNode, tmp_path: Path
) -> None:
    uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(0))
    shim = Shim(in_process_nvml.env, "release")
    dirs = {k: tmp_path / k for k in ("tenant", "neighbour")}
    proc = tmp_path / "proc"
    with workload(shim, dirs["tenant"]) as tenant, workload(shim, dirs["neighbour"]) as neighbour:
        nvml = NvmlUtilisation(0)  # threshold 0: any sample is work
        tracker = ActivityTracker(nvml=nvml, proc=str(proc))
        launch(tenant)  # both work after the tracker started: their samples are news to it
        launch(neighbour)
        for p in (tenant, neighbour):
            (proc / str(p.pid)).mkdir(parents=True)
            for f in ("status", "stat"):
                shutil.copyfile(f"/proc/{p.pid}/{f}", proc / str(p.pid) / f)
        # The neighbour's process in its pod's container, as the kubelet's runtime places it
        # (the driver's samples count for a container only for its own processes).
        pod, cid = str(uuid4()), secrets.token_hex(32)
        cgroup = cgroup_relpath(pod, cid, "besteffort", "cgroupfs")
        (proc / str(neighbour.pid) / "cgroup").write_text(f"0::/{cgroup}\n")
        tracked = [
            Tracked("tenant", str(dirs["tenant"]), (uuid,), 0.0),
            Tracked("neighbour", str(dirs["neighbour"]), (uuid,), 0.0, pod),
        ]

        try:
            got = asyncio.run(tracker.poll(tracked, {"neighbour": {cid}}))
        finally:
            nvml.close()
        assert got["neighbour"].why == "nvml"  # the driver saw it work, and the poll says so
        assert (got["tenant"].processes, got["tenant"].launches) == (1, 1)
