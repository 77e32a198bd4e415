"""An agent that died while holding a container's processes stopped (SIGSTOP, compute/hold.py)
or its launches paced leaves no tenant stopped or paced for good (docs/compute.md, "Stopping").

A restarted agent, as it starts, continues the GPU processes of the pods it books that it finds
stopped, and lifts every pace left in their configs (gpufrac.agent.compute.leftover): also when it
cannot read the pods (an apiserver slow or away at its start), and also when it runs without
compute shares (compute.enabled: false, or NVML without per-process utilisation), since nothing
else will ever continue them. Never a process of a pod it books nothing for.

The real agent (killed with SIGKILL, started again), a real workload process under the shim in
a real cgroup, stopped by the test as the dead agent's hold left it.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable

import pytest
import yaml

from gpufrac.memguard import abi
from gpufrac.simgpu.kubelet import Container as KContainer
from gpufrac.simgpu.kubelet import Pod
from tests.fixtures.e2e import E2ENode, PodRun
from tests.fixtures.pod_containers import start_in_pod
from tests.fixtures.polling import until

pytestmark = [pytest.mark.security, pytest.mark.slow]

MakeNode = Callable[..., E2ENode]


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    return stat[stat.rindex(b")") + 2 :].split()[0].decode()


def _pod_saved(node: E2ENode, pod: PodRun) -> bool:
    """Whether the agent's state file records `pod`'s UID for its booking (saves are batched)."""
    try:
        allocations = node.sim.agent.state()["allocations"]
    except (OSError, ValueError, KeyError):
        return False
    return any(a.get("pod_uid") == pod.pod.uid for a in allocations)


def _left_held(node: E2ENode, pod: PodRun, pace_ns: int = 0) -> int:
    """Kill the agent as it held `pod`: its GPU process stopped, its launches paced (as the dead
    agent's hold and pace left them). The process's pid."""
    assert pod.app.do("info").startswith("free")  # its context is made: a GPU process
    until(lambda: _pod_saved(node, pod), what="the pod's UID in the agent's state file")
    node.sim.agent.kill()
    pid = pod.container.proc.pid
    os.kill(pid, signal.SIGSTOP)
    until(lambda: _state(pid) == "T", what="the process stopped")
    if pace_ns:
        handle = abi.ConfigFile(pod.host_dir)
        try:
            handle.set_pace(pace_ns)
        finally:
            handle.close()
    return pid


def _pace(pod: PodRun) -> int:
    handle = abi.ConfigFile(pod.host_dir)
    try:
        return handle.pace()
    finally:
        handle.close()


def test_a_process_left_stopped_is_continued_though_its_pod_cannot_be_read(e2e_node: MakeNode) -> None:
    """The restarted agent cannot read the pods (their reads held at the apiserver): it cannot
    tell which of the pod's containers the stopped process is in, nor its policy. It continues
    it all the same, from the booking it restored (with its pod's UID), the driver's list and
    the process's cgroup. Before: it looked once, at its first control period, through the pod's
    status, and the process stayed stopped for good."""
    node = e2e_node()
    a = node.run_pod("a", 2)
    pid = _left_held(node, a)
    node.kube.hold_pod_reads()
    try:
        node.sim.agent.start()
        until(lambda: _state(pid) != "T", timeout=60, what="the stopped process continued")
    finally:
        node.kube.release_pod_reads()
    assert a.app.do("info").startswith("free")  # it runs: its GPU calls answer


def test_a_process_left_stopped_is_continued_once_its_pod_is_known_when_the_state_lacked_it(
    e2e_node: MakeNode,
) -> None:
    """The agent was killed before its batched state save recorded the pod's UID, and the pods
    cannot be read as the new one starts: nothing tells it yet whose the stopped process is, and
    it is left stopped. Once the pod is read (its UID bound to the booking), it is continued.
    Before: the first control period looked once, and the process stayed stopped for good."""
    node = e2e_node()
    a = node.run_pod("a", 2)
    pid = _left_held(node, a)
    state_file = node.sim.agent.state_dir / "state.json"
    state = json.loads(state_file.read_text())
    for alloc in state["allocations"]:
        alloc["pod_uid"] = None  # as the save before the pod was known wrote it
    state_file.write_text(json.dumps(state))
    node.kube.hold_pod_reads()
    try:
        node.sim.restart_agent()  # started: its start's pass found nothing it could place
        assert _state(pid) == "T"
    finally:
        node.kube.release_pod_reads()
    until(lambda: _state(pid) != "T", timeout=60, what="the stopped process continued")
    assert a.app.do("info").startswith("free")


def test_an_agent_restarted_without_compute_shares_continues_what_it_finds_stopped_and_lifts_paces(
    e2e_node: MakeNode,
) -> None:
    """The earlier agent held the container (stopped, and paced at 4 s between launches); the new
    one runs with compute.enabled: false. Before: nothing continued the process nor lifted the
    pace, ever. A stopped GPU process of a pod the agent books nothing for (another tenant's,
    stopped by its own user) is left stopped."""
    node = e2e_node()
    a = node.run_pod("a", 2)
    other = Pod("default", "other", [KContainer("main", {})])
    _, other_app = start_in_pod(node, other, "main", shim=False)
    assert other_app.do("info").startswith("free")  # a GPU process too
    other_pid = other_app.proc.pid
    pid = _left_held(node, a, pace_ns=4_000_000_000)
    os.kill(other_pid, signal.SIGSTOP)
    until(lambda: _state(other_pid) == "T", what="the other tenant's process stopped")
    cfg = yaml.safe_load(node.sim.agent.config_path.read_text())
    cfg["compute"] = {"enabled": False}
    node.sim.agent.config_path.write_text(yaml.safe_dump(cfg))
    try:
        node.sim.restart_agent()
        until(lambda: _state(pid) != "T", timeout=60, what="the stopped process continued")
        until(lambda: _pace(a) == 0, what="the pace lifted")
        assert a.app.do("info").startswith("free")
        # The agent registered (restart_agent waits for it) after its start's one pass over the
        # driver's list: what it would continue, it has.
        assert _state(other_pid) == "T"
    finally:
        os.kill(other_pid, signal.SIGCONT)
        other_app.close(timeout=2)
