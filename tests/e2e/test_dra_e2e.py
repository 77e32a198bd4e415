"""The fragmentation DRA mode exists for, end to end on simgpu.

Device-plugin mode: node-a's two GPUs each have 6 memory units free. The scheduler sees the
node's 12 and binds a pod asking 8 there; the kubelet admits it, and the agent's Allocate
refuses it ("must come from one GPU"): the pod fails admission (UnexpectedAdmissionError).

DRA mode, the same request as a claim: the scheduler sees each GPU (node-a's two with 6 units
each, node-b's with 15), places the claim on the one GPU that fits, node-b's; the agent there
prepares it, and its container, a real CUDA process under the shim started from the claim's
CDI spec, is held to the claim's limit, with a burst above its request granted by the arbiter.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client

from gpufrac.core import native
from gpufrac.core.slices import MEMORY
from gpufrac.memguard import abi
from gpufrac.simgpu.kubelet import AdmissionError, Container, Pod
from gpufrac.simgpu.kubelet.dra import ClaimPod
from gpufrac.simgpu.runtime import ContainerRuntime
from gpufrac.simgpu.spec import spec_from_dict
from gpufrac.simgpu.workload import RESULT_BYTES, WorkloadProcess
from tests.fixtures.agentsim import short_tmpdir, start_sim, stop_sim
from tests.fixtures.dra import DraNode, install_device_classes, params, start_dra_node, stop_dra_node
from tests.fixtures.kube import KubeServer
from tests.fixtures.polling import until

MiB = 1 << 20
UNIT = 64 * MiB
# 1 GiB GPUs: 32 MiB the driver's, 64 MiB reserved, 960 MiB allocatable = 15 units of 64 MiB.
GPU = {"model": "NVIDIA L4", "memory": "1Gi", "reserved": "32Mi", "context_memory": 0}
NODE_A = {
    "node_name": "node-a",
    "gpus": [{**GPU, "pci_bus_id": "00000000:17:00.0"}, {**GPU, "pci_bus_id": "00000000:18:00.0"}],
}
NODE_B = {"node_name": "node-b", "gpus": [{**GPU, "pci_bus_id": "00000000:17:00.0"}]}
SMALL = {"memoryUnit": "64Mi", "reservedPerGpu": "64Mi", "grantMargin": "16Mi", "resolvers": ["wait"]}

pytestmark = pytest.mark.slow


@pytest.fixture
def roots() -> Iterator[list[Path]]:
    made: list[Path] = []
    yield made
    for r in made:
        shutil.rmtree(r, ignore_errors=True)


def test_device_plugin_mode_fails_admission_on_a_fragmented_node(roots: list[Path]) -> None:
    root = short_tmpdir("gfx")
    roots.append(root)
    sim = start_sim(root, spec_from_dict(NODE_A), {**SMALL, "statusSocket": str(root / "status.sock")})
    try:
        for name in ("fill-0", "fill-1"):  # 9 units on each GPU (binpack: the first that fits)
            sim.kubelet.admit(Pod("default", name, [Container("main", {MEMORY: 9})]))
        assert sim.kubelet.available(MEMORY) == 12  # what the scheduler sees of node-a
        with pytest.raises(AdmissionError) as e:
            sim.kubelet.admit(Pod("default", "server", [Container("main", {MEMORY: 8})]))
        assert e.value.reason == "UnexpectedAdmissionError"
        assert "must come from one GPU" in e.value.message
    finally:
        stop_sim(sim)


def test_dra_mode_places_the_request_on_the_gpu_that_fits_and_enforces_it(
    kube_server: KubeServer, roots: list[Path]
) -> None:
    native.library(native.FAKE_CUDA)
    native.library(native.SHIM)
    nodes: list[DraNode] = []
    runtime: ContainerRuntime | None = None
    app: WorkloadProcess | None = None
    try:
        install_device_classes(client.ResourceV1Api(kube_server.api_client()))
        for spec in (NODE_A, NODE_B):
            root = short_tmpdir("gfx")
            roots.append(root)
            nodes.append(
                start_dra_node(root, kube_server, spec_from_dict(spec), name=spec["node_name"], **SMALL)
            )
        a, b = nodes
        for i in range(2):  # node-a fragmented as above: 9 of each GPU's 15 units consumed
            a.create_claim(f"fill-{i}", "576Mi")
            a.run(f"fill-{i}", [f"fill-{i}"])
        # The same request, 8 units, as a claim that may burst to 12: the scheduler looks at
        # every GPU of every node, and only node-b's has 8 units unconsumed.
        uid = b.create_claim("server", "512Mi", config=[params(memoryLimit="768Mi", waitTimeout="0s")])
        status = b.allocator.allocate("default", "server", node=None, pod=None)
        (result,) = status["allocation"]["devices"]["results"]
        assert (result["pool"], result["device"], result["consumedCapacity"]) == (
            "node-b",
            "gpu-0",
            {"memory": "512Mi"},
        )
        pod = b.run("server", ["server"])  # reserved for the pod, prepared by node-b's agent
        cfg = b.state_claims()[uid]["config"]
        assert (cfg["request_bytes"], cfg["limit_bytes"]) == (8 * UNIT, 12 * UNIT)

        # Its container: a CUDA process under the shim, given what the claim's CDI spec says.
        runtime = ContainerRuntime(view_root=b.root / "v")
        app, host_dir = start(b, runtime, pod)
        assert app.do("info") == f"free {12 * UNIT - RESULT_BYTES} total {12 * UNIT}"  # it sees its limit
        assert app.do(f"alloc {400 * MiB}") == "ok 1"  # within its 512 MiB request
        assert abi.read_config(host_dir).grant_bytes == 0
        assert app.do(f"alloc {300 * MiB}") == "ok 2"  # 700 MiB: a burst, granted by the arbiter
        granted = abi.read_config(host_dir).grant_bytes
        assert granted > 0 and 8 * UNIT + granted <= 12 * UNIT
        assert app.do(f"alloc {100 * MiB}") == "oom"  # 800 MiB > its 768 MiB limit
        assert app.do("check 1") == "ok" and app.do("check 2") == "ok"
        assert abi.read_usage(host_dir).total_used == 700 * MiB + RESULT_BYTES
    finally:
        if app is not None:
            app.close(timeout=2)
        if runtime is not None:
            runtime.close()
        for n in nodes:
            print(f"--- agent log ({n.name}) ---\n{n.agent.log()[-4000:]}")
            stop_dra_node(n)


def test_a_claims_burst_is_evicted_for_a_higher_priority_claim(
    kube_server: KubeServer, roots: list[Path]
) -> None:
    """The resolvers work on claims as on pods: the claims' processes are found through the
    pods that use them, the victim's pod is told, its burst goes to the higher priority."""
    native.library(native.FAKE_CUDA)
    native.library(native.SHIM)
    install_device_classes(client.ResourceV1Api(kube_server.api_client()))
    root = short_tmpdir("gfx")
    roots.append(root)
    node = start_dra_node(
        root, kube_server, spec_from_dict(NODE_B), name="node-b", **{**SMALL, "resolvers": ["evict", "wait"]}
    )
    runtime = ContainerRuntime(view_root=root / "v")
    apps: list[WorkloadProcess] = []
    try:
        node.create_claim("a", "128Mi", config=[params(memoryLimit="896Mi", preemptible=True)])
        pod_a = node.run("a", ["a"], priority=0)
        a, _ = start(node, runtime, pod_a)
        apps.append(a)
        assert a.do(f"alloc {100 * MiB}") == "ok 1" and a.do(f"alloc {600 * MiB}") == "ok 2"  # a burst
        node.create_claim("h", "128Mi", config=[params(memoryLimit="512Mi", waitTimeout="60s")])
        pod_h = node.run("h", ["h"], priority=1000)
        h, h_dir = start(node, runtime, pod_h)
        apps.append(h)
        until(lambda: abi.read_config(h_dir).priority == 1000, what="h's priority, from its pod")
        assert h.do(f"alloc {100 * MiB}") == "ok 1"
        # h's burst does not fit beside a's: a, lower priority and preemptible, is evicted.
        assert h.do(f"alloc {200 * MiB}", 120) == "ok 2"
        until(lambda: a.proc.poll() is not None, what="a's process killed")
        assert a.proc.returncode == -9 and h.do("check 2") == "ok"
        evicted = until(
            lambda: [e for e in node.kube.events("default") if e["reason"] == "GpuMemoryEvicted"],
            what="the GpuMemoryEvicted Event",
        )
        assert evicted[0]["involvedObject"]["name"] == "a" and "claim default/h" in evicted[0]["message"]
    finally:
        for app in apps:
            app.close(timeout=2)
        runtime.close()
        print(f"--- agent log ---\n{node.agent.log()[-4000:]}")
        stop_dra_node(node)


def start(node: DraNode, runtime: ContainerRuntime, pod: ClaimPod) -> tuple[WorkloadProcess, Path]:
    """The pod's container, as the runtime starts it from the CDI devices of its claim: a CUDA
    process under the shim in the pod's cgroup, its container ID in the pod's status. Returns
    the workload and the claim's host directory."""
    env, mounts = node.kubelet.container_edits(pod.uid, "main")
    base = dict(node.agent.env)
    base.pop("LD_PRELOAD", None)
    c = runtime.start(
        pod.uid, "main", WorkloadProcess.argv(), env=base, envs=env, mounts=mounts,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
    )  # fmt: skip
    runtime.wait_entered(c)
    threading.Thread(target=c.proc.wait, daemon=True).start()  # a runtime reaps its processes
    cs = {"name": "main", "containerID": c.runtime_id, "image": "app", "imageID": "app", "ready": True}
    node.kube.core_v1().patch_namespaced_pod(
        pod.name,
        "default",
        {"status": {"phase": "Running", "containerStatuses": [{**cs, "restartCount": 0}]}},
    )
    host_dir = Path(next(m.host_path for m in mounts if m.container_path.endswith("/config"))).parent
    return WorkloadProcess(c.proc, pod.name, 120), host_dir
