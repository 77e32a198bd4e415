"""kill -9 of the agent while a container is swapped out: the new agent brings it back.

Every part real (tests/fixtures/e2e.py): the agent a subprocess, the container's process
cuda-python under the memguard shim in its own cgroup, the fake driver's checkpoint API
across processes. The swapped container's processes stay locked in the driver across the
agent's death; a new agent must never clear their swapped flags while the driver says so
(the shim would then call into a locked driver with nobody to ask for a swap-in), even
before it has heard of the pod from the apiserver. It finds them by cgroup, takes them
over, and restores them on their next GPU call, bytes intact.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import yaml

from gpufrac.memguard import abi
from gpufrac.simgpu.nodestate import NodeState
from tests.fixtures.e2e import TIMEOUT, E2ENode, MiB
from tests.fixtures.polling import until
from tests.fixtures.swapping import idle_for, swapped, swapped_out

pytestmark = pytest.mark.security


def restart_with(node: E2ENode, **config: Any) -> None:
    """The agent killed (-9) and started again with `config` over its node config."""
    agent = node.sim.agent
    agent.kill()
    cfg = yaml.safe_load(agent.config_path.read_text())
    cfg.update(config)
    agent.config_path.write_text(yaml.safe_dump(cfg))
    node.sim.restart_agent()


def test_a_container_swapped_out_comes_back_after_a_restart_without_swap_in_the_resolvers(
    e2e_node: Callable[..., E2ENode],
) -> None:
    """The new agent's resolvers leave swap out: what the previous one swapped out is still
    taken over and brought back (not its flags cleared over processes the driver holds)."""
    node = e2e_node(resolvers=["swap", "wait"], swap={"idleThreshold": "1s"})
    victim, guarantee, burst = swapped_out(node)
    restart_with(node, resolvers=["evict", "wait"])
    log = node.sim.agent.log
    assert victim.app.do(f"check {guarantee[1]}", TIMEOUT) == "ok", log()[-3000:]
    assert victim.app.do(f"check {burst[1]}", TIMEOUT) == "ok"
    assert not any(s.swapped for s in abi.read_usage(victim.host_dir).slots)
    assert "taken over" in log() and victim.alive()


def test_a_swapped_container_waits_while_the_checkpoint_api_cannot_be_used_and_then_comes_back(
    e2e_node: Callable[..., E2ENode],
) -> None:
    """The new agent cannot use the checkpoint API (detection fails): nobody can tell whether
    the victim's processes are locked, so its flags stay set and its swap-ins are denied (its
    shim asks again, backing off) rather than let it call into a locked driver for ever. Once
    the API works again, it comes back with its bytes."""
    node = e2e_node(resolvers=["swap", "wait"], swap={"idleThreshold": "1s"})
    victim, guarantee, burst = swapped_out(node)
    with NodeState(node.sim.node_state) as st:
        st.node.checkpoint_supported = 0  # the new agent's detection finds no checkpoint API
    restart_with(node)
    log = node.sim.agent.log
    victim.app.send(f"check {guarantee[1]}")  # its next GPU work asks for its memory back
    until(lambda: "asks for its memory back; denied" in log(), what="the victim's swap-in denied")
    assert "cannot be used here" in log()  # said loudly, at ERROR
    assert swapped(victim)  # flags kept: its shim goes on asking instead of calling a locked driver
    with NodeState(node.sim.node_state) as st:
        st.node.checkpoint_supported = 1
    assert victim.app.line(TIMEOUT) == "ok", log()[-3000:]  # the API found again: restored
    assert victim.app.do(f"check {burst[1]}", TIMEOUT) == "ok"
    assert not any(s.swapped for s in abi.read_usage(victim.host_dir).slots)
    assert victim.alive()


@pytest.mark.parametrize("run", range(3))  # the race lost 7 of 10 times: each run is a fresh try
def test_a_container_swapped_out_when_the_agent_is_killed_comes_back_with_its_bytes(
    e2e_node: Callable[..., E2ENode], run: int
) -> None:
    node = e2e_node(resolvers=["swap", "wait"], swap={"idleThreshold": "1s"})
    victim = node.run_pod("victim", 4, "640Mi", swappable=True)  # 256 MiB guaranteed
    guarantee = victim.alloc(256 * MiB, 1111).split()
    burst = victim.alloc(256 * MiB, 2222).split()
    assert guarantee[0] == "ok" and burst[0] == "ok"
    requester = node.run_pod("requester", 4, "640Mi")
    mine = requester.alloc(256 * MiB, 3333).split()
    assert mine[0] == "ok"
    until(lambda: idle_for(victim, 1.5), timeout=TIMEOUT, what="the victim idle")
    # Only the victim's burst moving to host RAM makes room for this one.
    more = requester.alloc(320 * MiB, 4444).split()
    assert more[0] == "ok", f"requester burst: {more}; agent log:\n{node.sim.agent.log()[-3000:]}"
    assert swapped(victim)
    assert requester.app.do(f"free {more[1]}") == "ok"
    assert requester.app.do(f"free {mine[1]}") == "ok"

    node.sim.agent.kill()  # SIGKILL: nothing of it runs on
    node.sim.restart_agent()
    # The victim's next launch asks the new agent for its memory back; it must come, bytes intact.
    assert victim.app.do(f"check {guarantee[1]}", TIMEOUT) == "ok", node.sim.agent.log()[-3000:]
    assert victim.app.do(f"check {burst[1]}", TIMEOUT) == "ok"
    assert not any(s.swapped for s in abi.read_usage(victim.host_dir).slots)
    assert victim.alive() and requester.alive()
