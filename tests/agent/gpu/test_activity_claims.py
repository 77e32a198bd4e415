"""A usage-file slot claiming a process outside the container earns it no GPU activity.

The activity tracker credits a container with the driver's samples of the processes its
usage slots name (gpufrac.agent.gpu.activity), and lets the file's own launches count once the
driver has sampled one of them. The usage file is the tenant's to write: a slot naming a
busy GPU process that is not the container's (here a host process in no kubelet pod) must
not make an idle container look busy. The kernel decides: the process's cgroup must name
the container's pod and one of its container IDs.

One 1 GiB GPU; the real agent, real shim, real workload processes (tests/fixtures/e2e.py);
the busy process is the real CUDA workload on the same simulated GPU, started on the host.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpufrac.agent.processes.proc import proc_identity
from gpufrac.simgpu.workload import WorkloadProcess
from tests.fixtures.e2e import E2ENode, MiB
from tests.fixtures.hostile_tenant import IDLE_FAST, Repeating, agent_alive, agent_config, stamp_slots
from tests.fixtures.polling import until

pytestmark = pytest.mark.security

MakeNode = Callable[..., E2ENode]


@pytest.fixture
def claimer() -> Iterator[Callable[[Path, int], None]]:
    """claimer(host_dir, pid): claim host process `pid` in a free slot of the container's usage
    file (as the shim names a process of its own) and stamp the slots every 50 ms until the
    test ends."""
    loop = Repeating()

    def start(host_dir: Path, pid: int) -> None:
        ident = proc_identity(pid)
        assert ident is not None
        loop.start(lambda: stamp_slots(host_dir, claim=ident))

    yield start
    loop.close()


def test_a_slot_claiming_a_busy_host_process_does_not_keep_an_idle_container_from_being_reaped(
    e2e_node: MakeNode, claimer: Callable[[Path, int], None]
) -> None:
    node = e2e_node(**agent_config(idle=IDLE_FAST))
    host = WorkloadProcess.spawn(node.app_env(), "host")  # in no kubelet pod, no shim
    try:
        assert host.do(f"alloc {64 * MiB} 1") == "ok 1"
        host.send("busy 600000000")  # a 600 s kernel: the driver samples it busy all along
        a = node.run_pod("a", 2, "256Mi")
        assert a.alloc(64 * MiB) == "ok 1"  # it holds GPU memory and does no GPU work
        claimer(a.host_dir, host.proc.pid)
        # Idle on the driver's word: the claimed process's work is not a's.
        until(lambda: node.events(a, "IdleWarning"), what="the IdleWarning Event")
        (ev,) = until(lambda: node.events(a, "IdleNotify"), what="the IdleNotify Event")
        assert "idle" in ev["message"], ev
        assert f"claims process {host.proc.pid}," in node.sim.agent.log()  # named in the log
        assert agent_alive(node)
    finally:
        host.proc.kill()
        host.proc.wait(30)
