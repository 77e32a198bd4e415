"""A tenant cannot keep a killed process's memory by tracing it.

A process killed while traced with PTRACE_O_TRACEEXIT stops at the start of its exit and keeps
its memory for as long as its tracer lets it (tests/fixtures/hold_at_exit.py). The tracer is
another process of the same container, which the watchdog does not judge (it holds no GPU
memory): were it left alive, the container would stay over its limit, and its neighbour's
allocation inside its guarantee would fail, for as long as it liked. The killer kills the
tracers in pods of the processes it kills (gpufrac.agent.kill).

One 1 GiB GPU (992 MiB usable, 64 MiB units); the real agent, real shim, real workload
processes in real cgroups.
"""

from __future__ import annotations

from collections.abc import Callable

from gpufrac.agent.events import REASON_LIMIT_ENFORCED
from tests.fixtures.e2e import E2ENode, MiB
from tests.fixtures.hold_at_exit import held_at_exit
from tests.fixtures.hostile_tenant import agent_alive, agent_config, exec_in
from tests.fixtures.polling import until

MakeNode = Callable[..., E2ENode]


def test_a_process_the_watchdog_kills_is_not_kept_alive_by_a_tracer_in_its_container(
    e2e_node: MakeNode,
) -> None:
    node = e2e_node(**agent_config())
    a = node.run_pod("a", 4, "256Mi")  # request = limit = 256 MiB
    b = node.run_pod("b", 10, None, wait_timeout="30s")  # request 640 MiB
    hog = exec_in(a, shim=False, name="hog")
    assert hog.do("sync") == "ok"  # its CUDA context is up before it is traced
    with held_at_exit(hog.proc.pid, inside=a.container.env) as tracer:
        # 500 MiB past no shim: over its limit, and into b's guarantee.
        assert hog.do(f"alloc {500 * MiB} 1") in ("ok 1", "<exited>")
        until(lambda: node.events(a, REASON_LIMIT_ENFORCED), what="the GpuMemoryLimitEnforced Event")
        # Held at its exit by the tracer, the hog would keep its 500 MiB: the tracer goes too.
        until(lambda: tracer.poll() is not None, what="the tracer in a's container to be killed")
        until(lambda: hog.proc.poll() is not None, what="the hog to finish its exit")
        assert b.alloc(600 * MiB, 3) == "ok 1" and b.app.do("check 1") == "ok"
    assert a.alive()
    assert agent_alive(node)
