"""A victim whose GPU process is slow to exit is still announced, and the next victim still goes.

An eviction signals every process of its victim, then waits (gpufrac.agent.processes.kill.KILL_WAIT) for
the ones the driver counts for it. One that has not exited by then (or that the agent, out of
files, cannot tell about) leaves the victim's memory not free yet: KillFailed. Its processes
were killed all the same, so the eviction is announced as any other (Evicted Event,
DisruptionTarget condition, its burst revoked) and the next victim chosen is evicted; the
requester gets its memory from those, or waits for the slow one (gpufrac.agent.arbiter.resolvers
.EvictResolver). Before, the first such victim ended the eviction unannounced, and the
others were never tried: the neighbour whose guarantee they held was refused.

The slow exit is the kernel's own: a tracer (tests/fixtures/hold_at_exit.py, a process outside
the containers) holds the victim's GPU process at its exit, where SIGKILL leaves it alive and
holding its memory. One 1 GiB GPU (992 MiB usable, 960 MiB allocatable, 64 MiB units, grant
margin 16 MiB); the real agent, real shim, real workload processes in real cgroups.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from gpufrac.agent.kube.events import REASON_EVICTED
from gpufrac.agent.kube.recorder import DISRUPTION_TARGET
from tests.fixtures.e2e import E2ENode, MiB, PodRun
from tests.fixtures.hold_at_exit import held_at_exit
from tests.fixtures.hostile_tenant import agent_alive, agent_config, exec_in
from tests.fixtures.polling import until

pytestmark = pytest.mark.security

MakeNode = Callable[..., E2ENode]


def state(pid: int) -> str:
    """The process's state letter in /proc ("" once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return ""


def disruption(node: E2ENode, pod: PodRun) -> dict[str, str] | None:
    status = node.v1.read_namespaced_pod_status(pod.name, "default").status
    found = [c for c in status.conditions or [] if c.type == DISRUPTION_TARGET]
    return found[0].to_dict() if found else None


def test_a_victim_slow_to_exit_is_announced_and_the_next_victim_is_evicted(e2e_node: MakeNode) -> None:
    # The watchdog only reports here: the eviction alone must take the memory back.
    node = e2e_node(**agent_config(resolvers=["evict", "wait"], watchdog={"mode": "report"}))
    a = node.run_pod("a", 2, "896Mi", priority=0)  # request 128 MiB; the first victim
    c = node.run_pod("c", 2, "896Mi", priority=50)  # the second
    slow = exec_in(a, shim=False, name="slow")
    other = exec_in(c, shim=False, name="other")
    # No grant asked, none given: 300 MiB each, a burst of 172 MiB above its request.
    assert slow.do(f"alloc {300 * MiB} 1") == "ok 1"
    assert other.do(f"alloc {300 * MiB} 1") == "ok 1"
    with held_at_exit(slow.proc.pid):
        # b's request (640 MiB) is taken back for it as it is admitted: 264 MiB are missing,
        # more than either burst. a goes first (the lower priority) and does not exit.
        b = node.run_pod("b", 10, None, priority=100, wait_timeout="40s")
        assert b.alloc(600 * MiB) == "ok 1"  # c's memory and what was free
        assert b.app.do("check 1") == "ok"
        assert state(slow.proc.pid) == "t"  # a's GPU process: killed, held at its exit
        until(lambda: other.proc.poll() is not None, what="c's GPU process to be killed")
        evicted = until(lambda: node.events(a, REASON_EVICTED), what="the eviction Event on a")
        assert any("not free yet" in e["message"] for e in evicted), evicted
        cond = until(lambda: disruption(node, a), what="a's DisruptionTarget condition")
        assert cond["status"] == "True", cond
        until(lambda: node.events(c, REASON_EVICTED), what="the eviction Event on c")
        assert a.config().grant_bytes == 0
    until(lambda: state(slow.proc.pid) == "", what="a's GPU process to exit once let go")
    assert node.events(b, REASON_EVICTED) == []
    assert agent_alive(node)
