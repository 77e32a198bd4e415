"""Decisions that cost another container rest on the driver's count, not on the tenant's file.

A container can zero its usage counter, allocate from a process that does not load the shim,
or write any value into its usage file. Whenever the agent takes something from someone
else (an eviction, a reclaimed guarantee, a burst denied because the GPU is full), it counts
the larger of the file (clamped to what it granted) and NVML's per-process memory summed
over the container's processes (gpufrac.agent.gpu.truth; Resolution.used, Resolution.driver_used).
A file that disagrees with NVML is flagged (GpuUsageFileMismatch Event, metric).

One 1 GiB GPU (992 MiB usable, 960 MiB allocatable, 64 MiB units, grant margin 16 MiB);
the real agent, real shim, real workload processes (tests/fixtures/e2e.py).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from gpufrac.agent.gpu.processes import start_time
from gpufrac.agent.kube.events import REASON_EVICTED, REASON_LIMIT_ENFORCED, REASON_USAGE_MISMATCH
from tests.fixtures.e2e import E2ENode, MiB, PodRun
from tests.fixtures.hostile_tenant import agent_alive, agent_config, exec_in, write_total, zero_usage
from tests.fixtures.polling import until

pytestmark = pytest.mark.security

MakeNode = Callable[..., E2ENode]


def bursting_neighbour(node: E2ENode) -> PodRun:
    """Pod "b": request 128 MiB, preemptible, bursting to 400 MiB."""
    b = node.run_pod("b", 2, "896Mi", preemptible=True, wait_timeout="10s")
    assert b.alloc(100 * MiB, 1) == "ok 1"
    assert b.alloc(300 * MiB, 2) == "ok 2"  # a 272 MiB burst
    assert b.grant() > 0
    return b


@pytest.mark.parametrize("hide", ["zeroed counter", "shimless process"])
def test_hidden_usage_then_reclaim_does_not_get_a_neighbour_evicted(e2e_node: MakeNode, hide: str) -> None:
    node = e2e_node(**agent_config(resolvers=["evict", "wait"]))
    a = node.run_pod("a", 8, None, wait_timeout="5s")  # request 512 MiB = its limit
    if hide == "zeroed counter":
        assert a.alloc(300 * MiB) == "ok 1"  # within its guarantee, through the shim
    else:
        hidden = exec_in(a, shim=False, name="hidden")
        assert hidden.do(f"alloc {300 * MiB} 1") == "ok 1"  # the shim never counted it
    b = bursting_neighbour(node)
    # The GPU now has about 292 MiB free. a hides what it holds, and asks for 300 MiB more
    # "within its guarantee": the driver refuses, the shim sends RECLAIM. Believing the file,
    # the agent would find 236 MiB of a's guarantee missing and evict b's 272 MiB burst.
    if hide == "zeroed counter":
        zero_usage(a.host_dir)
    assert a.used() < MiB  # its file shows (almost) nothing
    assert a.alloc(300 * MiB, 2) == "oom"  # 300 + 300 MiB is past its 512 MiB guarantee
    # The neighbour was not evicted for it: alive, its memory intact, its grant kept.
    assert b.alive() and b.app.do("check 1") == "ok" and b.app.do("check 2") == "ok"
    assert b.grant() > 0
    assert node.events(b, REASON_EVICTED) == []
    assert agent_alive(node)
    # The lie is flagged on the liar's pod, once.
    (ev,) = until(lambda: node.events(a, REASON_USAGE_MISMATCH), what="the GpuUsageFileMismatch Event")
    assert ev["type"] == "Warning" and "under-reports" in ev["message"], ev
    assert node.events(b, REASON_USAGE_MISMATCH) == []


@pytest.mark.parametrize("value", [(1 << 64) - 1, 1 << 63, 1 << 40])
def test_a_huge_usage_counter_does_not_deny_a_neighbours_burst(e2e_node: MakeNode, value: int) -> None:
    node = e2e_node(**agent_config())
    a = node.run_pod("a", 2, "256Mi")
    assert a.alloc(32 * MiB) == "ok 1"
    write_total(a.host_dir, value)  # "my container holds everything"
    b = node.run_pod("b", 2, "512Mi", wait_timeout="3s")
    assert b.alloc(100 * MiB, 1) == "ok 1"
    assert b.alloc(300 * MiB, 2) == "ok 2"  # a burst of 272 MiB: the GPU has it
    assert b.grant() > 0 and b.app.do("check 2") == "ok"
    assert agent_alive(node)
    (ev,) = until(lambda: node.events(a, REASON_USAGE_MISMATCH), what="the GpuUsageFileMismatch Event")
    assert "over-reports" in ev["message"], ev


def test_zeroing_the_counter_past_the_limit_cannot_cost_a_neighbours_guarantee(e2e_node: MakeNode) -> None:
    """a zeroes its counter between allocations and so goes past its limit through the shim;
    b's allocation within its guarantee then needs that memory. The watchdog (enforce, the
    default) counts a from NVML and kills it within one interval; b's reclaim waits for it."""
    node = e2e_node(**agent_config())
    a = node.run_pod("a", 4, "256Mi")
    b = node.run_pod("b", 8, None, wait_timeout="30s")  # request 512 MiB
    pid = a.container.proc.pid
    for i in range(1, 4):
        got = a.alloc(200 * MiB, i)
        if got == "<exited>":
            break  # the watchdog already caught it
        assert got == f"ok {i}"
        zero_usage(a.host_dir)
    # b allocates within its guarantee: 480 MiB of its 512 MiB.
    assert b.alloc(480 * MiB, 7) == "ok 1"
    assert b.app.do("check 1") == "ok" and b.alive()
    until(lambda: not a.alive(), what="the watchdog to kill a")
    (ev,) = until(lambda: node.events(a, REASON_LIMIT_ENFORCED), what="the GpuMemoryLimitEnforced Event")
    assert f"killed process {pid}" in ev["message"], ev
    assert node.events(b, REASON_LIMIT_ENFORCED) == [] and node.events(b, REASON_EVICTED) == []
    assert agent_alive(node)


