"""The real agent in-process (Agent on an AgentThread) on a simulated node, with the kubelet
emulator and kmock's apiserver, for the metrics and status tests.

The agent reads NVML through this process's nvidia-ml-py (the fake libnvidia-ml.so.1,
see conftest.in_process_nvml); workloads are real subprocesses under the shim with
the environment the kubelet emulator gives their container. Scrapes go over real
HTTP on 127.0.0.1; the status endpoint is a real unix socket.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from agentsim_fixtures import short_tmpdir
from kube_fixtures import KubeServer, pod_manifest
from polling import until
from prometheus_client.parser import text_string_to_metric_families

from gpufrac.agent.ledger import ContainerAlloc
from gpufrac.agent.main import Agent
from gpufrac.agent.runner import AgentThread
from gpufrac.core import config as config_mod
from gpufrac.core import native
from gpufrac.core.slices import container_key
from gpufrac.memguard import build
from gpufrac.simgpu.kubelet import Container, KubeletEmulator, Pod
from gpufrac.simgpu.spec import load_preset

NODE = "sim-metrics-node"
GiB, MiB = 1 << 30, 1 << 20
# The node is the dgx-h100 preset as it is: each workload process's CUDA context takes the
# H100 estimate (docs/simgpu.md), and the shim charges it to the process's container.
CTX = load_preset("dgx-h100").gpus[0].context_memory
TIMEOUT = 90.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_get(url: str, timeout: float = 30.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


Labels = dict[str, str]


@dataclass
class Scrape:
    """One parsed exposition: (metric sample name, labels) -> value, plus family types."""

    text: str
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float]
    types: dict[str, str]

    @classmethod
    def parse(cls, text: str) -> Scrape:
        samples, types = {}, {}
        for fam in text_string_to_metric_families(text):
            types[fam.name] = fam.type
            for s in fam.samples:
                samples[(s.name, frozenset(s.labels.items()))] = s.value
        return cls(text, samples, types)

    def get(self, name: str, **labels: str) -> float | None:
        """The one sample of `name` whose labels include `labels` (None if none; error if several)."""
        want = set(labels.items())
        found = [v for (n, ls), v in self.samples.items() if n == name and want <= ls]
        assert len(found) <= 1, f"{name}{labels} matches {len(found)} series"
        return found[0] if found else None

    def series(self, name: str, **labels: str) -> list[Labels]:
        want = set(labels.items())
        return [dict(ls) for (n, ls) in self.samples if n == name and want <= ls]


@dataclass
class InprocNode:
    root: Path
    state: Path
    sim_env: dict[str, str]
    kubelet: KubeletEmulator
    kube: KubeServer
    agent: Agent
    thread: AgentThread
    port: int
    status_socket: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def scrape(self) -> Scrape:
        code, text = http_get(self.url + "/metrics")
        assert code == 200, f"/metrics answered {code}: {text[:500]}"
        return Scrape.parse(text)

    def wait(self, cond: Callable[[], Any], what: str, timeout: float = TIMEOUT) -> Any:
        return until(cond, timeout, what, interval=0.1)

    def wait_scrape(self, cond: Callable[[Scrape], Any], what: str, timeout: float = TIMEOUT) -> Scrape:
        last: list[Scrape] = []

        def check() -> bool:
            s = self.scrape()
            last[:] = [s]
            return bool(cond(s))

        try:
            self.wait(check, what, timeout)
        except AssertionError:
            tail = last[0].text[-3000:] if last else ""
            raise AssertionError(f"timed out waiting for {what}; last scrape tail:\n{tail}") from None
        return last[0]

    def admit(
        self, name: str, resource: str, count: int, annotations: dict[str, str] | None = None, **kw: Any
    ) -> Pod:
        """Create the pod in the apiserver (as the scheduler bound it), then admit it on the kubelet."""
        ann = annotations or {}
        pod = Pod("default", name, [Container("main", {resource: count})], annotations=ann, **kw)
        self.kube.core_v1().create_namespaced_pod(
            "default", pod_manifest(name, node=NODE, uid=pod.uid, annotations=ann, priority=pod.priority)
        )
        self.kubelet.admit(pod)
        return pod

    def alloc_of(self, pod: Pod) -> ContainerAlloc:
        (per,) = self.kubelet.pod_devices(pod.uid).values()
        ((resource, ids),) = per.items()
        key = container_key(resource, ids)

        async def get() -> ContainerAlloc | None:
            assert self.agent.ledger is not None
            return self.agent.ledger.get(key)

        alloc = self.thread.call(get)
        assert alloc is not None, f"the agent holds no allocation {key} for pod {pod.name}"
        return alloc

    def workload(self, pod: Pod, *cmds: object) -> subprocess.Popen[bytes]:
        """mg_ctest in the pod's container: the envs its Allocate response gave (shim, config).
        Unbuffered, so that select() on its stdout sees every line not yet read."""
        env = dict(self.sim_env)
        env.update(self.kubelet.container_env(pod.uid, "main"))
        env.update(self.sim_env)  # the simulated driver: SIMGPU_STATE, LD_LIBRARY_PATH
        return subprocess.Popen(
            [str(build.ctest_path()), *map(str, cmds)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            bufsize=0,
        )


def read_line(p: subprocess.Popen[bytes], timeout: float = TIMEOUT) -> str:
    import selectors

    assert p.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(p.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise AssertionError("workload printed nothing in time")
        return p.stdout.readline().decode()


def result(p: subprocess.Popen[bytes], command: str) -> int:
    """The CUresult mg_ctest printed for `command` (its lines: <command> <CUresult> [k=v ...])."""
    while True:
        line = read_line(p)
        assert line, f"the workload exited before {command}: {p.stderr.read() if p.stderr else b''!r}"
        parts = line.split()
        if parts and parts[0] == command:
            return int(parts[1])


def finish(p: subprocess.Popen[bytes]) -> None:
    if p.poll() is None:
        assert p.stdin is not None
        p.stdin.close()
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(30)


def start_node(
    sim: Any, kube: KubeServer, *, kubelet: bool = True, config: dict[str, Any] | None = None
) -> tuple[InprocNode, Callable[[], None]]:
    # Unix socket paths are limited to 108 bytes: a short directory under /tmp.
    root = short_tmpdir("gfm")
    port = free_port()
    status_socket = root / "status.sock"
    native.library(native.FAKE_CUDA)
    native.library("mg_ctest")
    native.library(native.SHIM)
    overrides: dict[str, Any] = {
        "nodeName": NODE,
        "apiServer": kube.url,
        "statusSocket": str(status_socket),
        "metrics": {"port": port, "bindAddress": "127.0.0.1"},
        "paths": {
            "stateDir": str(root / "state"),
            "kubeletDir": str(root / "kubelet"),
            "shimHostPath": str(native.native_dir() / native.SHIM),
        },
        "health": {"pollInterval": "50ms"},
        **(config or {}),
    }
    cfg = config_mod.load(overrides=overrides)
    emulator = KubeletEmulator(root / "kubelet")
    if kubelet:
        emulator.start()
    agent = Agent(cfg, reconcile_interval=0.5, release_grace=1.0)
    thread = AgentThread(agent).start()
    node = InprocNode(root, sim.path, dict(sim.env), emulator, kube, agent, thread, port, status_socket)

    def stop() -> None:
        thread.stop()
        emulator.stop()
        shutil.rmtree(root, ignore_errors=True)

    return node, stop


@pytest.fixture(name="node")
def node_fixture(in_process_nvml: Any, kube_server: KubeServer) -> Iterator[InprocNode]:
    node, stop = start_node(in_process_nvml, kube_server)
    try:
        node.wait(
            lambda: (
                node.kubelet.connected("gpufrac.dev/gpu-fraction")
                and node.kubelet.connected("gpufrac.dev/gpu-memory")
            ),
            "the agent to register both resources",
        )
        yield node
    finally:
        stop()
