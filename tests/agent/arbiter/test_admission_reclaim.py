"""Reclaim at admission, end to end: a newly admitted container gets its whole request.

The device plugin admits against the GPU's unrequested memory, which the arbiter may have
lent out as bursts. Before the new container starts (PreStartContainer) the agent takes
that memory back from the borrowers, never from anyone's guarantee; if it cannot, the pod
still starts and a Warning Event says who holds the memory.

One 1 GiB GPU (960 MiB allocatable, 64 MiB units, grant margin 16 MiB), real agent, real
shim, real workload processes (tests/fixtures/e2e.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from gpufrac.agent.kube.events import REASON_EVICTED, REASON_GUARANTEE_AT_RISK, REASON_SWAPPED_OUT
from gpufrac.memguard import abi
from gpufrac.simgpu.workload import WorkloadProcess
from tests.fixtures.e2e import E2ENode, MiB, PodRun
from tests.fixtures.polling import until

MakeNode = Callable[..., E2ENode]


def borrower(node: E2ENode, preemptible: bool) -> PodRun:
    """Pod "a": request 128 MiB, bursts to 700 MiB, leaving under 300 MiB of the GPU free."""
    a = node.run_pod("a", 2, "896Mi", preemptible=preemptible, wait_timeout="0s")
    assert a.alloc(100 * MiB, 1) == "ok 1"
    assert a.alloc(600 * MiB, 2) == "ok 2"  # a burst of about 572 MiB, granted from free memory
    assert a.grant() > 500 * MiB
    return a


def test_preemptible_borrower_is_evicted_so_the_newcomer_gets_its_request(e2e_node: MakeNode) -> None:
    node = e2e_node(resolvers=["evict", "wait"])
    a = borrower(node, preemptible=True)
    # b: a 512 MiB request, admitted (832 MiB unrequested) though only about 290 MiB are free.
    b = node.run_pod("b", 8, None)
    # a's burst was taken back before b started: b's whole request is there.
    assert b.alloc(500 * MiB, 9) == "ok 1"
    assert b.app.do("check 1") == "ok"
    until(lambda: not a.alive(), what="a's process killed")
    assert a.container.proc.returncode == -9
    assert a.grant() == 0
    evicted = until(lambda: node.events(a, REASON_EVICTED), what="the Evicted event on a")
    assert evicted[0]["type"] == "Warning"
    assert not node.events(b, REASON_GUARANTEE_AT_RISK)


def test_memory_held_outside_gpufrac_gets_the_newcomer_warned(e2e_node: MakeNode) -> None:
    """Bursts always come back for a guarantee, non-preemptible ones too
    (tests/agent/arbiter/test_guarantees.py). What the agent cannot take back is memory held
    outside gpufrac: the newcomer still starts, with a Warning naming the cause."""
    node = e2e_node(resolvers=["evict", "wait"])
    # A CUDA program on the node, in no kubelet container and without the shim.
    outsider = WorkloadProcess.spawn(node.app_env(), "outsider", timeout=120)
    try:
        assert outsider.do(f"alloc {700 * MiB} 1") == "ok 1"
        # b: a 512 MiB request, admitted (960 MiB unrequested) though under 300 MiB are free.
        b = node.run_pod("b", 8, None)
        assert b.alive()
        warned = until(lambda: node.events(b, REASON_GUARANTEE_AT_RISK), what="the GuaranteeAtRisk event")
        assert warned[0]["type"] == "Warning"
        assert "memory used outside gpufrac" in warned[0]["message"], warned[0]
        # b gets what is really free, and its allocation past that fails cleanly (no crash).
        assert b.alloc(100 * MiB, 3) == "ok 1"
        assert b.alive()
        # The outsider was reported, never touched.
        assert outsider.do("check 1") == "ok"
    finally:
        outsider.close()


def idle_for(p: PodRun, seconds: float) -> bool:
    """The container's processes have launched no GPU work for `seconds` (its usage file)."""
    slots = [s for s in abi.read_usage(p.host_dir).slots if s.pid > 0]
    last = max((int(s.last_activity_ns) for s in slots), default=0)
    return (time.monotonic_ns() - last) / 1e9 >= seconds


def test_idle_swappable_borrower_is_swapped_out_and_keeps_running(e2e_node: MakeNode) -> None:
    node = e2e_node(resolvers=["swap", "evict", "wait"], swap={"idleThreshold": "1s"})
    # Not preemptible: only a swap can make room.
    a = node.run_pod("a", 2, "896Mi", preemptible=False, swappable=True, wait_timeout="0s")
    assert a.alloc(100 * MiB, 1) == "ok 1" and a.alloc(600 * MiB, 2) == "ok 2"
    until(lambda: idle_for(a, 2.0), what="a idle past the swap threshold")
    b = node.run_pod("b", 8, None)
    assert b.alloc(500 * MiB, 9) == "ok 1"
    assert b.app.do("check 1") == "ok"
    swapped = until(lambda: node.events(a, REASON_SWAPPED_OUT), what="the SwappedOut event on a")
    assert "GPU" in swapped[0]["message"]
    assert a.alive()  # swapped, not killed
    assert not node.events(a, REASON_EVICTED) and not node.events(b, REASON_GUARANTEE_AT_RISK)


def test_owner_reclaims_its_lent_guarantee_from_a_burst_when_it_allocates(e2e_node: MakeNode) -> None:
    # Lending on: a burst may borrow the unused part of b's guarantee after b started.
    node = e2e_node(resolvers=["evict", "wait"], lendUnusedRequests=True)
    b = node.run_pod("b", 8, None, priority=10)  # 512 MiB request
    assert b.alloc(32 * MiB, 1) == "ok 1"  # b uses little of it
    a = node.run_pod("a", 2, "896Mi", preemptible=True, wait_timeout="0s")
    assert a.alloc(100 * MiB, 1) == "ok 1"
    assert a.alloc(600 * MiB, 2) == "ok 2"  # this burst borrows most of b's unused guarantee
    assert a.grant() > 500 * MiB
    # b allocates up to its request: the driver has not the memory, so a's burst is taken back.
    assert b.alloc(448 * MiB, 2) == "ok 2"
    assert b.app.do("check 1") == "ok" and b.app.do("check 2") == "ok"
    until(lambda: not a.alive(), what="a's process killed")
    assert a.container.proc.returncode == -9
    evicted = until(lambda: node.events(a, REASON_EVICTED), what="the Evicted event on a")
    assert evicted[0]["type"] == "Warning"
