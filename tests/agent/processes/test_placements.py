"""Where the compute loop places a GPU process (gpufrac.agent.processes.placements): read once
and kept while the process lives, read again once old (a process moved by whoever may write the
cgroup tree is placed where it is), and nothing for a process that has gone.

Real processes in real cgroups (gpufrac.simgpu.runtime names them as the kubelet does).
"""

from __future__ import annotations

import uuid

from gpufrac.agent.processes.placements import Placements
from gpufrac.simgpu.runtime import ContainerRuntime


def test_a_live_process_is_read_once_then_kept(runtime: ContainerRuntime) -> None:
    pod = str(uuid.uuid4())
    c = runtime.start(pod, "main", ["sleep", "60"])
    runtime.wait_entered(c)
    places = Placements()
    try:
        for _ in range(5):
            got = places.lookup([c.proc.pid])[c.proc.pid]
            assert got is not None and (got.pod_uid, got.container_id) == (pod, c.container_id)
        assert places.reads == 1  # one cgroup read for five periods
    finally:
        places.close()


def test_a_process_moved_to_another_container_is_placed_there_once_its_placement_is_old(
    runtime: ContainerRuntime,
) -> None:
    """A placement kept for good would charge a moved process's GPU time to the container it
    left for as long as it lives."""
    a_pod, b_pod = str(uuid.uuid4()), str(uuid.uuid4())
    a = runtime.start(a_pod, "a", ["sleep", "60"])
    b = runtime.start(b_pod, "b", ["sleep", "60"])
    runtime.wait_entered(a)
    runtime.wait_entered(b)
    now = [100.0]
    places = Placements(max_age_s=5.0, clock=lambda: now[0])
    pid = a.proc.pid
    try:
        first = places.lookup([pid])[pid]
        assert first is not None and first.pod_uid == a_pod
        (b.cgroup_dir / "cgroup.procs").write_text(str(pid))  # moved by the root
        now[0] += 1.0
        kept = places.lookup([pid])[pid]
        assert kept is not None and kept.pod_uid == a_pod  # young: not read again
        now[0] += 5.0
        moved = places.lookup([pid])[pid]
        assert moved is not None and (moved.pod_uid, moved.container_id) == (b_pod, b.container_id)
        assert places.reads == 2
    finally:
        places.close()


def test_a_process_that_exited_is_no_ones(runtime: ContainerRuntime) -> None:
    pod = str(uuid.uuid4())
    c = runtime.start(pod, "main", ["sleep", "60"])
    runtime.wait_entered(c)
    places = Placements()
    pid = c.proc.pid
    try:
        assert places.lookup([pid])[pid] is not None
        c.kill()
        c.wait(30)  # reaped: the pid is free
        assert places.lookup([pid])[pid] is None
    finally:
        places.close()
