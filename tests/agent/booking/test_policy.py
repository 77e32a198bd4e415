"""Operator policy in the node config: a namespace's pods get no more than its caps allow
(burst limit ratio, non-preemptible, unswappable). A pod asking beyond gets the capped
value in its container's config file (what the shim enforces) and one Warning Event
naming the cap, posted to kmock's apiserver emulator; not one per reconcile."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest

from gpufrac.agent.kube.events import REASON_POLICY_CAPPED
from gpufrac.memguard import abi
from gpufrac.simgpu.kubelet import Container, Pod
from tests.fixtures.kube import KubeServer, pod_manifest
from tests.fixtures.metrics import GiB, InprocNode, start_node

if TYPE_CHECKING:
    from tests.fixtures.simnode import SimNode

MEMORY = "gpufrac.dev/gpu-memory"
POLICY = {
    "default": {"maxLimitRatio": 4},
    "namespaces": {
        "research": {"maxLimitRatio": 2, "allowNonPreemptible": False, "allowUnswappable": False},
        "prod": {"maxLimitRatio": 0},
    },
}


@pytest.fixture
def node(in_process_nvml: SimNode, kube_server: KubeServer) -> Iterator[InprocNode]:
    node, stop = start_node(in_process_nvml, kube_server, config={"policy": POLICY})
    try:
        node.wait(lambda: node.kubelet.connected(MEMORY), "the agent to register")
        yield node
    finally:
        stop()


def admit(node: InprocNode, namespace: str, name: str, gib: int, annotations: dict[str, str]) -> Pod:
    pod = Pod(namespace, name, [Container("main", {MEMORY: gib})], annotations=annotations)
    node.kube.core_v1().create_namespaced_pod(
        namespace,
        pod_manifest(
            name, node=node.agent.config.node_name, namespace=namespace, uid=pod.uid, annotations=annotations
        ),
    )
    node.kubelet.admit(pod)
    return pod


def config_of(node: InprocNode, pod: Pod) -> abi.ContainerConfig:
    return abi.read_config(node.alloc_of(pod).directory)


def capped_events(node: InprocNode, pod: str) -> list[dict[str, Any]]:
    assert node.agent.events is not None
    node.thread.call(lambda: node.agent.events.flush(30))  # type: ignore[union-attr]
    return [
        e
        for e in node.kube.events()
        if e["reason"] == REASON_POLICY_CAPPED and e["involvedObject"]["name"] == pod
    ]


def test_a_pod_asking_beyond_its_namespace_policy_gets_the_capped_values(node: InprocNode) -> None:
    asks = {
        "gpufrac.dev/gpu-memory-limit": "40Gi",
        "gpufrac.dev/preemptible": "false",
        "gpufrac.dev/swappable": "false",
    }
    nb = admit(node, "research", "nb", 8, asks)
    cfg = node.wait(lambda: (c := config_of(node, nb)).flags & abi.FLAG_POD_KNOWN and c, "the pod's policy")
    # 40Gi is 5 x the 8Gi request; research allows 2 x: 16Gi. Preemptible and swappable forced.
    assert cfg.limit_bytes == 16 * GiB and cfg.request_bytes == 8 * GiB
    assert cfg.flags & abi.FLAG_PREEMPTIBLE and cfg.flags & abi.FLAG_SWAPPABLE

    events = capped_events(node, "nb")
    assert len(events) == 3 and all(e["type"] == "Warning" for e in events)
    text = " | ".join(e["message"] for e in events)
    assert "namespace research caps it at maxLimitRatio 2: limit 16Gi applied" in text
    assert "40Gi (gpufrac.dev/gpu-memory-limit) is 5.00 x the request 8Gi" in text
    assert "allowNonPreemptible: false" in text and "allowUnswappable: false" in text

    # A re-apply (the pod's annotations change) does not tell the same caps again.
    node.kube.core_v1().patch_namespaced_pod(
        "nb", "research", {"metadata": {"annotations": {"gpufrac.dev/workload-class": "interactive"}}}
    )
    node.wait(lambda: config_of(node, nb).workload_class == abi.CLASS_NAMES["interactive"], "the re-apply")
    again = capped_events(node, "nb")
    assert len(again) == 3 and all(e.get("count", 1) == 1 for e in again)


def test_pods_within_the_policy_are_untouched(node: InprocNode) -> None:
    # prod: no cap, non-preemptible allowed.
    free = admit(
        node,
        "prod",
        "server",
        8,
        {"gpufrac.dev/gpu-memory-limit": "40Gi", "gpufrac.dev/preemptible": "false"},
    )
    # Any other namespace: policy.default, 4 x: 32Gi is within it.
    fits = admit(node, "batch", "job", 8, {"gpufrac.dev/gpu-memory-limit": "32Gi"})
    over = admit(node, "batch", "greedy", 8, {"gpufrac.dev/gpu-memory-limit": "60Gi"})
    for pod in (free, fits, over):
        node.wait(lambda pod=pod: config_of(node, pod).flags & abi.FLAG_POD_KNOWN, f"{pod.name}'s policy")
    assert config_of(node, free).limit_bytes == 40 * GiB
    assert not config_of(node, free).flags & abi.FLAG_PREEMPTIBLE
    assert config_of(node, fits).limit_bytes == 32 * GiB
    assert config_of(node, over).limit_bytes == 32 * GiB
    assert capped_events(node, "server") == [] and capped_events(node, "job") == []
    (event,) = capped_events(node, "greedy")
    assert (
        "namespace batch (policy.default) caps it at maxLimitRatio 4: limit 32Gi applied" in event["message"]
    )
