"""A guarantee holds whatever the neighbours declare.

`preemptible: "false"` shields a burst from other containers' bursts, never from a
neighbour's guarantee: a burst is borrowed memory. When a container's request is not
physically free (a newcomer admitted while bursts hold unrequested memory, or an owner
taking back its lent guarantee) the agent reclaims it with an evict step that takes
non-preemptible bursts too, after preemptible ones, and even where the node's `resolvers`
leave evict out (gpufrac.agent.arbiter.resolvers.EvictResolver.victims, guarantee_chain;
gpufrac.agent.arbiter.admission.reclaim_guarantee).

One 1 GiB GPU (960 MiB allocatable, 64 MiB units, grant margin 16 MiB); the real agent,
real shim, real workload processes (tests/fixtures/e2e.py). Node resolvers: wait only.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from gpufrac.agent.kube.events import REASON_EVICTED, REASON_GUARANTEE_AT_RISK
from tests.fixtures.e2e import E2ENode, MiB, PodRun
from tests.fixtures.hostile_tenant import agent_alive, agent_config
from tests.fixtures.polling import until

pytestmark = pytest.mark.security

MakeNode = Callable[..., E2ENode]


def unpreemptible_borrower(node: E2ENode) -> PodRun:
    """Pod "a": request 128 MiB, not preemptible, not swappable, bursting to 700 MiB."""
    a = node.run_pod("a", 2, "896Mi", preemptible=False, wait_timeout="0s")
    assert a.alloc(100 * MiB, 1) == "ok 1"
    assert a.alloc(600 * MiB, 2) == "ok 2"  # a burst of about 572 MiB, from unrequested memory
    assert a.grant() > 500 * MiB
    return a


def test_a_later_containers_guarantee_beats_a_non_preemptible_burst(e2e_node: MakeNode) -> None:
    node = e2e_node(**agent_config())  # resolvers: [wait]
    a = unpreemptible_borrower(node)
    # b: a 512 MiB request, admitted against unrequested memory that a's burst holds.
    b = node.run_pod("b", 8, None)
    assert b.alloc(500 * MiB, 9) == "ok 1"
    assert b.app.do("check 1") == "ok" and b.alive()
    until(lambda: not a.alive(), what="a's burst taken back")
    (ev,) = until(lambda: node.events(a, REASON_EVICTED), what="the Evicted Event on a")
    assert "guarantee" in ev["message"], ev
    assert node.events(b, REASON_GUARANTEE_AT_RISK) == []
    assert agent_alive(node)


def test_an_owner_takes_its_lent_guarantee_back_from_a_non_preemptible_burst(e2e_node: MakeNode) -> None:
    node = e2e_node(**agent_config(lendUnusedRequests=True))  # resolvers: [wait]
    b = node.run_pod("b", 8, None, wait_timeout="30s")  # 512 MiB request
    assert b.alloc(32 * MiB, 1) == "ok 1"  # b uses little of it: the rest may be lent
    a = unpreemptible_borrower(node)  # borrows most of b's unused guarantee
    # b allocates up to its request: the driver has not the memory, its shim sends RECLAIM.
    assert b.alloc(448 * MiB, 2) == "ok 2"
    assert b.app.do("check 1") == "ok" and b.app.do("check 2") == "ok"
    until(lambda: not a.alive(), what="a's burst taken back")
    assert node.events(a, REASON_EVICTED)
    assert agent_alive(node)
