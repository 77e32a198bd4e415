"""Idleness is what the driver sees, not what a tenant writes into its usage file.

The shim stamps each process slot's `last_activity_ns` and bumps its `launches` on every
kernel launch, but the container can write those bytes too. Stamping its own slots (a fresh
stamp on every poll, or one far in the future) must not keep an idle container from being
reaped, and a busy neighbour whose only sign of work is the driver's (one long kernel: its
stamp ages) must not look idle to the arbiter when it picks victims. The agent takes both
from its activity tracker (gpufrac.agent.gpu.activity: NVML's per-process samples, the file's

pytestmark = pytest.mark.security
launches only when the driver sampled the container in the same window).

One 1 GiB GPU (992 MiB usable, 960 MiB allocatable, 64 MiB units); the real agent, real shim,
real workload processes (tests/fixtures/e2e.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpufrac.agent.kube.events import REASON_EVICTED
from tests.fixtures.e2e import E2ENode, MiB
from tests.fixtures.hostile_tenant import IDLE_FAST, Repeating, agent_alive, agent_config, stamp_slots
from tests.fixtures.polling import until

MakeNode = Callable[..., E2ENode]


@pytest.fixture
def stamper() -> Iterator[Callable[[Path, str], None]]:
    """stamper(host_dir, how): stamp the slots every 50 ms until the test ends."""
    loop = Repeating()
    yield lambda host_dir, how: loop.start(lambda: stamp_slots(host_dir, future=how == "future stamp"))
    loop.close()


@pytest.mark.parametrize("how", ["future stamp", "fresh stamps"])
def test_stamping_its_own_usage_file_does_not_keep_an_idle_container_from_being_reaped(
    e2e_node: MakeNode, stamper: Callable[[Path, str], None], how: str
) -> None:
    node = e2e_node(**agent_config(idle=IDLE_FAST))
    a = node.run_pod("a", 2, "256Mi")
    assert a.alloc(64 * MiB) == "ok 1"  # it holds GPU memory and does no GPU work
    stamper(a.host_dir, how)
    # The reaper warns and acts on it as on any idle pod, on the driver's word.
    until(lambda: node.events(a, "IdleWarning"), what="the IdleWarning Event")
    (ev,) = until(lambda: node.events(a, "IdleNotify"), what="the IdleNotify Event")
    assert "idle" in ev["message"], ev
    assert agent_alive(node)


def test_a_busy_neighbour_whose_stamp_ages_is_not_evicted_as_idle(e2e_node: MakeNode) -> None:
    # Evict idle bursts of the same priority after 2 s; the tracker polls every 200 ms.
    node = e2e_node(
        **agent_config(resolvers=["evict", "wait"], evictIdleThreshold="2s", idle={"interval": "200ms"})
    )
    b = node.run_pod("b", 2, "896Mi", wait_timeout="10s")
    assert b.alloc(100 * MiB, 1) == "ok 1"
    assert b.alloc(300 * MiB, 2) == "ok 2"  # a 272 MiB burst
    assert b.grant() > 0
    b.send("busy 15000000")  # one launch, then a 15 s kernel: only NVML shows it working
    a = node.run_pod("a", 2, "896Mi", wait_timeout="3s")
    assert a.alloc(100 * MiB, 1) == "ok 1"
    time.sleep(3)  # b's launch stamp is now older than the threshold
    # a's 500 MiB burst does not fit beside b's: b is the only victim there could be, and it
    # is busy, so it keeps its memory and a is refused after its wait.
    assert a.alloc(500 * MiB, 2) == "oom"
    assert b.alive() and node.events(b, REASON_EVICTED) == []
    assert b.app.line(60) == "ok"  # the kernel ran to its end
    assert b.app.do("check 2") == "ok" and b.grant() > 0
    assert agent_alive(node)
