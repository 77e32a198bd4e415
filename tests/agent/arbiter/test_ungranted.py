"""Memory above the request that no grant covers is a burst like any other.

A process that does not load the shim can allocate up to its container's limit without
asking the arbiter for a grant. That memory is weighed like any burst: a neighbour's
guarantee takes it back (arbiter/resolvers.py EvictResolver, arbiter/grants.py ungranted).

One 1 GiB GPU (992 MiB usable, 960 MiB allocatable, 64 MiB units, grant margin 16 MiB);
the real agent, real shim, real workload processes (tests/fixtures/e2e.py).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from gpufrac.agent.kube.events import REASON_EVICTED
from tests.fixtures.e2e import E2ENode, MiB
from tests.fixtures.hostile_tenant import agent_alive, agent_config, exec_in
from tests.fixtures.polling import until

pytestmark = pytest.mark.security

MakeNode = Callable[..., E2ENode]


def test_a_guarantee_takes_back_memory_a_shimless_process_holds_without_a_grant(e2e_node: MakeNode) -> None:
    # The watchdog only reports here: the reclaim alone must take the memory back.
    node = e2e_node(**agent_config(resolvers=["evict", "wait"], watchdog={"mode": "report"}))
    a = node.run_pod("a", 2, "896Mi")  # request 128 MiB, may go to 896 MiB with grants
    hog = exec_in(a, shim=False, name="hog")
    assert hog.do(f"alloc {450 * MiB} 1") == "ok 1"  # no grant asked, none given
    assert a.grant() == 0
    b = node.run_pod("b", 10, None, wait_timeout="10s")  # request 640 MiB
    # About 380 MiB are free on the GPU: b's allocation inside its guarantee needs a's
    # ungranted 322 MiB back.
    assert b.alloc(600 * MiB) == "ok 1"
    assert b.app.do("check 1") == "ok"
    until(lambda: hog.proc.poll() is not None, what="the shimless hog to be evicted")
    (ev,) = until(lambda: node.events(a, REASON_EVICTED), what="the eviction Event on a")
    assert "within its guarantee" in ev["message"], ev
    assert node.events(b, REASON_EVICTED) == []
    assert agent_alive(node)
