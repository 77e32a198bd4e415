"""What a reclaim takes is judged on whole driver counts: a zeroed counter cannot inflate it.

A RECLAIM ("the driver refused an allocation within my request") takes neighbours' bursts
back, as much as the requester's guarantee is missing: its request less what it holds, beyond
what the GPU has free less what the other containers may still charge within their request +
grant. Every container's holding there was the larger of its usage file and NVML's count for
its processes less one context allowance, as a victim's is taken (that makes a victim look
smaller, which is conservative toward it). Here it is the wrong side: a requester, or a
neighbour, that zeroed its counter looked smaller by up to the allowance, the shortfall larger
by as much, and the reclaim evicted a burst it did not need. Holdings there are now NVML's
whole count (gpufrac.agent.arbiter.readings.DriverReadings.whole_count,
Resolution.guarantee_shortfall).

One 1 GiB GPU (992 MiB usable, 960 MiB allocatable, 64 MiB units, grant margin 16 MiB),
unused guarantees lent out, the default context allowance (256 MiB); the real agent, real
shim, real workload processes (tests/fixtures/e2e.py).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from gpufrac.agent.kube.events import REASON_EVICTED
from tests.fixtures.e2e import E2ENode, MiB
from tests.fixtures.hostile_tenant import agent_alive, agent_config, zero_usage
from tests.fixtures.polling import until

pytestmark = pytest.mark.security

MakeNode = Callable[..., E2ENode]


def test_a_zeroed_counter_does_not_get_an_unneeded_neighbour_evicted_by_a_reclaim(e2e_node: MakeNode) -> None:
    node = e2e_node(**agent_config(lendUnusedRequests=True, watchdog={"tolerance": "256Mi"}))
    a = node.run_pod("a", 7, None, wait_timeout="30s")  # request 448 MiB = its limit
    assert a.alloc(256 * MiB, 1) == "ok 1"  # within its guarantee; the rest of it is lent out
    # b: 128 MiB request, preemptible, a 224 MiB burst; c: 128 MiB, not preemptible, a 128 MiB
    # burst (a guarantee takes it too, after every preemptible one).
    b = node.run_pod("b", 2, "896Mi", preemptible=True, wait_timeout="10s")
    assert b.alloc(128 * MiB, 1) == "ok 1"
    assert b.alloc(224 * MiB, 2) == "ok 2"
    c = node.run_pod("c", 2, "896Mi", preemptible=False, wait_timeout="10s")
    assert c.alloc(128 * MiB, 1) == "ok 1"
    assert c.alloc(128 * MiB, 2) == "ok 2"
    assert b.grant() > 0 and c.grant() > 0
    # 992 - 256 - 352 - 256 = 128 MiB free. a zeroes its counter and allocates the 192 MiB
    # left of its guarantee: the driver refuses, its shim sends RECLAIM. a really holds 256
    # MiB, so 448 - 256 - (128 - 16) = 80 MiB of its guarantee is missing: b's burst is
    # enough. Counting a as NVML's sum less the 256 MiB allowance (0), the agent found
    # 448 - (128 - 16) = 336 MiB missing and evicted c's burst as well.
    zero_usage(a.host_dir)
    assert a.used() < MiB
    assert a.alloc(192 * MiB, 2) == "ok 2"  # within its guarantee: it gets it
    assert a.app.do("check 1") == "ok" and a.app.do("check 2") == "ok"
    # b's burst was needed and taken.
    until(lambda: not b.alive(), what="b's burst taken back")
    assert node.events(b, REASON_EVICTED)
    # c's was not: alive, its memory intact, its grant kept.
    assert c.alive() and c.app.do("check 1") == "ok" and c.app.do("check 2") == "ok"
    assert c.grant() > 0
    assert node.events(c, REASON_EVICTED) == []
    assert agent_alive(node)


def test_a_neighbour_hiding_its_usage_does_not_get_a_third_evicted_by_a_reclaim(e2e_node: MakeNode) -> None:
    """What the others may still charge within their request + grant is set aside too: a
    neighbour counted less the allowance looked as if it could still charge up to 256 MiB
    of a grant it had filled, and the reclaim took that much more from a third container."""
    node = e2e_node(**agent_config(lendUnusedRequests=True, watchdog={"tolerance": "256Mi"}))
    a = node.run_pod("a", 3, None, wait_timeout="30s")  # request 192 MiB, well-behaved
    assert a.alloc(64 * MiB, 1) == "ok 1"  # the rest of its guarantee is lent out
    # b: preemptible, a 256 MiB burst; c: not preemptible, a 64 MiB burst; x: not
    # preemptible, priority 10 (so after c among the victims), a 128 MiB burst. 128 MiB
    # requests each.
    b = node.run_pod("b", 2, "896Mi", preemptible=True, wait_timeout="10s")
    assert b.alloc(128 * MiB, 1) == "ok 1" and b.alloc(256 * MiB, 2) == "ok 2"
    c = node.run_pod("c", 2, "896Mi", preemptible=False, wait_timeout="10s")
    assert c.alloc(128 * MiB, 1) == "ok 1" and c.alloc(64 * MiB, 2) == "ok 2"
    x = node.run_pod("x", 2, "896Mi", priority=10, preemptible=False, wait_timeout="10s")
    assert x.alloc(128 * MiB, 1) == "ok 1" and x.alloc(128 * MiB, 2) == "ok 2"
    assert b.grant() > 0 and c.grant() > 0 and x.grant() > 0
    zero_usage(x.host_dir)  # x hides the 256 MiB it holds
    assert x.used() < MiB
    # 992 - 64 - 384 - 448 = 96 MiB free. a allocates 127 MiB, within its guarantee (the
    # workload holds a few bytes of its own): the driver refuses, its shim sends RECLAIM.
    # 192 - 64 - (96 - 16) = 48 MiB are missing: b's burst is enough. Counting x as NVML's
    # 256 MiB less the allowance (0), the agent set aside 256 MiB more for x to charge,
    # found 304 MiB missing and evicted c as well.
    assert a.alloc(127 * MiB, 2) == "ok 2"
    assert a.app.do("check 1") == "ok" and a.app.do("check 2") == "ok"
    until(lambda: not b.alive(), what="b's burst taken back")
    assert c.alive() and c.app.do("check 1") == "ok" and c.app.do("check 2") == "ok"
    assert c.grant() > 0
    assert node.events(c, REASON_EVICTED) == []
    assert x.alive() and node.events(x, REASON_EVICTED) == []
    assert agent_alive(node)
