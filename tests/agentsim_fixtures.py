"""A simulated GPU node with the kubelet emulator and the real agent as a subprocess.

Unix socket paths are limited to 108 bytes, so the node lives in a short
directory under /tmp rather than pytest's long tmp_path."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gpufrac.core import slices
from gpufrac.core.slices import FRACTION, MEMORY
from gpufrac.simgpu.kubelet import AgentProcess, Container, KubeletEmulator, Pod
from gpufrac.simgpu.nodestate import NodeState
from gpufrac.simgpu.spec import NodeSpec, create_node, load_preset


@dataclass
class Sim:
    root: Path
    node_state: Path
    kubelet: KubeletEmulator
    agent: AgentProcess

    @property
    def gpus(self) -> list[str]:
        """GPU UUIDs in NVML index order."""
        with NodeState(self.node_state) as st:
            return [g.uuid.decode() for g in st.gpus]

    def wait_registered(self, timeout: float = 60.0) -> None:
        k = self.kubelet
        try:
            k.wait_for(lambda: k.connected(FRACTION) and k.connected(MEMORY), timeout)
        except TimeoutError:
            raise AssertionError(f"agent never registered; its log:\n{self.agent.log()[-4000:]}") from None

    def admit(self, name: str, resource: str, count: int, namespace: str = "default") -> Pod:
        pod = Pod(namespace, name, [Container("main", {resource: count})])
        self.kubelet.admit(pod)
        return pod

    def gpus_of(self, pod: Pod) -> set[int]:
        """GPU indices a pod's devices landed on."""
        out = set()
        for per in self.kubelet.pod_devices(pod.uid).values():
            for ids in per.values():
                out |= {self.gpus.index(slices.parse(d).gpu_uuid) for d in ids}
        return out

    def healthy_on(self, resource: str, gpu: int) -> int:
        uuid = self.gpus[gpu]
        return sum(1 for d in self.kubelet.healthy(resource) if d.startswith(uuid + "::"))

    def restart_agent(self) -> None:
        self.agent.start()
        self.wait_registered()


def short_tmpdir(prefix: str) -> Path:
    """A fresh directory under /tmp: unix socket paths below it stay within their 108 bytes."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))


def start_sim(root: Path, spec: NodeSpec, config: dict[str, Any] | None = None, **agent_kw: Any) -> Sim:
    """The node `spec` in `root` (kept by the caller), the kubelet emulator, and the agent
    started with `config` and registered. Undo with stop_sim."""
    node_state = root / "node.state"
    create_node(spec, node_state)
    kubelet = KubeletEmulator(root / "kubelet").start()
    agent = AgentProcess(root / "agent", node_state, root / "kubelet", config, **agent_kw)
    sim = Sim(root, node_state, kubelet, agent)
    try:
        agent.start()
        sim.wait_registered()
    except BaseException:
        stop_sim(sim)
        raise
    return sim


def stop_sim(sim: Sim) -> None:
    try:
        sim.agent.stop()
        sim.kubelet.stop()
    finally:
        shutil.rmtree(sim.root, ignore_errors=True)


@pytest.fixture
def make_sim() -> Iterator[Callable[..., Sim]]:
    """make_sim(preset, config=agent config, **AgentProcess options) -> a Sim, its agent registered."""
    made: list[Sim] = []

    def make(preset: str = "dgx-h100", config: dict[str, Any] | None = None, **agent_kw: Any) -> Sim:
        root = short_tmpdir("gf")
        try:
            sim = start_sim(root, load_preset(preset), config, **agent_kw)
        except BaseException:
            shutil.rmtree(root, ignore_errors=True)
            raise
        made.append(sim)
        return sim

    yield make
    for sim in made:
        stop_sim(sim)


@pytest.fixture
def sim(make_sim: Callable[..., Sim]) -> Sim:
    return make_sim()
