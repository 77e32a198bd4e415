"""An eviction kills the container as it is now, not as a caller of it was once seen.

A container's processes are found for a kill from the pod's status as it is at the kill: its
pod UID and the container IDs the status gives the container's name, and the processes the
driver counted for it (gpufrac.agent.processes.callers.PeerLookup.pids_of, gpufrac.agent.processes.kill
.kill_container). A restarted container has a new container ID under the same allocation key;
had the agent kept the ID it saw when the container last asked the arbiter for something, the
kill would look for processes of the old container, kill nobody, and the neighbour whose
guarantee the restarted container holds would be refused for good. A victim whose GPU
processes live on after the kill is a failed eviction, never counted done.

One 1 GiB GPU (992 MiB usable, 960 MiB allocatable, 64 MiB units, grant margin 16 MiB);
the real agent, real shim, real workload processes in real cgroups (tests/fixtures/e2e.py).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from gpufrac.agent.kube.events import REASON_EVICTED, REASON_USAGE_MISMATCH
from tests.fixtures.e2e import E2ENode, MiB
from tests.fixtures.hostile_tenant import agent_alive, agent_config
from tests.fixtures.pod_containers import restart
from tests.fixtures.polling import until

pytestmark = pytest.mark.security

MakeNode = Callable[..., E2ENode]


def test_a_restarted_container_holding_a_guarantee_is_evicted_for_it(e2e_node: MakeNode) -> None:
    node = e2e_node(**agent_config(resolvers=["evict", "wait"]))
    a = node.run_pod("a", 2, "896Mi")  # request 128 MiB, may go to 896 MiB with grants
    # A burst through the shim: a's container asks the arbiter, which sees its container ID.
    assert a.alloc(100 * MiB) == "ok 1"
    assert a.alloc(200 * MiB, 2) == "ok 2"
    assert a.grant() > 0
    old = a.container.container_id
    a.app.close()  # its PID 1 exits; the kubelet starts the container again
    a = restart(node, a, shim=False)
    assert a.container.container_id != old
    # The new container runs without the shim: 450 MiB, above its request, no grant asked.
    assert a.app.do(f"alloc {450 * MiB} 1") == "ok 1"
    # The agent counts it as a's (the driver's count against the usage file).
    until(lambda: node.events(a, REASON_USAGE_MISMATCH), what="the restarted container counted as a's")
    b = node.run_pod("b", 10, None, wait_timeout="10s")  # request 640 MiB
    # About 540 MiB are free: b's allocation inside its guarantee needs a's 322 MiB burst back.
    assert b.alloc(600 * MiB) == "ok 1"
    assert b.app.do("check 1") == "ok"
    until(lambda: not a.alive(), what="the restarted container's process to be killed")
    (ev,) = until(lambda: node.events(a, REASON_EVICTED), what="the eviction Event on a")
    assert "1 process(es)" in ev["message"] and "within its guarantee" in ev["message"], ev
    assert node.events(b, REASON_EVICTED) == []
    assert agent_alive(node)
