"""Compute shares held on a shared simulated GPU (docs/compute.md): the agent's compute loop, real
container processes in real cgroups under the real shim, the fake driver's time slices
(bench/_compute_node.py). What a container got is read from the compute model itself.

Margins are wide on purpose: the host is a loaded 2-core machine whose hiccups leave the GPU idle
now and then; how close the shares come is bench/compute.py's business (bench/results/compute.json).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from bench._compute_node import ComputeNode
from gpufrac.agent.compute import hold
from tests.fixtures.polling import until

pytestmark = pytest.mark.slow

SPIN = "spin 2000 8 {threads} {kind}"


@pytest.fixture
def nodes() -> Iterator[list[ComputeNode]]:
    made: list[ComputeNode] = []
    yield made
    for n in made:
        n.close()


def settle_and_measure(node: ComputeNode, settle: float = 2.0, window: float = 2.0) -> dict[str, float]:
    time.sleep(settle)
    return node.shares(window)


def test_a_container_of_many_processes_is_held_to_its_share_not_per_process(nodes: list[ComputeNode]) -> None:
    """50/50, the neighbour's three processes flat out: time slicing alone gives them three turns to
    one (75 %); its share holds the container, all its processes together, to half."""
    node = ComputeNode(mode="fair")
    nodes.append(node)
    one, many = node.add("one", 50), node.add("many", 50)
    one.do(SPIN.format(threads=1, kind="launch"))
    many.do("procs 3 2000 8")
    got = settle_and_measure(node)
    assert got["one"] >= 0.42 and got["many"] <= 0.58, got
    figures = node.figures(many)
    assert figures is not None and figures.pace_ns > 0 and figures.throttled_s > 0
    # the one-process container is under its share: never held back
    assert node.figures(one).pace_ns == 0


def test_every_launch_path_is_held_to_the_share(nodes: list[ComputeNode]) -> None:
    """Strict 30/70: six threads launching at once, through cuLaunchKernel, cuLaunchKernelEx and
    graphs (cuGraphLaunch) in turn, are held to 30 % together (one path left unpaced would take
    the GPU's time slices its neighbour leaves: each shim path is tested alone in
    test_memguard_compute.py)."""
    node = ComputeNode(mode="strict")
    nodes.append(node)
    small, big = node.add("small", 30), node.add("big", 70)
    small.do(SPIN.format(threads=6, kind="launch,ex,graph"))
    big.do(SPIN.format(threads=1, kind="launch"))
    got = settle_and_measure(node)
    assert 0.24 <= got["small"] <= 0.36, got
    assert got["big"] >= 0.6, got


def test_fair_gives_an_idle_share_to_the_busy_and_strict_caps_a_container_alone(
    nodes: list[ComputeNode],
) -> None:
    node = ComputeNode(mode="fair")
    nodes.append(node)
    a = node.add("a", 30)
    node.add("b", 70)  # never busy
    a.do(SPIN.format(threads=1, kind="launch"))
    got = settle_and_measure(node, window=1.5)
    assert got["a"] >= 0.85, got  # alone (b idle): the whole GPU, its 30 % notwithstanding
    assert node.figures(a).pace_ns == 0
    node.cfg.compute.mode = "strict"
    got = settle_and_measure(node, window=1.5)
    assert got["a"] <= 0.36, got  # strict: its share is a cap, even alone
    assert node.figures(a).pace_ns > 0


def test_a_container_that_skips_the_shim_is_held_from_outside(nodes: list[ComputeNode]) -> None:
    """Strict 20/80, the 20 % container's process without the shim: no pace can hold it, so the
    agent says so and stops its GPU processes for part of each period; it ends near its share, and
    its processes are continued when the agent stops."""
    node = ComputeNode(mode="strict")
    nodes.append(node)
    rogue, good = node.add("rogue", 20, shim=False), node.add("good", 80)
    rogue.do(SPIN.format(threads=1, kind="launch"))
    good.do(SPIN.format(threads=1, kind="launch"))
    until(
        lambda: (f := node.figures(rogue)) is not None and f.unheld, timeout=60, what="the rogue found unheld"
    )
    got = settle_and_measure(node)
    assert got["rogue"] <= 0.32 and got["good"] >= 0.6, got
    pid = rogue.container.proc.pid
    node.stop_control()
    assert _state(pid) != "T"  # not left stopped


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    return stat[stat.rindex(b")") + 2 :].split()[0].decode()


def test_a_starting_agent_continues_processes_an_earlier_one_left_stopped(nodes: list[ComputeNode]) -> None:
    """An agent that died while holding a container stopped leaves its processes stopped: the next
    one continues them as it starts (gpufrac.agent.compute.leftover), before its first period."""
    node = ComputeNode(mode="fair", control=False)
    nodes.append(node)
    m = node.add("held", 30)
    m.do(SPIN.format(threads=1, kind="launch"))
    pid = m.container.proc.pid
    until(lambda: node.busy([m])["held"] > 0, what="its GPU work")
    os.kill(pid, signal.SIGSTOP)  # what the dead agent's hold left
    until(lambda: _state(pid) == "T", what="the process stopped")
    node.start_control()
    until(lambda: _state(pid) != "T", timeout=60, what="the process continued by the new agent")


def test_a_hold_under_way_when_the_agent_stops_is_continued(
    nodes: list[ComputeNode], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent stopping while its compute period is stopping a container's processes (the
    SIGSTOPs run in a worker thread, which a cancelled period does not stop): what that stop
    stopped is continued too, not left stopped for good."""
    node = ComputeNode(mode="strict")
    nodes.append(node)
    rogue = node.add("rogue", 20, shim=False)
    rogue.do(SPIN.format(threads=1, kind="launch"))
    until(
        lambda: (f := node.figures(rogue)) is not None and f.unheld, timeout=60, what="the rogue found unheld"
    )
    stopped, go = threading.Event(), threading.Event()
    real_stop = hold.stop

    def stop_then_wait(*args: Any, **kwargs: Any) -> list[int]:
        fds = real_stop(*args, **kwargs)
        # An earlier period's continue (at most a period after its stop) may land after this
        # stop: stopped again once it has, so that this hold is what holds the process now.
        time.sleep(0.3)
        for fd in fds:
            signal.pidfd_send_signal(fd, signal.SIGSTOP)
        stopped.set()
        go.wait(10)  # the agent's stop begins meanwhile
        return fds

    monkeypatch.setattr(hold, "stop", stop_then_wait)
    assert stopped.wait(30), "no hold began"
    pid = rogue.container.proc.pid
    assert _state(pid) == "T"
    stopping = threading.Thread(target=node.stop_control)
    stopping.start()
    time.sleep(0.5)  # the period is cancelled while its stop is still under way
    go.set()
    stopping.join(30)
    assert not stopping.is_alive()
    assert _state(pid) != "T"  # not left stopped
