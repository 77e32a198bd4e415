"""The watchdog on a simulated node: real processes in real cgroups hold GPU memory that NVML
shows; the watchdog maps them to their containers through /proc/<pid>/cgroup and the pod's
status, and kills (enforce) or reports (report) the ones over their container's limit."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gpufrac.agent.kube.events import REASON_LIMIT_ENFORCED, REASON_OVER_LIMIT
from gpufrac.agent.watchdog.service import Watchdog
from gpufrac.core.config import WatchdogConfig
from tests.fixtures.arbiter_harness import ArbiterNode, Box, GiB, MiB
from tests.fixtures.kube import KubeServer
from tests.fixtures.polling import until

# A program that bypasses the shim: it records GPU memory for itself in the simulated
# driver's node state, as a static binary talking to the driver would, and waits. With
# several sizes it starts one such process per size (all in its container) and prints
# their pids.
HOG = textwrap.dedent(
    """
    import os, subprocess, sys
    from gpufrac.agent.processes.proc import proc_identity
    from gpufrac.simgpu.nodestate import NodeState
    if len(sys.argv) > 2:
        pipe = subprocess.PIPE
        argvs = [[sys.executable, "-c", CODE, s] for s in sys.argv[1:]]
        kids = []
        for a in argvs:  # one at a time: a slot is claimed below without compare-and-swap
            kids.append(subprocess.Popen(a, stdin=pipe, stdout=pipe))
            assert kids[-1].stdout.readline().split()[0] == b"ready"
        print("ready", *[k.pid for k in kids], flush=True)
        sys.stdin.read()
        raise SystemExit
    st = NodeState(os.environ["SIMGPU_STATE"])
    used = int(sys.argv[1])
    for slot in st.node.procs:
        if slot.pid == 0:
            slot.gpu, slot.used_bytes = 0, used
            slot.start_time = proc_identity(os.getpid())[1]
            slot.pid = os.getpid()
            break
    st.node.gpus[0].used_bytes += used
    print("ready", os.getpid(), flush=True)
    sys.stdin.read()
    """
)
HOG = HOG.replace("CODE", repr(HOG))


@pytest.fixture
def node(make_node: Callable[..., ArbiterNode]) -> ArbiterNode:
    return make_node()


@pytest.fixture
def sim_state(node: ArbiterNode) -> Path:
    assert node.state_path is not None
    return node.state_path


def hog_env(sim_state: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)  # what a shim-less program looks like
    env["SIMGPU_STATE"] = str(sim_state)
    return env


def start_hog(node: ArbiterNode, box: Box, sizes: list[int], sim_state: Path) -> list[int]:
    """Shim-less processes in the container of `box`, one per size, holding memory on GPU 0."""
    c = node.runtime.start(
        box.uid,
        "main",
        [sys.executable, "-c", HOG, *map(str, sizes)],
        env=hog_env(sim_state),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert c.proc.stdout is not None
    line = c.proc.stdout.readline().split()
    assert line[0] == b"ready", line
    box.container = c
    node.set_container_id(box.pod, box.uid, c.runtime_id)
    return [int(p) for p in line[1:]]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def make_watchdog(node: ArbiterNode, mode: str) -> Watchdog:
    cfg = WatchdogConfig(mode=mode, tolerance=256 * MiB, interval=0.05)
    return Watchdog(cfg, node.ledger, node.arbiter.peers, node.identity.events, metrics=node.metrics)


def events(kube: KubeServer, reason: str) -> list[dict[str, Any]]:
    return [e for e in kube.events("default") if e.get("reason") == reason]


def test_enforce_kills_the_newest_shimless_process_until_the_rest_fits(
    node: ArbiterNode,
    sim_state: Path,
    kube_server: KubeServer,
) -> None:
    a = node.add("a", 1, "2Gi", start=False)
    small, big = start_hog(node, a, [512 * MiB, 3 * GiB], sim_state)  # started in this order
    wd = make_watchdog(node, "enforce")
    node.on_loop(wd.start)
    try:
        until(lambda: not alive(big), what="the watchdog to kill the 3 GiB process")
        until(lambda: events(kube_server, REASON_LIMIT_ENFORCED), what="the Warning Event")
    finally:
        node.on_loop(wd.stop)
    # 3.5 GiB > 2 GiB + 256 MiB: the newest (3 GiB) process went, the older 512 MiB one fits
    # and stays.
    assert alive(small)
    (ev,) = events(kube_server, REASON_LIMIT_ENFORCED)
    assert ev["type"] == "Warning"
    assert ev["involvedObject"]["name"] == "a"
    assert "3.5Gi" in ev["message"] and "limit 2Gi" in ev["message"] and str(big) in ev["message"]
    assert wd.kills == 1


def test_report_mode_only_reports_once_per_episode(
    node: ArbiterNode,
    sim_state: Path,
    kube_server: KubeServer,
) -> None:
    a = node.add("a", 1, "1Gi", start=False)
    (hog,) = start_hog(node, a, [2 * GiB], sim_state)
    wd = make_watchdog(node, "report")
    (v,) = node.on_loop(wd.scan)
    assert v.usage == 2 * GiB and v.limit == GiB and v.kill == []
    assert node.on_loop(wd.scan)[0].kill == []  # still over: not reported twice
    until(lambda: events(kube_server, REASON_OVER_LIMIT), what="the Warning Event")
    assert alive(hog)
    assert wd.reports == 1 and wd.kills == 0
    (ev,) = events(kube_server, REASON_OVER_LIMIT)
    assert ev["type"] == "Warning" and "report mode" in ev["message"] and "2Gi" in ev["message"]


def test_processes_of_no_gpufrac_container_are_reported_never_killed(
    node: ArbiterNode,
    sim_state: Path,
    kube_server: KubeServer,
) -> None:
    # One on the host (no kubelet cgroup), one in a kubelet pod gpufrac does not serve.
    host = subprocess.Popen(
        [sys.executable, "-c", HOG, str(40 * GiB)],
        env=hog_env(sim_state),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert host.stdout is not None and host.stdout.readline().split()[0] == b"ready"
    other = node.runtime.start(
        "0badc0de-0000-4000-8000-000000000001",
        "main",
        [sys.executable, "-c", HOG, str(20 * GiB)],
        env=hog_env(sim_state),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert other.proc.stdout is not None and other.proc.stdout.readline().split()[0] == b"ready"
        wd = make_watchdog(node, "enforce")
        assert node.on_loop(wd.scan) == []
        assert set(wd.unowned) == {host.pid, other.proc.pid}
        assert wd.unowned[host.pid].used == 40 * GiB
        assert host.poll() is None and other.proc.poll() is None
        assert wd.kills == 0
    finally:
        host.kill()
        host.wait()
