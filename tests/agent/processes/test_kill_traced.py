"""A tenant cannot keep a killed process's memory by tracing it.

A process killed while traced with PTRACE_O_TRACEEXIT stops at the start of its exit and keeps
its memory for as long as its tracer lets it (tests/fixtures/hold_at_exit.py). The tracer is
another process of the same container, which the watchdog does not judge (it holds no GPU
memory): were it left alive, the container would stay over its limit, and its neighbour's
allocation inside its guarantee would fail, for as long as it liked. The killer kills the
tenant's tracers of the processes it kills, and theirs in turn (gpufrac.agent.processes.kill): whether
the tracer attached from its main thread or another, and however long the chain of tracers.
A tracer outside every pod (the operator's debugger) is spared.

One 1 GiB GPU (992 MiB usable, 64 MiB units); the real agent, real shim, real workload
processes in real cgroups.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import pytest

from gpufrac.agent.kube.events import REASON_LIMIT_ENFORCED
from tests.fixtures.e2e import E2ENode, MiB
from tests.fixtures.hold_at_exit import held_at_exit
from tests.fixtures.hostile_tenant import agent_alive, agent_config, exec_in
from tests.fixtures.polling import until

pytestmark = pytest.mark.security

MakeNode = Callable[..., E2ENode]


@pytest.mark.parametrize("how", ["main thread", "other thread", "chain of 10"])
def test_a_process_the_watchdog_kills_is_not_kept_alive_by_a_tracer_in_its_container(
    e2e_node: MakeNode, how: str
) -> None:
    node = e2e_node(**agent_config())
    a = node.run_pod("a", 4, "256Mi")  # request = limit = 256 MiB
    b = node.run_pod("b", 10, None, wait_timeout="30s")  # request 640 MiB
    hog = exec_in(a, shim=False, name="hog")
    assert hog.do("sync") == "ok"  # its CUDA context is up before it is traced
    with contextlib.ExitStack() as stack:
        # Each tracer holds the one below it at its exit, the first the hog.
        held = hog.proc.pid
        tracers = []
        for _ in range(10 if how == "chain of 10" else 1):
            t = stack.enter_context(held_at_exit(held, inside=a.container.env, thread=how == "other thread"))
            tracers.append(t)
            held = t.pid
        # 500 MiB past no shim: over its limit, and into b's guarantee.
        assert hog.do(f"alloc {500 * MiB} 1") in ("ok 1", "<exited>")
        until(lambda: node.events(a, REASON_LIMIT_ENFORCED), what="the GpuMemoryLimitEnforced Event")
        # Held at its exit, the hog would keep its 500 MiB: its tracers go too.
        until(
            lambda: all(t.poll() is not None for t in tracers),
            what="the tracers in a's container to be killed",
        )
        until(lambda: hog.proc.poll() is not None, what="the hog to finish its exit")
        assert b.alloc(600 * MiB, 3) == "ok 1" and b.app.do("check 1") == "ok"
    assert a.alive()
    assert agent_alive(node)
