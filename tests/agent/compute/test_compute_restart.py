"""An agent that died while holding a container's processes stopped (SIGSTOP, compute/hold.py)
or its launches paced leaves no tenant stopped or paced for good (docs/compute.md, "Stopping").

A restarted agent continues the GPU processes of its containers it finds stopped, and lifts
every pace left in their configs: also when it cannot yet tell whose a process is at its first
control period (its pod cache not filled: an apiserver slow or away at its start), and also when
it runs without compute shares (compute.enabled: false, or NVML without per-process
utilisation), since nothing else will ever continue them.

The real agent (killed with SIGKILL, started again), a real workload process under the shim in
a real cgroup, stopped by the test as the dead agent's hold left it.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

import pytest
import yaml

from gpufrac.agent.status.client import StatusUnavailable, fetch
from gpufrac.memguard import abi
from tests.fixtures.e2e import E2ENode, PodRun
from tests.fixtures.polling import until

pytestmark = [pytest.mark.security, pytest.mark.slow]

MakeNode = Callable[..., E2ENode]


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    return stat[stat.rindex(b")") + 2 :].split()[0].decode()


def _left_held(node: E2ENode, pod: PodRun, pace_ns: int = 0) -> int:
    """Kill the agent as it held `pod`: its GPU process stopped, its launches paced (as the dead
    agent's hold and pace left them). The process's pid."""
    assert pod.app.do("info").startswith("free")  # its context is made: a GPU process
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


def _status(node: E2ENode) -> dict[str, object] | None:
    try:
        return fetch(str(node.sim.agent.root / "status.sock"), timeout=5)
    except StatusUnavailable:
        return None


def test_a_process_left_stopped_is_continued_though_its_pod_is_not_known_at_the_first_period(
    e2e_node: MakeNode,
) -> None:
    """The restarted agent's first control periods run before it can read the pods (their reads
    held at the apiserver): it cannot tell whose the stopped process is then. Once it can, it
    continues it. Before: it looked once, at its first period, and the process stayed stopped for
    good."""
    node = e2e_node()
    a = node.run_pod("a", 2)
    pid = _left_held(node, a)
    node.kube.hold_pod_reads()
    try:
        node.sim.agent.start()

        def periods_run() -> bool:
            status = _status(node)
            print("STATUS", status and {k: v for k, v in status.items() if k != "gpus"})
            containers = status.get("containers") if status else None
            return bool(containers) and all(
                c.get("compute_share") is not None
                for c in containers  # type: ignore[union-attr]
            )

        until(periods_run, what="the restarted agent's control periods running")
        assert _state(pid) == "T"  # nothing knows whose it is yet
    finally:
        node.kube.release_pod_reads()
    until(lambda: _state(pid) != "T", timeout=60, what="the stopped process continued")
    assert a.app.do("info").startswith("free")  # it runs: its GPU calls answer


def test_an_agent_restarted_without_compute_shares_continues_what_it_finds_stopped_and_lifts_paces(
    e2e_node: MakeNode,
) -> None:
    """The earlier agent held the container (stopped, and paced at 4 s between launches); the new
    one runs with compute.enabled: false. Before: nothing continued the process nor lifted the
    pace, ever."""
    node = e2e_node()
    a = node.run_pod("a", 2)
    pid = _left_held(node, a, pace_ns=4_000_000_000)
    cfg = yaml.safe_load(node.sim.agent.config_path.read_text())
    cfg["compute"] = {"enabled": False}
    node.sim.agent.config_path.write_text(yaml.safe_dump(cfg))
    node.sim.restart_agent()
    until(lambda: _state(pid) != "T", timeout=60, what="the stopped process continued")
    until(lambda: _pace(a) == 0, what="the pace lifted")
    assert a.app.do("info").startswith("free")
