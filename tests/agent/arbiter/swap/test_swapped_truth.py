"""A swapped-out container is counted by what the driver says it holds, not as holding nothing.

Swapped out, a container's checkpointed processes hold nothing on the GPU: its memory is in
host RAM. But the container controls its processes: it can keep the checkpointed one alive
(never calling CUDA, so never asking to be swapped in) and start a new one without the shim
that allocates up to its limit. Counted as holding 0 because it is swapped out, that memory
was nobody's burst: no eviction victim, no swap candidate, and a neighbour's allocation
inside its guarantee failed. The arbiter now counts a swapped-out container by NVML's
per-process memory over its live processes (arbiter/context.py Resolution._swapped_used),
so what it holds above its request is taken back for the neighbour's guarantee.

One 1 GiB GPU (992 MiB usable, 960 MiB allocatable, 64 MiB units, grant margin 16 MiB); the
real agent, real shim, real workload processes and the fake driver's checkpoint API
(tests/fixtures/e2e.py).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from gpufrac.agent.kube.events import REASON_EVICTED, REASON_SWAPPED_OUT
from tests.fixtures.e2e import TIMEOUT, E2ENode, MiB
from tests.fixtures.hostile_tenant import agent_alive, agent_config, exec_in
from tests.fixtures.polling import until
from tests.fixtures.swapping import idle_for, swapped

pytestmark = pytest.mark.security

MakeNode = Callable[..., E2ENode]


def test_a_swapped_out_container_allocating_from_a_new_process_gives_a_guarantee_back(
    e2e_node: MakeNode,
) -> None:
    # The watchdog only reports: t stays within its limit anyway; the reclaim alone must act.
    node = e2e_node(
        **agent_config(resolvers=["swap", "wait"], swap={"idleThreshold": "1s"}, watchdog={"mode": "report"})
    )
    t = node.run_pod("t", 2, "896Mi", swappable=True)  # request 128 MiB
    assert t.alloc(100 * MiB, 1).startswith("ok ")
    assert t.alloc(400 * MiB, 2).startswith("ok ")  # a burst
    r = node.run_pod("r", 4, "640Mi")  # request 256 MiB
    assert r.alloc(256 * MiB, 3).startswith("ok ")
    until(lambda: idle_for(t, 1.5), timeout=TIMEOUT, what="t idle")
    # r's burst fits only once t's burst has moved to host RAM.
    more = r.alloc(300 * MiB, 4).split()
    assert more[0] == "ok", more
    assert swapped(t) and t.alive()
    assert until(lambda: node.events(t, REASON_SWAPPED_OUT), what="the SwappedOut Event")
    assert r.app.do(f"free {more[1]}") == "ok"  # r's burst is given back

    # t's checkpointed process stays as it is; a new process of t, without the shim, takes
    # 600 MiB (above its 128 MiB request, within its limit) while t is swapped out.
    hog = exec_in(t, shim=False, name="hog")
    assert hog.do(f"alloc {600 * MiB} 1") == "ok 1"
    assert swapped(t)

    # n's request (512 MiB) is admitted against memory t's new process holds; n then allocates
    # inside its guarantee.
    n = node.run_pod("n", 8, None, wait_timeout="20s")
    assert n.alloc(480 * MiB, 5) == "ok 1"
    assert n.app.do("check 1") == "ok" and n.alive()
    until(lambda: hog.proc.poll() is not None, what="t's new process evicted")
    (ev,) = until(lambda: node.events(t, REASON_EVICTED), what="the Evicted Event on t")
    assert "within its guarantee" in ev["message"], ev
    assert node.events(n, REASON_EVICTED) == [] and node.events(r, REASON_EVICTED) == []
    assert r.alive() and r.app.do("check 1") == "ok"
    assert agent_alive(node)
