"""End-to-end nodes for burst tests: every part real, nothing stood in for.

* the agent: `python -m gpufrac.agent.main` (AgentProcess) on a small simulated GPU,
  registered with the kubelet emulator, watching pods on the apiserver emulator;
* a pod: created in the apiserver (annotations, spec.priority), admitted by the kubelet
  emulator through the agent's device plugin, its container started by the runtime
  emulator from the Allocate response (envs and mounts as given, LD_PRELOAD included)
  in a real cgroup, and status.containerStatuses[].containerID set to the runtime's ID;
* the container's process: gpufrac.simgpu.workload (cuda-python over the fake libcuda)
  under the real memguard shim, talking to the agent's real arbiter socket.

The GPU is small (1 GiB, 64 MiB memory units) so bursts collide after a few hundred MiB
of allocations: the workload fills what it allocates, and fake device memory is host RAM.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from agentsim_fixtures import Sim, short_tmpdir, start_sim, stop_sim
from kube_fixtures import KubeServer, pod_manifest
from polling import until

from gpufrac.core import annotations as ann
from gpufrac.core import native
from gpufrac.core.slices import MEMORY
from gpufrac.core.units import parse_bytes
from gpufrac.memguard import abi
from gpufrac.simgpu.kubelet import Container as KContainer
from gpufrac.simgpu.kubelet import Pod
from gpufrac.simgpu.runtime import Container, ContainerRuntime, mounts_of
from gpufrac.simgpu.spec import spec_from_dict
from gpufrac.simgpu.workload import WorkloadProcess

MiB = 1 << 20
GiB = 1 << 30
NODE = "node-a"
UNIT = 64 * MiB  # memoryUnit: gpufrac.dev/gpu-memory counts these
TIMEOUT = 120.0  # generous: a loaded 2-core box

# One 1 GiB GPU; the driver keeps 32 MiB, the agent reserves 64 MiB: 960 MiB allocatable (15 units).
# A 1 GiB GPU: the tests size requests, bursts and collisions to the MiB on it. Its contexts
# cost nothing (a real one, hundreds of MiB, would not leave room for them); what a context
# costs a container end to end is tested on the presets (test_context_cost_agent.py).
SMALL_NODE = {
    "node_name": "sim-small",
    "gpus": [
        {
            "model": "NVIDIA L4",
            "memory": "1Gi",
            "reserved": "32Mi",
            "pci_bus_id": "00000000:17:00.0",
            "context_memory": 0,
        }
    ],
}


def agent_config(root: Path, kube: KubeServer, **overrides: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "nodeName": NODE,
        "apiServer": kube.url,
        "memoryUnit": "64Mi",
        "reservedPerGpu": "64Mi",
        "grantMargin": "16Mi",
        "arbiterTimeout": "2s",
        "resolvers": ["wait"],
        "statusSocket": str(root / "status.sock"),
        "metrics": {"port": 1},  # nothing may bind it: the agent logs that and goes on
    }
    cfg.update(overrides)
    return cfg


@dataclass
class PodRun:
    """A running pod: its container, the host directory of its config and usage files, and
    the workload driven over the container process's stdin/stdout."""

    name: str
    pod: Pod
    host_dir: Path
    container: Container
    app: WorkloadProcess

    def config(self) -> abi.ContainerConfig:
        return abi.read_config(self.host_dir)

    def used(self) -> int:
        return int(abi.read_usage(self.host_dir).total_used)

    def grant(self) -> int:
        return self.config().grant_bytes

    def alloc(self, nbytes: int, value: int = 1, timeout: float = TIMEOUT) -> str:
        """cuMemAlloc in the container: "ok <id>" or "oom"."""
        return self.app.do(f"alloc {nbytes} {value}", timeout)

    def send(self, cmd: str) -> None:
        """Start a command without waiting for its answer (read it with app.line())."""
        self.app.send(cmd)

    def alive(self) -> bool:
        return self.container.alive()


