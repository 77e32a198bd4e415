"""Pod identity through the whole chain: the kubelet emulator admits a pod, the real agent
(a subprocess) allocates, finds the pod via pod-resources and kmock's apiserver emulator
(real kubernetes client), and writes the limit the pod's annotations ask for."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpufrac.core.slices import MEMORY, container_key
from gpufrac.memguard.abi import FLAG_POD_KNOWN, ContainerConfig, FormatError, read_config
from gpufrac.simgpu.kubelet import Container, Pod
from tests.fixtures.agentsim import Sim
from tests.fixtures.kube import KubeServer, pod_manifest

NODE = "sim-node-1"
GiB = 1 << 30


def admit(sim: Sim, kube: KubeServer, name: str, gib: int, annotations: dict[str, str], **kw: Any) -> Path:
    """Create the pod in the apiserver (as the scheduler bound it), then admit it on the kubelet."""
    pod = Pod("default", name, [Container("main", {MEMORY: gib})], annotations=annotations, **kw)
    manifest = pod_manifest(name, node=NODE, uid=pod.uid, annotations=annotations, priority=pod.priority)
    kube.core_v1().create_namespaced_pod("default", manifest)
    devices = sim.kubelet.admit(pod)
    return sim.agent.state_dir / "containers" / container_key(MEMORY, devices["main"][MEMORY])


def config_of(directory: Path) -> ContainerConfig | None:
    try:
        return read_config(directory)
    except FormatError:
        return None


def wait(sim: Sim, cond: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    try:
        sim.kubelet.wait_for(cond, timeout)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}; agent log:\n{sim.agent.log()[-4000:]}") from None


def test_annotated_limit_and_bad_annotation_through_the_kubelet(
    make_sim: Callable[..., Sim], kube_server: KubeServer
) -> None:
    sim = make_sim(config={"nodeName": NODE, "apiServer": kube_server.url})

    good = admit(sim, kube_server, "server", 8, {"gpufrac.dev/gpu-memory-limit": "24Gi"}, priority=500)
    wait(sim, lambda: (c := config_of(good)) is not None and c.limit_bytes == 24 * GiB, "the 24Gi limit")
    cfg = read_config(good)
    assert cfg.request_bytes == 8 * GiB and cfg.priority == 500 and cfg.flags & FLAG_POD_KNOWN
    assert (cfg.namespace, cfg.pod, cfg.container) == ("default", "server", "main")

    bad = admit(sim, kube_server, "trainer", 4, {"gpufrac.dev/gpu-memory-limit": "4 GB please"})

    def warned() -> bool:
        return any(
            e["reason"] == "InvalidAnnotation" and e["involvedObject"]["name"] == "trainer"
            for e in kube_server.events("default")
        )

    wait(sim, warned, "the InvalidAnnotation Event")
    (event,) = [e for e in kube_server.events("default") if e["reason"] == "InvalidAnnotation"]
    assert event["type"] == "Warning"
    assert 'gpufrac.dev/gpu-memory-limit="4 GB please"' in event["message"]
    assert "limit = request (4Gi)" in event["message"]
    cfg = read_config(bad)
    assert cfg.limit_bytes == 4 * GiB and cfg.flags & FLAG_POD_KNOWN  # known pod, safe limit
    # The good pod's limit is untouched by its neighbour's mistake.
    assert read_config(good).limit_bytes == 24 * GiB