def test_start_time_orders_processes() -> None:
    import os

    assert start_time(os.getpid()) > 0 and start_time(1) <= start_time(os.getpid())
    assert start_time(1 << 30) == 0


def test_the_mismatch_flag_is_raised_once_per_lasting_episode() -> None:
    from gpufrac.agent.booking.ledger import ContainerAlloc
    from gpufrac.agent.gpu.truth import DISAGREE_AFTER, MismatchTracker
    from gpufrac.memguard.abi import ContainerConfig

    cfg = ContainerConfig(gpu_uuid="GPU-0", request_bytes=512 * MiB, limit_bytes=1024 * MiB, grant_bytes=0)
    alloc = ContainerAlloc("k", "r", (), ("GPU-0",), 512 * MiB, "/x/k", False, cfg)
    t = MismatchTracker(allowance=16 * MiB)
    # Under-reporting (hiding 300 MiB): flagged once it lasts, once.
    assert t.check(alloc, 0, 300 * MiB, now=0.0) is None
    msg = t.check(alloc, 0, 300 * MiB, now=DISAGREE_AFTER)
    assert msg is not None and "under-reports" in msg
    assert t.check(alloc, 0, 300 * MiB, now=DISAGREE_AFTER * 3) is None
    assert t.check(alloc, 300 * MiB, 300 * MiB, now=DISAGREE_AFTER * 4) is None  # agrees: episode over
    # Over-reporting within what was granted (a killed process's slot not reaped yet): not flagged.
    assert t.check(alloc, 400 * MiB, 0, now=100.0) is None
    assert t.check(alloc, 400 * MiB, 0, now=100.0 + DISAGREE_AFTER) is None
    # Past it: flagged.
    assert t.check(alloc, 1 << 40, 0, now=200.0) is None
    msg = t.check(alloc, 1 << 40, 0, now=200.0 + DISAGREE_AFTER)
    assert msg is not None and "over-reports" in msg
    assert t.flags == 2
