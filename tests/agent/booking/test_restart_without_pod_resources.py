"""An agent started without its state file while pod-resources does not answer (the kubelet
restarting) must not take live containers' directories for orphans.

Its ledger is empty until the kubelet answers; the directories it does not book yet are
those of containers still running, whose shims keep its config and usage files mapped and
reach it through the arbiter socket in it. Deleting them cuts the container off: a new
directory written when the container is adopted is another pair of files, which its shim
never sees. Every part real (tests/fixtures/e2e.py): the agent a subprocess, kill -9.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from gpufrac.memguard import abi
from tests.fixtures.e2e import E2ENode, MiB
from tests.fixtures.polling import until

pytestmark = pytest.mark.security


def inodes(host_dir: os.PathLike[str]) -> tuple[int, int]:
    """The config and usage files a directory holds (the shim keeps these very files mapped)."""
    return os.stat(os.path.join(host_dir, abi.CONFIG_FILE)).st_ino, os.stat(
        os.path.join(host_dir, abi.USAGE_FILE)
    ).st_ino


def test_a_live_containers_directory_survives_a_start_without_pod_resources_and_is_adopted(
    e2e_node: Callable[..., E2ENode],
) -> None:
    node = e2e_node()
    pod = node.run_pod("live", 4, "640Mi")  # 256 MiB guaranteed, bursts up to 640 MiB
    first = pod.alloc(128 * MiB, 1234).split()
    assert first[0] == "ok"
    files = inodes(pod.host_dir)
    key = os.path.basename(pod.host_dir)

    # The agent dies, its state file is lost, and the kubelet's pod-resources socket is
    # gone while the new agent starts (the kubelet restarting): nothing tells it of `live`.
    agent = node.sim.agent
    agent.kill()
    (agent.state_dir / "state.json").unlink()
    socket = node.sim.kubelet.pod_resources_socket
    away = socket.with_name("away.sock")
    os.rename(socket, away)
    node.sim.restart_agent()
    until(lambda: "not reachable at start" in agent.log(), what="the agent's start without pod-resources")
    # The kubelet answers again: the container is adopted (booked, its pod's policy applied).
    os.rename(away, socket)
    until(
        lambda: (
            key in {a["key"] for a in agent.state()["allocations"]} and pod.config().limit_bytes == 640 * MiB
        ),
        what=f"the container adopted; agent log:\n{agent.log()[-3000:]}",
    )

    # The same files its shim has mapped: the agent publishes grants where the shim reads them.
    assert inodes(pod.host_dir) == files
    burst = pod.alloc(300 * MiB, 5678).split()  # 428 MiB in all: past its 256 MiB guarantee
    assert burst[0] == "ok", f"burst after adoption: {burst}; agent log:\n{agent.log()[-3000:]}"
    assert pod.grant() > 0
    assert pod.app.do(f"check {first[1]}") == "ok" and pod.app.do(f"check {burst[1]}") == "ok"
    assert pod.alive()
