"""A sidecar of a claim's pod is held to 0 in DRA mode as in device-plugin mode.

A container of a pod that uses a claim but does not use the claim itself (a sidecar that sees
the GPU: privileged, or NVIDIA_VISIBLE_DEVICES=all under the NVIDIA runtime) holds no booking
on the GPU: its limit there is 0, it has no allowance, and a neighbour's guarantee takes its
memory back first (docs/security.md, "Sidecars"). A claim's booking is tied to its containers
by its consumers, never by one container name: were claims taken for bookings "not yet tied to
their container", no sidecar on a GPU holding a claim would ever be judged, and its memory
would cost a neighbour its guarantee for good.

One 1 GiB GPU (960 MiB allocatable in 64 MiB units), the real agent as a DRA driver, real
workload processes in real cgroups, the claims' containers started from their CDI specs.
"""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from gpufrac.core import native
from gpufrac.simgpu.kubelet.dra import ClaimPod
from gpufrac.simgpu.runtime import Container, ContainerRuntime
from gpufrac.simgpu.spec import spec_from_dict
from gpufrac.simgpu.workload import WorkloadProcess
from tests.fixtures.agentsim import short_tmpdir
from tests.fixtures.dra import DraNode, install_device_classes, params, start_dra_node, stop_dra_node
from tests.fixtures.kube import KubeServer
from tests.fixtures.polling import until

pytestmark = [pytest.mark.security, pytest.mark.slow]

MiB = 1 << 20
GPU = {"model": "NVIDIA L4", "memory": "1Gi", "reserved": "32Mi", "context_memory": 0}
NODE = {"node_name": "node-a", "gpus": [{**GPU, "pci_bus_id": "00000000:17:00.0"}]}
CONFIG: dict[str, Any] = {
    "memoryUnit": "64Mi",
    "reservedPerGpu": "64Mi",
    "grantMargin": "16Mi",
    "resolvers": ["evict", "wait"],
    "watchdog": {"tolerance": "16Mi", "interval": "200ms"},
}


@pytest.fixture
def node(kube_server: KubeServer) -> Iterator[tuple[DraNode, ContainerRuntime]]:
    native.library(native.FAKE_CUDA)
    native.library(native.SHIM)
    install_device_classes(client.ResourceV1Api(kube_server.api_client()))
    root = short_tmpdir("gfs")
    n = start_dra_node(root, kube_server, spec_from_dict(NODE), name="node-a", **CONFIG)
    runtime = ContainerRuntime(view_root=root / "v")
    try:
        yield n, runtime
    finally:
        runtime.close()
        print(f"--- agent log ---\n{n.agent.log()[-6000:]}")
        stop_dra_node(n)


def start(
    node: DraNode, runtime: ContainerRuntime, pod: ClaimPod, names: list[str]
) -> dict[str, WorkloadProcess]:
    """The pod's containers, each as the runtime starts it from the CDI devices of the claims it
    uses (a container using none gets the node's driver all the same, without the shim: it sees
    the GPU), their container IDs in the pod's status."""
    apps: dict[str, WorkloadProcess] = {}
    started: list[tuple[str, Container]] = []
    for name in names:
        env, mounts = node.kubelet.container_edits(pod.uid, name)
        base = dict(node.agent.env)
        base.pop("LD_PRELOAD", None)
        c = runtime.start(
            pod.uid, name, WorkloadProcess.argv(), env=base, envs=env, mounts=mounts,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )  # fmt: skip
        runtime.wait_entered(c)
        threading.Thread(target=c.proc.wait, daemon=True).start()  # a runtime reaps its processes
        started.append((name, c))
        apps[name] = WorkloadProcess(c.proc, f"{pod.name}/{name}", 120)
    statuses = [
        {"name": n, "containerID": c.runtime_id, "image": "app", "imageID": "app", "ready": True}
        | {"restartCount": 0}
        for n, c in started
    ]
    node.kube.core_v1().patch_namespaced_pod(
        pod.name, "default", {"status": {"phase": "Running", "containerStatuses": statuses}}
    )
    return apps


def test_a_sidecar_of_a_claims_pod_cannot_cost_a_neighbour_its_guarantee(
    node: tuple[DraNode, ContainerRuntime],
) -> None:
    """a's pod: `main` uses claim a (128 MiB, limit 256 MiB), `sidecar` uses no claim and
    allocates 700 MiB without the shim. b's claim (512 MiB) fills its request: its allocation
    within its guarantee succeeds, the sidecar is killed (by b's reclaim or the watchdog), and
    a's main container is left alone. Before: b's allocation was refused at its wait timeout
    ("could not reclaim ... missing") and the sidecar lived on, never judged."""
    n, runtime = node
    apps: list[WorkloadProcess] = []
    try:
        n.create_claim("b", "512Mi", config=[params(waitTimeout="20s")])
        pod_b = n.run("b", ["b"])
        b = start(n, runtime, pod_b, ["main"])
        apps += b.values()
        n.create_claim("a", "128Mi", config=[params(memoryLimit="256Mi")])
        pod_a = n.run("a", ["a"], containers={"main": ["c0"], "sidecar": []})
        a = start(n, runtime, pod_a, ["main", "sidecar"])
        apps += a.values()
        # All the free memory, without the shim (killed first, for the few bytes every workload
        # process holds from its start, is what the fix may do too).
        assert a["sidecar"].do(f"alloc {700 * MiB} 1") in ("ok 1", "<exited>")
        assert a["main"].do(f"alloc {64 * MiB}") == "ok 1"
        # b allocates inside its guarantee: the sidecar's memory must go.
        assert b["main"].do(f"alloc {480 * MiB} 1", 120) == "ok 1"
        assert b["main"].do("check 1") == "ok"
        until(lambda: a["sidecar"].proc.poll() is not None, what="the sidecar's process killed")
        # a's main container, within its claim's limit, is not touched.
        assert a["main"].proc.poll() is None and a["main"].do("check 1") == "ok"
    finally:
        for app in apps:
            app.close(timeout=2)