class E2ENode:
    def __init__(self, sim: Sim, kube: KubeServer, runtime: ContainerRuntime) -> None:
        self.sim, self.kube, self.runtime = sim, kube, runtime
        self.v1 = kube.core_v1()
        self.pods: list[PodRun] = []

    @property
    def gpu(self) -> str:
        return self.sim.gpus[0]

    def app_env(self) -> dict[str, str]:
        """The base environment of a container process: the simulated node's driver."""
        env = dict(self.sim.agent.env)  # SIMGPU_STATE, LD_LIBRARY_PATH of the fake driver
        env.pop("LD_PRELOAD", None)
        return env

    def run_pod(
        self,
        name: str,
        units: int,
        limit: str | None = None,
        *,
        priority: int = 0,
        preemptible: bool = True,
        wait_timeout: str = "60s",
        swappable: bool = False,
    ) -> PodRun:
        annotations = {ann.WAIT_TIMEOUT: wait_timeout, ann.PREEMPTIBLE: str(preemptible).lower()}
        if swappable:
            annotations[ann.SWAPPABLE] = "true"
        if limit:
            annotations[ann.MEMORY_LIMIT] = limit
        pod = Pod("default", name, [KContainer("main", {MEMORY: units})], annotations=annotations)
        self.v1.create_namespaced_pod(
            "default", pod_manifest(name, node=NODE, annotations=annotations, priority=priority, uid=pod.uid)
        )
        self.sim.kubelet.admit(pod)
        resp = self.sim.kubelet.allocate_response(pod.uid, "main", MEMORY)
        config_mount = next(m for m in resp.mounts if m.container_path.endswith("/" + abi.CONFIG_FILE))
        host_dir = Path(config_mount.host_path).parent
        c = self.runtime.start(
            pod.uid,
            "main",
            WorkloadProcess.argv(),
            env=self.app_env(),
            envs=dict(resp.envs),  # LD_PRELOAD of the shim, GPUFRAC_CONTAINER_DIR: as the kubelet gives them
            mounts=mounts_of(resp),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        self.runtime.wait_entered(c)
        # A container runtime reaps its container's processes (containerd-shim): a killed
        # process must not linger as a zombie of this test process.
        threading.Thread(target=c.proc.wait, name=f"reap-{name}", daemon=True).start()
        cs = {"name": "main", "containerID": c.runtime_id, "image": "app", "imageID": "app", "ready": True}
        self.v1.patch_namespaced_pod(
            name,
            "default",
            {"status": {"phase": "Running", "containerStatuses": [{**cs, "restartCount": 0}]}},
        )
        # The agent has learned the pod (pod-resources, then the apiserver) once its policy shows in the
        # config: the pod's UID, and its limit when it has one.
        want_limit = parse_bytes(limit) if limit else units * UNIT

        def applied() -> bool:
            cfg = abi.read_config(host_dir)
            return cfg.pod_uid == pod.uid and cfg.limit_bytes == want_limit and cfg.priority == priority

        try:
            until(applied, what=f"{name}'s policy applied by the agent")
        except AssertionError as e:
            raise AssertionError(f"{e}; agent log:\n{self.sim.agent.log()[-3000:]}") from None
        run = PodRun(name, pod, host_dir, c, WorkloadProcess(c.proc, name, TIMEOUT))
        self.pods.append(run)
        return run

    def events(self, pod: PodRun, reason: str) -> list[dict[str, Any]]:
        """Events the agent posted on `pod` with `reason` (read from the apiserver)."""
        out = []
        for e in self.kube.events("default"):
            obj = e.get("involvedObject") or {}
            if (
                obj.get("name") == pod.name
                and obj.get("uid", pod.pod.uid) == pod.pod.uid
                and e.get("reason") == reason
            ):
                out.append(e)
        return out

    def close(self) -> None:
        for p in self.pods:
            if p.alive():
                p.app.close(timeout=10)


@pytest.fixture
def e2e_node(kube_server: KubeServer) -> Iterator[Callable[..., E2ENode]]:
    """e2e_node(**agent config overrides) -> an E2ENode with its agent registered."""
    made: list[E2ENode] = []
    native.library(native.FAKE_CUDA)
    native.library(native.SHIM)

    def make(**overrides: Any) -> E2ENode:
        root = short_tmpdir("gfe")
        try:
            runtime = ContainerRuntime(view_root=root / "v")
        except BaseException:
            shutil.rmtree(root, ignore_errors=True)
            raise
        try:
            sim = start_sim(root, spec_from_dict(SMALL_NODE), agent_config(root, kube_server, **overrides))
        except BaseException:
            runtime.close()
            shutil.rmtree(root, ignore_errors=True)
            raise
        node = E2ENode(sim, kube_server, runtime)
        made.append(node)
        return node

    try:
        yield make
    finally:
        for node in made:
            # Shown by pytest only when the test failed.
            print(f"--- agent log ({node.sim.root}) ---\n{node.sim.agent.log()[-6000:]}")
            try:
                node.close()
                node.runtime.close()
            finally:
                stop_sim(node.sim)
