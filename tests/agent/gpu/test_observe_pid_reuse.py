"""A pid reused between NVML's listing and the /proc read is not charged to its new holder.

The watchdog and the arbiter count each container's GPU memory from NVML's per-process list,
attributed by each process's cgroup (gpufrac.agent.gpu.processes.observe). NVML names
processes by pid; a tenant's GPU process that exits right after NVML listed it, its pid
handed to a neighbour's new process before the agent reads /proc/<pid>/cgroup, must not have
its memory charged to the neighbour (which the watchdog could then kill, or the arbiter
evict, for memory it never held).

Real processes: the tenant is a workload under the real shim holding memory on simgpu (NVML
in this process lists it), the neighbour's process lives in a real cgroup named as the
kubelet names it, and the pid goes to it through ns_last_pid as the kernel's pid allocator
would in time. The moment between the listing and the cgroup read is hit by doing the swap
in the cgroup reader the agent calls.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import uuid
from pathlib import Path

import pytest

from gpufrac.agent.gpu import processes as gpu_processes
from gpufrac.agent.processes import callers
from gpufrac.agent.processes.callers import CgroupIdentity
from gpufrac.simgpu.runtime import ContainerRuntime
from tests.fixtures.hostile_tenant import spawn_with_pid
from tests.fixtures.memguard import Shim, holding_workload
from tests.fixtures.simnode import SimNode

pytestmark = pytest.mark.security

MiB = 1 << 20
GiB = 1 << 30


def holding(
    shim: Shim, directory: Path, nbytes: int
) -> contextlib.AbstractContextManager[subprocess.Popen[str]]:
    """A workload under the shim that allocates `nbytes` on the GPU and holds them."""
    return holding_workload(shim, directory, "alloc", nbytes, "hold")


# Tries at handing the tenant's pid over: another fork on the machine may take it first.
ATTEMPTS = 5


def test_a_pid_reused_between_the_listing_and_the_cgroup_read_is_not_charged_to_its_new_holder(
    in_process_nvml: SimNode, runtime: ContainerRuntime, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pod = str(uuid.uuid4())
    neighbour = runtime.start(pod, "neighbour", ["sleep", "60"])
    runtime.wait_entered(neighbour)
    shim = Shim(in_process_nvml.env, "release")
    real_read = callers.cgroup_of
    for attempt in range(ATTEMPTS):
        heirs: list[int | None] = []
        with (
            holding(shim, tmp_path / f"tenant{attempt}", 300 * MiB) as tenant,
            holding(shim, tmp_path / f"other{attempt}", 64 * MiB) as other,
        ):
            listed = {p.pid: p.used for p in gpu_processes.read_gpu_processes()}
            assert listed.get(tenant.pid, 0) >= 300 * MiB and listed.get(other.pid, 0) >= 64 * MiB, listed

            def racing_read(
                pid: int,
                proc: str = "/proc",
                heirs: list[int | None] = heirs,
                tenant: subprocess.Popen[str] = tenant,
            ) -> CgroupIdentity | None:
                # NVML has listed the tenant's process: it exits, is reaped, and its pid goes to
                # a new process of the neighbour's container before the agent reads its cgroup.
                if pid == tenant.pid and not heirs:
                    tenant.kill()
                    tenant.wait(30)
                    heirs.append(spawn_with_pid(pid, neighbour.cgroup_dir / "cgroup.procs"))
                return real_read(pid, proc)

            monkeypatch.setattr(gpu_processes, "cgroup_of", racing_read)
            try:
                seen = gpu_processes.observe()
            finally:
                monkeypatch.setattr(gpu_processes, "cgroup_of", real_read)
                heir = heirs[0] if heirs else None
                if heir is not None:
                    os.kill(heir, signal.SIGKILL)
                    os.waitpid(heir, 0)
            if heir is None:
                continue  # another process took the pid first: again, with a new tenant
            charged = [o for o in seen if o.cgroup is not None and o.cgroup.pod_uid == pod]
            assert charged == [], "the neighbour was charged the dead tenant's GPU memory"
            assert [o.proc.pid for o in seen if o.proc.pid == tenant.pid] == []
            # A process that lived through the reading is counted as before.
            (mine,) = [o for o in seen if o.proc.pid == other.pid]
            assert mine.proc.used >= 64 * MiB and mine.proc.start > 0
            break
    else:
        pytest.skip(f"another process took the tenant's pid first, {ATTEMPTS} times")
    neighbour.stop()
