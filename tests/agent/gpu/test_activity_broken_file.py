"""Breaking its usage file from the start does not exempt a container from idle reaping.

The activity tracker reads each container's usage file (gpufrac.agent.gpu.activity). A container
whose entrypoint overwrites the file's magic before the tracker's first read, and then holds
GPU memory from a process without the shim, must still be judged idle on the driver's word:
warned after its idle-timeout and acted on after the grace period, like any idle pod. A busy
one in the same state is not: the driver's samples of the processes the kernel places in the
container are its activity.

One 1 GiB GPU; the real agent, real workload processes in real cgroups (tests/fixtures/e2e.py).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.fixtures.e2e import E2ENode, MiB
from tests.fixtures.hostile_tenant import IDLE_FAST, agent_alive, agent_config, break_magic
from tests.fixtures.polling import until

pytestmark = pytest.mark.security

MakeNode = Callable[..., E2ENode]
# IDLE_FAST polling once a second: the file is broken well before the tracker's first read.
IDLE = {**IDLE_FAST, "interval": "1s"}


def test_a_container_whose_usage_file_is_broken_from_the_start_is_reaped_when_idle(
    e2e_node: MakeNode,
) -> None:
    node = e2e_node(**agent_config(idle=IDLE))
    # A neighbour in the same state, busy on the GPU (a 600 s kernel, seen only by the driver).
    busy = node.run_pod("busy", 2, shim=False, before_start=break_magic)
    assert busy.alloc(64 * MiB) == "ok 1"
    busy.send("busy 600000000")
    idle = node.run_pod("idle", 2, shim=False, before_start=break_magic)
    assert idle.alloc(64 * MiB) == "ok 1"  # it holds GPU memory and does no GPU work
    until(lambda: node.events(idle, "IdleWarning"), what="the IdleWarning Event")
    (ev,) = until(lambda: node.events(idle, "IdleNotify"), what="the IdleNotify Event")
    assert "idle" in ev["message"], ev
    # The busy one was there first, with the same idle-timeout: judged idle, it would have been
    # warned by now.
    assert node.events(busy, "IdleWarning") == []
    assert busy.alive() and agent_alive(node)
    assert "its activity is the driver's samples alone" in node.sim.agent.log()
