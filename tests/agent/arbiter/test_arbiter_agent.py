"""The arbiter inside the real agent process: the kubelet emulator admits pods through the
device plugin, the apiserver emulator holds the pods, containers are real processes in real
cgroups started from the kubelet's Allocate response; then the agent is killed and restarted."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from gpufrac.core.slices import MEMORY
from gpufrac.memguard import abi
from gpufrac.simgpu.kubelet import Container as KContainer
from gpufrac.simgpu.kubelet import Pod
from gpufrac.simgpu.runtime import ContainerRuntime, mounts_of
from tests.fixtures.agentsim import Sim
from tests.fixtures.arbiter_harness import GiB, Workload
from tests.fixtures.kube import KubeServer, pod_manifest
from tests.fixtures.polling import until

NODE = "node-a"


class Node:
    def __init__(self, sim: Sim, kube: KubeServer, runtime: ContainerRuntime) -> None:
        self.sim, self.kube, self.runtime = sim, kube, runtime
        self.v1 = kube.core_v1()

    def run_pod(
        self, name: str, gib: int, limit: str, wait_timeout: str = "60s"
    ) -> tuple[Pod, Path, Workload]:
        ann = {"gpufrac.dev/gpu-memory-limit": limit, "gpufrac.dev/wait-timeout": wait_timeout}
        pod = Pod("default", name, [KContainer("main", {MEMORY: gib})], annotations=ann)
        self.v1.create_namespaced_pod("default", pod_manifest(name, node=NODE, annotations=ann, uid=pod.uid))
        self.sim.kubelet.admit(pod)
        resp = self.sim.kubelet.allocate_response(pod.uid, "main", MEMORY)
        host_dir = Path(next(m.host_path for m in resp.mounts if m.container_path.endswith("/config"))).parent
        c = self.runtime.start(
            pod.uid,
            "main",
            [sys.executable, "-m", "gpufrac.simgpu.runtime"],
            envs={k: v for k, v in resp.envs.items() if k != "LD_PRELOAD"},  # the stand-in is the shim
            mounts=mounts_of(resp),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        cs = {"name": "main", "containerID": c.runtime_id, "image": "app", "imageID": "app", "ready": True}
        self.v1.patch_namespaced_pod(
            name,
            "default",
            {"status": {"phase": "Running", "containerStatuses": [{**cs, "restartCount": 0}]}},
        )
        # The agent learns the pod (pod-resources, then the apiserver) and applies its limit.
        until(lambda: abi.read_config(host_dir).limit_bytes > gib * GiB, what=f"{name}'s limit applied")
        return pod, host_dir, Workload(_Named(name), c)


class _Named:
    def __init__(self, pod: str) -> None:
        self.pod = pod


@pytest.fixture
def node(make_sim: Callable[..., Sim], kube_server: KubeServer) -> Iterator[Node]:
    sim = make_sim(config={"nodeName": NODE, "apiServer": kube_server.url, "resolvers": ["wait"]})
    with ContainerRuntime(view_root=sim.root / "v") as runtime:
        yield Node(sim, kube_server, runtime)


def arbiter_conns(node: Node, host_dir: Path) -> list[Any]:
    """The agent's unix sockets on a container's own arbiter socket (the listener and accepted
    requests)."""
    sock = str(host_dir / abi.SOCKET_DIR / abi.SOCKET_FILE)
    return [c for c in psutil.Process(node.sim.agent.pid).net_connections("unix") if c.laddr == sock]


def _grant(host_dir: Path) -> int:
    return abi.read_config(host_dir).grant_bytes


def test_agent_grants_bursts_to_its_containers(node: Node) -> None:
    _, a_dir, a = node.run_pod("a", 4, "10Gi")
    assert a.do(f"alloc {4 * GiB}") == "fast"
    assert a.do(f"alloc {3 * GiB}") == "granted"
    assert _grant(a_dir) == 3 * GiB
    assert a.do(f"alloc {4 * GiB}") == "denied"  # past the 10 GiB limit


def test_agent_kill_while_waiting_then_restart_reconciles(node: Node, kube_server: Any) -> None:
    _, a_dir, a = node.run_pod("a", 30, "78Gi", wait_timeout="0s")  # a never waits
    _, b_dir, b = node.run_pod("b", 30, "60Gi", wait_timeout="120s")
    assert a.do(f"alloc {30 * GiB}") == "fast" and b.do(f"alloc {30 * GiB}") == "fast"
    # a takes all that can be granted; it asks for more than there is, in halves, until refused.
    step = 16 * GiB
    while step >= GiB:
        if a.do(f"alloc {step}") != "granted":
            step //= 2
    a_grant = _grant(a_dir)
    assert a_grant > 0
    b.send(f"alloc {2 * GiB}")  # b waits: nothing is free
    until(lambda: len(arbiter_conns(node, b_dir)) >= 2, what="b's request held by the agent")  # listener + b
    node.sim.agent.kill()
    # The agent died holding b's request: b gets an answer (the connection closes), no hang.
    assert b.line(timeout=30) == "none"
    assert _grant(b_dir) == 0
    # While the agent is away a frees memory; its release cannot reach anyone.
    assert a.do(f"free {8 * GiB}") == "none"
    assert _grant(a_dir) == a_grant
    node.sim.restart_agent()
    # Back: grants above what containers use are taken back from the config files.
    try:
        until(lambda: _grant(a_dir) == a_grant - 8 * GiB, what="a's unused grant reclaimed")
    except AssertionError as e:
        log = node.sim.agent.log()[-3000:]
        raise AssertionError(f"{e}; grant {_grant(a_dir)}; agent log:\n{log}") from None
    # Once the new agent knows b again (its pod cache synced; a release is harmless) ...
    until(lambda: b.do("free 0") == "granted", what="b identified by the restarted agent")
    # ... the freed memory is there for b.
    assert b.do(f"alloc {2 * GiB}") == "granted"
