"""The watchdog judges a container, not its processes: one context allowance per pod and GPU.

NVML counts each CUDA context, which the shim does not, so the watchdog allows some memory
above the limit. Were that allowance granted per process, a container could buy headroom by
starting idle CUDA processes. It is one per pod and GPU (gpufrac.agent.watchdog.service.plan; a pod's
containers share it, tests/agent/watchdog/test_watchdog_plan.py), and in
enforce mode (the default) the container's newest processes are killed until the rest fits,
in the scan that finds it.

One 1 GiB GPU (992 MiB usable, 64 MiB units); the real agent, real shim, real workload
processes (tests/fixtures/e2e.py).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from gpufrac.agent.kube.events import REASON_LIMIT_ENFORCED
from gpufrac.core.units import format_bytes
from tests.fixtures.e2e import E2ENode, MiB
from tests.fixtures.hostile_tenant import agent_alive, agent_config, exec_in
from tests.fixtures.polling import until

pytestmark = pytest.mark.security

MakeNode = Callable[..., E2ENode]
TOLERANCE = 64 * MiB


def test_idle_cuda_processes_buy_no_headroom(e2e_node: MakeNode) -> None:
    # Default mode (enforce); the allowance 64 MiB. Per process, 5 processes would have had 320 MiB.
    node = e2e_node(**agent_config(watchdog={"tolerance": format_bytes(TOLERANCE)}))
    a = node.run_pod("a", 4, "256Mi")  # request = limit = 256 MiB
    b = node.run_pod("b", 10, None, wait_timeout="30s")  # request 640 MiB
    idle = [exec_in(a, shim=False, name=f"idle{i}") for i in range(3)]  # CUDA contexts, no memory
    hog = exec_in(a, shim=False, name="hog")
    # 500 MiB past no shim: over 256 MiB + 64 MiB, within 256 MiB + 5 x 64 MiB.
    assert hog.do(f"alloc {500 * MiB} 1") in ("ok 1", "<exited>")
    until(lambda: hog.proc.poll() is not None, what="the watchdog to kill the hog")
    (ev,) = until(lambda: node.events(a, REASON_LIMIT_ENFORCED), what="the GpuMemoryLimitEnforced Event")
    assert f"killed process {hog.proc.pid}" in ev["message"], ev
    # Only the newest process went: the rest of the container fits and keeps running.
    assert all(p.proc.poll() is None for p in idle) and a.alive()
    assert a.alloc(100 * MiB) == "ok 1"
    # The neighbour's guarantee is all there.
    assert b.alloc(600 * MiB, 3) == "ok 1" and b.app.do("check 1") == "ok"
    assert node.events(b, REASON_LIMIT_ENFORCED) == []
    assert agent_alive(node)
