"""A pid the kernel hands to another container's process never inherits the placement kept for
the process that had it (gpufrac.agent.processes.placements keeps each with a pidfd).

The compute loop charges a GPU process's driver-measured time to the container it is placed in,
and holds that container back for it: a stale placement would charge a neighbour's work to a
tenant whose process had the pid before, or a tenant's work to a neighbour. Real processes in
real cgroups; the pid is handed over through ns_last_pid, as the kernel's allocator would in time.
"""

from __future__ import annotations

import os
import signal
import uuid

import pytest

from gpufrac.agent.processes.placements import Placements
from gpufrac.simgpu.runtime import ContainerRuntime
from tests.fixtures.hostile_tenant import spawn_with_pid

# Needs the node to itself: the pid it wants goes through ns_last_pid, which any fork may take
# first (as tests/agent/processes/test_known_callers_pid_reuse.py).
pytestmark = [pytest.mark.serial, pytest.mark.security]


def test_a_reused_pid_is_placed_in_its_new_owners_container(runtime: ContainerRuntime) -> None:
    gone_pod, heir_pod = str(uuid.uuid4()), str(uuid.uuid4())
    heir_home = runtime.start(heir_pod, "heir", ["sleep", "60"])
    runtime.wait_entered(heir_home)
    places = Placements()
    try:
        for _ in range(20):  # another fork on the machine may take the pid first: try again
            old = runtime.start(gone_pod, "old", ["sleep", "60"])
            runtime.wait_entered(old)
            pid = old.proc.pid
            first = places.lookup([pid])[pid]
            assert first is not None and first.pod_uid == gone_pod
            old.kill()
            old.wait(30)
            heir = spawn_with_pid(pid, heir_home.cgroup_dir / "cgroup.procs")
            if heir is not None:
                break
        else:
            pytest.skip("the pid was always taken by another process first")
        try:
            got = places.lookup([pid])[pid]
            assert got is not None and (got.pod_uid, got.container_id) == (heir_pod, heir_home.container_id)
        finally:
            os.kill(heir, signal.SIGKILL)
            os.waitpid(heir, 0)
    finally:
        places.close()
