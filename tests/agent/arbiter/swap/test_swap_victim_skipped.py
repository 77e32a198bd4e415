"""A container that cannot be swapped cannot make swap give up, so that a neighbour is
killed instead.

T (swappable, `preemptible: "false"`, idle, holding a burst) is the swap resolver's first
pick. It makes itself impossible to swap: a CUDA process of its own without the shim (which
could never ask to come back), or a broken usage file (which also makes it look idle since
ever). A requester's burst then needs room: swap must move the next idle swappable
container, V, to host RAM instead of giving up and leaving the evict step to kill V.

One 1 GiB GPU (992 MiB usable, 960 MiB allocatable, 64 MiB units, grant margin 16 MiB);
the real agent, real shim, real workload processes (tests/fixtures/e2e.py).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from gpufrac.agent.kube.events import REASON_EVICTED, REASON_SWAPPED_OUT
from tests.fixtures.e2e import TIMEOUT, E2ENode, MiB
from tests.fixtures.hostile_tenant import agent_alive, agent_config, break_magic, exec_in
from tests.fixtures.polling import until
from tests.fixtures.swapping import idle_for, swapped

pytestmark = pytest.mark.security


@pytest.mark.parametrize("how", ["shimless-process", "broken-usage-file"])
def test_a_container_that_cannot_be_swapped_does_not_get_its_neighbour_evicted(
    e2e_node: Callable[..., E2ENode], how: str
) -> None:
    node = e2e_node(**agent_config(resolvers=["swap", "evict", "wait"], swap={"idleThreshold": "1s"}))
    # T ranks lowest: the swap resolver picks it first.
    tenant = node.run_pod("tenant", 2, "448Mi", priority=0, preemptible=False, swappable=True)
    victim = node.run_pod("victim", 2, "448Mi", priority=10, swappable=True)  # preemptible
    if how == "shimless-process":
        hog = exec_in(tenant, shim=False, name="hog")
        assert hog.do(f"alloc {300 * MiB} 1") == "ok 1"  # a burst nobody granted: NVML counts it
    else:
        assert tenant.alloc(128 * MiB, 1).startswith("ok")
        assert tenant.alloc(172 * MiB, 2).startswith("ok")  # a granted burst
    guarantee = victim.alloc(128 * MiB, 1111).split()
    burst = victim.alloc(192 * MiB, 2222).split()
    assert guarantee[0] == "ok" and burst[0] == "ok"
    requester = node.run_pod("requester", 4, "640Mi", priority=100, wait_timeout="10s")
    mine = requester.alloc(256 * MiB, 3333).split()
    assert mine[0] == "ok"
    until(lambda: idle_for(tenant, 1.5) and idle_for(victim, 1.5), timeout=TIMEOUT, what="T and V idle")
    if how == "broken-usage-file":
        break_magic(tenant.host_dir)

    # About 84 MiB may be granted: the requester's 200 MiB burst needs T's or V's burst moved
    # (either alone would do). T cannot be moved; V can, and is, rather than evicted.
    more = requester.alloc(200 * MiB, 4444).split()
    log = node.sim.agent.log
    assert more[0] == "ok", f"requester burst: {more}; agent log:\n{log()[-3000:]}"
    assert victim.alive() and swapped(victim), log()[-3000:]
    until(lambda: node.events(victim, REASON_SWAPPED_OUT), what="V's SwappedOut Event")
    assert node.events(victim, REASON_EVICTED) == []
    assert "Traceback" not in log(), log()[-3000:]

    # V comes back on its next GPU work once the requester's burst is gone, bytes intact.
    assert requester.app.do(f"free {more[1]}") == "ok"
    assert victim.app.do(f"check {guarantee[1]}", TIMEOUT) == "ok", log()[-3000:]
    assert victim.app.do(f"check {burst[1]}") == "ok"
    assert not swapped(victim)
    assert tenant.alive() and agent_alive(node)
