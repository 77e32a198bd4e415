"""Report mode reports breaches and keeps every guarantee (docs/watchdog.md, "Report mode").

With the watchdog in `report` mode a container past its limit is told (a Warning Event, a log
line, a metric) and left alone while its memory costs nobody. Once a neighbour's allocation
within its guarantee needs that memory, the reclaim takes it back: memory held past a limit is
an eviction victim for a guarantee like any burst (gpufrac.agent.arbiter.resolvers.EvictResolver). It
was not: a reclaim counted only memory within a limit, so with a limit equal to the request
the over-limit holder was nobody's victim and the neighbour's allocation was refused.

One 1 GiB GPU (992 MiB usable, 64 MiB units, allowance 16 MiB, grant margin 16 MiB); the real
agent, real shim, real workload processes in real cgroups (tests/fixtures/e2e.py).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from gpufrac.agent.kube.events import REASON_EVICTED, REASON_LIMIT_ENFORCED, REASON_OVER_LIMIT
from tests.fixtures.e2e import E2ENode, MiB
from tests.fixtures.hostile_tenant import agent_alive, agent_config, exec_in
from tests.fixtures.polling import until

pytestmark = pytest.mark.security

MakeNode = Callable[..., E2ENode]


def test_report_mode_reports_a_container_over_its_limit_and_a_guarantee_still_takes_its_memory(
    e2e_node: MakeNode,
) -> None:
    node = e2e_node(**agent_config(watchdog={"mode": "report"}))
    # What report mode gives up is said at start (docs/watchdog.md, "Report mode").
    said = until(
        lambda: "watchdog in report mode: a container past its limit" in node.sim.agent.log(),
        what="the start-up line of report mode",
    )
    assert said and "hidden GPU process" in node.sim.agent.log()
    a = node.run_pod("a", 2, None)  # request = limit = 128 MiB: no burst at all
    b = node.run_pod("b", 10, None, wait_timeout="20s")  # request 640 MiB
    hog = exec_in(a, shim=False, name="hog")
    assert hog.do(f"alloc {400 * MiB} 1") == "ok 1"  # past a's limit, without the shim
    # Reported, not killed: nobody needs the memory yet.
    (ev,) = until(lambda: node.events(a, REASON_OVER_LIMIT), what="the report on a")
    assert "report mode" in str(ev["message"]), ev
    assert hog.proc.poll() is None and a.alive()
    assert node.events(a, REASON_LIMIT_ENFORCED) == []
    # 992 - 400 = 592 MiB free: b's 600 MiB, within its request, need a's memory past its limit.
    assert b.alloc(600 * MiB) == "ok 1"
    assert b.app.do("check 1") == "ok"
    until(lambda: hog.proc.poll() is not None, what="a evicted")
    (ev,) = until(lambda: node.events(a, REASON_EVICTED), what="the eviction Event on a")
    assert "within its guarantee" in str(ev["message"]), ev
    assert node.events(b, REASON_EVICTED) == []
    assert agent_alive(node)
