"""A victim with more processes than the agent has file descriptors is still evicted.

Every kill goes through a pidfd (gpufrac.agent.processes.kill). Holding one per victim process until
all had exited, a container of a few hundred processes ran the agent out of descriptors, the
processes past that point were taken for "already gone" and never signalled, and the last one
started (the one holding GPU memory, as a tenant would arrange it) lived on while the eviction
was counted done. Now each pidfd is closed once its signal is sent, exits are waited for a
batch at a time, a pidfd that cannot be had is a failure (never "gone"), and the processes
the driver counts for the victim are signalled first.

One 1 GiB GPU (992 MiB usable, 960 MiB allocatable, 64 MiB units, grant margin 16 MiB);
the real agent (its file limit lowered from outside, as a container runtime's would be),
real shim, real workload processes in real cgroups (tests/fixtures/e2e.py).
"""

from __future__ import annotations

import os
import resource
import subprocess
import threading
from collections.abc import Callable

import pytest

from gpufrac.agent.kube.events import REASON_EVICTED
from gpufrac.simgpu.runtime import _ENTER
from tests.fixtures.e2e import E2ENode, MiB, PodRun
from tests.fixtures.hostile_tenant import agent_alive, agent_config, exec_in
from tests.fixtures.polling import until

pytestmark = pytest.mark.security

MakeNode = Callable[..., E2ENode]
CROWD = 300  # processes in the victim's container
HEADROOM = 100  # descriptors the agent may open beyond those it holds


def crowd_in(pod: PodRun, n: int) -> subprocess.Popen[bytes]:
    """`n` sleeping processes in `pod`'s container, started from a shell in its cgroup."""
    script = f"for i in $(seq {n}); do sleep 3600 & done; echo ready; wait"
    shell = subprocess.Popen(
        ["/bin/sh", "-c", _ENTER, "sh", "/bin/sh", "-c", script],
        env=pod.container.env,
        stdout=subprocess.PIPE,
    )
    threading.Thread(target=shell.wait, name="reap-crowd", daemon=True).start()
    assert shell.stdout is not None and shell.stdout.readline().strip() == b"ready"
    return shell


@pytest.fixture
def low_file_limit() -> Callable[[int], None]:
    """lower(pid): that process may open HEADROOM more files than the highest it holds now."""

    def lower(pid: int) -> None:
        highest = max(int(fd) for fd in os.listdir(f"/proc/{pid}/fd"))
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (highest + 1 + HEADROOM,) * 2)

    return lower


def test_a_victim_with_more_processes_than_the_agent_has_files_is_evicted(
    e2e_node: MakeNode, low_file_limit: Callable[[int], None]
) -> None:
    # The watchdog only reports here: the eviction alone must take the memory back.
    node = e2e_node(**agent_config(resolvers=["evict", "wait"], watchdog={"mode": "report"}))
    a = node.run_pod("a", 2, "896Mi")  # request 128 MiB, may go to 896 MiB with grants
    crowd = crowd_in(a, CROWD)
    hog = exec_in(a, shim=False, name="hog")  # started last: the highest pid of the container
    assert hog.do(f"alloc {450 * MiB} 1") == "ok 1"  # no grant asked, none given
    low_file_limit(node.sim.agent.pid)
    # b's request is taken back for it as soon as it is admitted, and again when it allocates.
    b = node.run_pod("b", 10, None, wait_timeout="15s")  # request 640 MiB
    # About 540 MiB are free: b's allocation inside its guarantee needs a's 322 MiB back.
    assert b.alloc(600 * MiB) == "ok 1"
    assert b.app.do("check 1") == "ok"
    until(lambda: hog.proc.poll() is not None, what="the GPU process of a to be killed")
    until(lambda: crowd.poll() is not None, what="the rest of a's container to be killed")
    (ev,) = until(lambda: node.events(a, REASON_EVICTED), what="the eviction Event on a")
    assert f"{CROWD + 3} process(es)" in ev["message"], ev  # the crowd, its shell, main, hog
    assert agent_alive(node)
