"""Collisions on one GPU and how the wait and evict resolvers settle them: real processes in
real cgroups on the real socket, pods and Events in the apiserver emulator."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

import pytest

from gpufrac.agent.arbiter.resolvers import REASON_EVICTED, REASON_PREEMPTED
from gpufrac.agent.processes import kill as kill_mod
from gpufrac.core.units import format_bytes
from tests.fixtures.arbiter_harness import ArbiterNode, Box, GiB
from tests.fixtures.kube import KubeServer

Make = Callable[..., ArbiterNode]


def fill(node: ArbiterNode, owner: Box, leave_gib: int = 0) -> int:
    """`owner` bursts into everything grantable on the GPU but `leave_gib`; returns its burst."""
    free = node.on_loop(lambda: node.arbiter.grantable(owner.alloc))
    burst = free - leave_gib * GiB
    assert burst > 0, "nothing to burst into"
    w = owner.workload
    assert w is not None
    assert w.do(f"alloc {owner.alloc.request_bytes}") == "fast"
    assert w.do(f"alloc {burst}") == "granted"
    return burst


def waiting(node: ArbiterNode, n: int) -> None:
    node.until(lambda: sum(len(v) for v in node.arbiter.queue.waiters.values()) == n, what=f"{n} waiter(s)")


def test_wait_is_granted_when_the_other_side_frees(make_node: Make) -> None:
    node = make_node(resolvers=["wait"])
    a = node.add("a", 30, "78Gi")
    b = node.add("b", 30, "60Gi", wait_timeout="120s")
    burst = fill(node, a)
    wb = b.workload
    assert wb is not None and wb.do(f"alloc {30 * GiB}") == "fast"
    wb.send(f"alloc {2 * GiB}")  # nothing is free: b waits
    waiting(node, 1)
    assert b.config().grant_bytes == 0
    # a frees 3 GiB and gives its grant back: b's waiting allocation goes through. Nothing
    # polls (the sweep only takes back grants unused for 10 s; b may wait 120 s): the
    # release itself wakes the waiter.
    assert a.workload is not None and a.workload.do(f"free {3 * GiB}") == "granted"
    assert wb.line() == "granted"
    assert b.config().grant_bytes == 2 * GiB
    assert a.config().grant_bytes == burst - 3 * GiB
    assert node.arbiter.stats.wait_timeouts == 0


def test_a_waiter_that_dies_leaves_the_queue_and_the_next_is_served(make_node: Make) -> None:
    # b (higher priority) waits first, then c; b is killed mid-wait. Its place must not block c,
    # and nothing may be granted to the dead request.
    node = make_node(resolvers=["wait"])
    a = node.add("a", 20, "78Gi")
    b = node.add("b", 20, "60Gi", wait_timeout="120s", priority=10)
    c = node.add("c", 20, "60Gi", wait_timeout="120s")
    fill(node, a)
    wb, wc = b.workload, c.workload
    assert wb is not None and wc is not None
    assert wb.do(f"alloc {20 * GiB}") == "fast" and wc.do(f"alloc {20 * GiB}") == "fast"
    wb.send(f"alloc {2 * GiB}")
    waiting(node, 1)
    wc.send(f"alloc {2 * GiB}")
    waiting(node, 2)
    dropped = node.arbiter.stats.dropped
    assert b.container is not None
    b.container.kill()  # kill -9: the kernel closes its end of the socket
    waiting(node, 1)
    assert node.arbiter.stats.dropped == dropped + 1
    assert a.workload is not None and a.workload.do(f"free {3 * GiB}") == "granted"
    assert wc.line() == "granted"
    assert c.config().grant_bytes == 2 * GiB
    assert b.config().grant_bytes == 0


def test_wait_times_out_into_a_denial(make_node: Make) -> None:
    node = make_node(resolvers=["wait"])
    a = node.add("a", 30, "78Gi")
    b = node.add("b", 30, "60Gi", wait_timeout="2s")
    fill(node, a)
    wb = b.workload
    assert wb is not None and wb.do(f"alloc {30 * GiB}") == "fast"
    assert wb.do(f"alloc {GiB}") == "denied"  # the shim then returns CUDA_ERROR_OUT_OF_MEMORY
    assert node.arbiter.stats.wait_timeouts == 1
    assert b.config().grant_bytes == 0
    assert not node.arbiter.queue.waiters


def test_waiters_are_served_by_priority_then_arrival(make_node: Make) -> None:
    node = make_node(resolvers=["wait"])
    a = node.add("a", 20, "78Gi")
    low1 = node.add("low1", 10, "30Gi", priority=0, wait_timeout="120s")
    low2 = node.add("low2", 10, "30Gi", priority=0, wait_timeout="120s")
    high = node.add("high", 10, "30Gi", priority=100, wait_timeout="120s")
    fill(node, a)
    order = [low1, low2, high]
    for box in order:
        assert box.workload is not None and box.workload.do(f"alloc {10 * GiB}") == "fast"
    for i, box in enumerate(order):
        assert box.workload is not None
        box.workload.send(f"alloc {2 * GiB}")
        waiting(node, i + 1)
    aw = a.workload
    assert aw is not None
    # Room for one at a time: high first although it came last, then low1 before low2.
    served: list[Box] = []
    for n in range(1, len(order) + 1):
        assert aw.do(f"free {2 * GiB}") == "granted"
        node.until(lambda n=n: sum(b.config().grant_bytes > 0 for b in order) == n, what=f"{n} grants")
        served += [b for b in order if b.config().grant_bytes > 0 and b not in served]
    assert [b.pod for b in served] == ["high", "low1", "low2"]
    for box in order:
        assert box.workload is not None and box.workload.line() == "granted"


def test_evict_kills_the_lower_priority_borrower(make_node: Make, kube_server: KubeServer) -> None:
    node = make_node(resolvers=["evict", "wait"])
    low = node.add("low", 30, "78Gi", priority=0)
    high = node.add("high", 30, "60Gi", priority=1000, wait_timeout="30s")
    burst = fill(node, low)
    assert low.container is not None
    wh = high.workload
    assert wh is not None and wh.do(f"alloc {30 * GiB}") == "fast"
    assert wh.do(f"alloc {4 * GiB}") == "granted"
    assert high.config().grant_bytes == 4 * GiB
    # low's processes were killed by host pid; its guarantee stays booked, its burst is gone.
    assert low.container.proc.wait(30) == -9
    assert low.config().grant_bytes == 0 and low.used() == 0
    assert low.config().request_bytes == 30 * GiB
    node.on_loop(lambda: node.identity.events.flush(30))  # type: ignore[union-attr]
    evicted = [e for e in kube_server.events() if e["reason"] == REASON_EVICTED]
    preempted = [e for e in kube_server.events() if e["reason"] == REASON_PREEMPTED]
    assert [e["involvedObject"]["name"] for e in evicted] == ["low"]
    assert [e["involvedObject"]["name"] for e in preempted] == ["high"]
    # Who needed how much, on both pods.
    assert f"pod default/high container main needed {format_bytes(4 * GiB)}" in evicted[0]["message"]
    assert f"{format_bytes(burst)} of burst GPU memory" in preempted[0]["message"]
    assert "pod default/low" in preempted[0]["message"]


def test_evict_spares_non_preemptible_higher_priority_and_guaranteed(make_node: Make) -> None:
    node = make_node(resolvers=["evict", "wait"])
    keep = node.add("keep", 25, "78Gi", priority=0, preemptible=False)  # burst, but not preemptible
    boss = node.add("boss", 25, "60Gi", priority=5000)  # burst, higher priority than the asker
    calm = node.add("calm", 20, "30Gi", priority=0)  # lower priority, but only its guarantee
    asker = node.add("asker", 5, "20Gi", priority=1000, wait_timeout="2s")
    for box in (keep, boss, calm, asker):
        assert box.workload is not None and box.workload.do(f"alloc {box.alloc.request_bytes}") == "fast"
    free = node.on_loop(lambda: node.arbiter.grantable(keep.alloc))
    assert keep.workload is not None and keep.workload.do(f"alloc {free // 2}") == "granted"
    assert boss.workload is not None and boss.workload.do(f"alloc {free - free // 2}") == "granted"
    assert asker.workload is not None and asker.workload.do(f"alloc {GiB}") == "denied"
    for box in (keep, boss, calm):
        assert box.container is not None and box.container.alive(), box.pod
    assert keep.config().grant_bytes == free // 2 and boss.config().grant_bytes == free - free // 2


def guarantees(*boxes: Box) -> None:
    for box in boxes:
        assert box.workload is not None and box.workload.do(f"alloc {box.alloc.request_bytes}") == "fast"


@pytest.mark.parametrize("waiter_priority", [0, 100], ids=["equal-priority-fifo", "higher-priority"])
def test_a_burst_that_fits_does_not_overtake_a_waiter_that_ranks_ahead(
    make_node: Make, waiter_priority: int
) -> None:
    # a waits for 8 GiB with 4 GiB free; b (same priority, later; or lower priority) asks for 2 GiB
    # that are free. Within the head-of-line bound (headOfLineBound, 1 s by default) b queues
    # behind a rather than being granted at once: a stream of small bursts must not starve a.
    # b gives up before its bound (wait timeout 0.5 s). Evict sees nothing to do for b (its
    # burst fits) and kills nobody.
    node = make_node(resolvers=["evict", "wait"])
    a = node.add("a", 2, "20Gi", priority=waiter_priority, wait_timeout="120s")
    b = node.add("b", 2, "20Gi", priority=0, wait_timeout="500ms")
    filler = node.add("filler", 30, "78Gi", priority=1000, preemptible=False)
    guarantees(a, b)
    fill(node, filler, leave_gib=4)
    wa, wb = a.workload, b.workload
    assert wa is not None and wb is not None
    wa.send(f"alloc {8 * GiB}")
    waiting(node, 1)
    assert wb.do(f"alloc {2 * GiB}") == "denied"  # it waited its 0.5 s behind a
    assert b.config().grant_bytes == 0
    assert filler.workload is not None and filler.workload.do(f"free {5 * GiB}") == "granted"
    assert wa.line() == "granted"
    assert a.config().grant_bytes == 8 * GiB


def test_memory_won_by_an_eviction_goes_to_its_requester_not_to_a_lower_waiter(make_node: Make) -> None:
    # low (priority 0) waits for 6 GiB; high (priority 100) needs 8 GiB and evicts victim
    # (priority 50). What victim's death frees is high's first: victim must not die so that a
    # lower-priority pod than itself gets its memory while high waits on.
    node = make_node(resolvers=["evict", "wait"])
    low = node.add("low", 2, "20Gi", priority=0, wait_timeout="120s")
    high = node.add("high", 2, "20Gi", priority=100, wait_timeout="3s")
    victim = node.add("victim", 2, "30Gi", priority=50)
    guarantees(low, high)
    free = node.on_loop(lambda: node.arbiter.grantable(victim.alloc))
    node.add("big", free // GiB - 10, priority=1000, preemptible=False, start=False)  # 10.x GiB left
    burst = fill(node, victim, leave_gib=2)
    assert 8 * GiB <= burst < 9 * GiB
    wl, wh = low.workload, high.workload
    assert wl is not None and wh is not None and victim.container is not None
    wl.send(f"alloc {6 * GiB}")  # 2 GiB free; nobody below low to evict: it waits
    waiting(node, 1)
    assert wh.do(f"alloc {8 * GiB}") == "granted"
    assert victim.container.proc.wait(30) == -9
    assert high.config().grant_bytes == 8 * GiB
    assert low.config().grant_bytes == 0  # 6 GiB do not fit in what is left
    waiting(node, 1)
    assert wh.do(f"free {8 * GiB}") == "granted"
    assert wl.line() == "granted"
    assert low.config().grant_bytes == 6 * GiB


def test_an_eviction_cut_short_by_the_deadline_still_completes(
    make_node: Make, kube_server: KubeServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    node = make_node(resolvers=["evict", "wait"])
    low = node.add("low", 30, "78Gi", priority=0)
    high = node.add("high", 30, "60Gi", priority=1000, wait_timeout="2s")
    fill(node, low)
    gate = threading.Event()
    real = kill_mod.kill_and_wait

    def slow_kill(*args: Any, **kw: Any) -> int:
        try:
            return int(real(*args, **kw))
        finally:
            gate.wait(60)  # killed, but the kill "returns" only once the requester gave up

    monkeypatch.setattr(kill_mod, "kill_and_wait", slow_kill)
    wh = high.workload
    assert wh is not None and low.container is not None
    assert wh.do(f"alloc {30 * GiB}") == "fast"
    try:
        assert wh.do(f"alloc {4 * GiB}") == "denied"  # its 2 s passed during the kill
        assert low.container.proc.wait(30) == -9
    finally:
        gate.set()
    # The eviction runs to its end all the same: slots reaped, burst revoked, Events posted.
    node.until(lambda: low.config().grant_bytes == 0 and low.used() == 0, timeout=15, what="low revoked")
    node.on_loop(lambda: node.identity.events.flush(30))  # type: ignore[union-attr]
    evicted = [e["involvedObject"]["name"] for e in kube_server.events() if e["reason"] == REASON_EVICTED]
    assert evicted == ["low"]
    assert high.config().grant_bytes == 0


def test_eviction_kills_only_processes_still_in_the_victims_container(
    make_node: Make, monkeypatch: pytest.MonkeyPatch
) -> None:
    node = make_node(resolvers=["evict", "wait"])
    low = node.add("low", 30, "78Gi", priority=0)
    high = node.add("high", 30, "60Gi", priority=1000, wait_timeout="30s")
    fill(node, low)
    # A pid of low's listed by the /proc scan, then reused by an unrelated process before the
    # signal: here the scan's list names a process in no container at all (this test's child).
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    real = node.arbiter.peers.pids_of
    listed: list[int] = []

    def pids_of(alloc: Any) -> list[int]:
        pids = real(alloc)
        if alloc.key == low.alloc.key and not listed:  # the scan before the kill
            listed.append(stranger.pid)
            pids.append(stranger.pid)
        return pids

    monkeypatch.setattr(node.arbiter.peers, "pids_of", pids_of)
    try:
        wh = high.workload
        assert wh is not None and low.container is not None
        assert wh.do(f"alloc {30 * GiB}") == "fast"
        assert wh.do(f"alloc {4 * GiB}") == "granted"
        assert low.container.proc.wait(30) == -9
        assert listed and stranger.poll() is None  # not in low's container: never signalled
    finally:
        stranger.kill()
        stranger.wait()
