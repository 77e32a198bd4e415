"""The agent keeps gpufrac.dev/ labels on its Node current (product, memory, count,
healthy count, sharing mode, driver), read back here with the real kubernetes client
from kmock's apiserver emulator. It touches no other label, and none of NVIDIA's."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest

from gpufrac.agent.gpu import nodelabels
from gpufrac.core import config as config_mod
from gpufrac.core.gpus import Gpu, Inventory
from gpufrac.simgpu import faults
from gpufrac.simgpu.spec import load_preset
from tests.fixtures.kube import KubeServer
from tests.fixtures.metrics import NODE, InprocNode, start_node
from tests.fixtures.polling import until

if TYPE_CHECKING:
    from tests.fixtures.simnode import SimNode

MiB = 1 << 20
# What a cluster put on the node before gpufrac ran: the operator's opt-in label, the
# kubelet's own, and labels an older agent left that no longer apply.
BEFORE = {
    "gpufrac.dev/enabled": "true",
    "kubernetes.io/hostname": NODE,
    "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
    nodelabels.PRODUCT: "Tesla-V100",
    nodelabels.COUNT: "99",
}


def labels(kube: KubeServer) -> dict[str, str]:
    return dict(kube.core_v1().read_node(NODE).metadata.labels or {})


def owned(kube: KubeServer) -> dict[str, str]:
    return {k: v for k, v in labels(kube).items() if k in nodelabels.OWNED}


@pytest.fixture
def make_labelled(
    in_process_nvml: SimNode, kube_server: KubeServer
) -> Iterator[Callable[..., tuple[InprocNode, dict[str, str]]]]:
    stops: list[Callable[[], None]] = []

    def make(config: dict[str, Any] | None = None) -> tuple[InprocNode, dict[str, str]]:
        kube_server.core_v1().create_node({"metadata": {"name": NODE, "labels": dict(BEFORE)}})
        node, stop = start_node(in_process_nvml, kube_server, config=config)
        stops.append(stop)
        return node, labels(kube_server)

    yield make
    for stop in stops:
        stop()


def _expected(preset: str, *, shared: int, healthy: int, sharing: str = "guaranteed") -> dict[str, str]:
    spec = load_preset(preset)
    gpu = spec.gpus[0]
    return {
        nodelabels.PRODUCT: gpu.model.replace(" ", "-"),
        nodelabels.MEMORY_MIB: str(gpu.memory // MiB),
        nodelabels.COUNT: str(shared),
        nodelabels.HEALTHY: str(healthy),
        nodelabels.SHARING: sharing,
        nodelabels.DRIVER: spec.driver_version,
    }


def test_the_agent_labels_its_node_and_follows_gpu_health(
    make_labelled: Callable[..., tuple[InprocNode, dict[str, str]]],
    kube_server: KubeServer,
    in_process_nvml: SimNode,
) -> None:
    node, _ = make_labelled()
    want = _expected("dgx-h100", shared=8, healthy=8)
    until(lambda: owned(kube_server) == want, 60, f"the node's gpufrac labels to be {want}", interval=0.1)
    now = labels(kube_server)
    # Nobody else's labels moved: the operator's, the kubelet's, gpu-feature-discovery's.
    for key in ("gpufrac.dev/enabled", "kubernetes.io/hostname", "nvidia.com/gpu.product"):
        assert now[key] == BEFORE[key]
    assert not [k for k in now if k.startswith("nvidia.com/") and k not in BEFORE]

    # An XID takes GPU 1 out: the healthy count follows; the count of shared GPUs does not.
    faults.inject_xid(in_process_nvml.path, 1, 48)
    want[nodelabels.HEALTHY] = "7"
    until(lambda: owned(kube_server) == want, 60, "gpu.healthy to drop to 7", interval=0.1)
    assert node.agent.node_labels.labeler is not None and node.agent.node_labels.labeler.errors == 0


def test_lending_nodes_say_so(
    make_labelled: Callable[..., tuple[InprocNode, dict[str, str]]], kube_server: KubeServer
) -> None:
    make_labelled({"lendUnusedRequests": True})
    until(
        lambda: owned(kube_server).get(nodelabels.SHARING) == "lending", 60, "sharing=lending", interval=0.1
    )


def test_a_node_object_that_appears_late_is_labelled(
    in_process_nvml: SimNode, kube_server: KubeServer
) -> None:
    node, stop = start_node(in_process_nvml, kube_server, config=None)
    try:
        labeler = node.wait(lambda: node.agent.node_labels.labeler, "the labeler to open")
        node.wait(lambda: labeler.errors >= 1, "a failed first attempt (no Node yet)")
        kube_server.core_v1().create_node({"metadata": {"name": NODE}})
        until(
            lambda: owned(kube_server).get(nodelabels.COUNT) == "8",
            60,
            "the labels after retry",
            interval=0.1,
        )
    finally:
        stop()


@pytest.mark.parametrize(
    ("model", "value"),
    [
        ("NVIDIA H100 80GB HBM3", "NVIDIA-H100-80GB-HBM3"),
        ("NVIDIA A100-SXM4-40GB", "NVIDIA-A100-SXM4-40GB"),
        ("  Tesla (V100) / PCIe ", "Tesla-V100-PCIe"),
        ("x" * 80, "x" * 63),
        ("???", ""),
    ],
)
def test_label_values_are_valid(model: str, value: str) -> None:
    assert nodelabels.label_value(model) == value


def _gpu(i: int, model: str, memory: int) -> Gpu:
    return Gpu(i, f"GPU-{i}", model, memory, f"00000000:{i + 1:02X}:00.0", 0, (), i)


def test_mixed_models_and_no_gpus() -> None:
    cfg = config_mod.Config(node_name="n")
    inv = Inventory(
        gpus=[_gpu(0, "NVIDIA L4", 24 * 1024 * MiB), _gpu(1, "NVIDIA A10", 23 * 1024 * MiB)],
        driver_version="570.124.06",
        mig=[_gpu(2, "NVIDIA H100 80GB HBM3", 80 * 1024 * MiB)],
    )
    got = nodelabels.node_labels(inv, lambda uuid: uuid != "GPU-1", cfg)
    assert got == {
        nodelabels.PRODUCT: "mixed",
        nodelabels.MEMORY_MIB: str(23 * 1024),
        nodelabels.COUNT: "2",
        nodelabels.HEALTHY: "1",
        nodelabels.SHARING: "guaranteed",
        nodelabels.DRIVER: "570.124.06",
    }
    # Nothing shared: no product or memory to claim (the labeler removes them).
    empty = nodelabels.node_labels(Inventory(gpus=[], driver_version="570.124.06"), lambda u: True, cfg)
    assert set(empty) == {nodelabels.COUNT, nodelabels.HEALTHY, nodelabels.SHARING, nodelabels.DRIVER}
    assert empty[nodelabels.COUNT] == "0"


def test_the_labeler_removes_its_stale_labels_and_nothing_else(kube_server: KubeServer) -> None:
    import asyncio

    from gpufrac.agent.kube.nodes import NodeLabeler

    kube_server.core_v1().create_node({"metadata": {"name": NODE, "labels": dict(BEFORE)}})

    async def run() -> NodeLabeler:
        labeler = NodeLabeler(kube_server.api_client(), NODE, nodelabels.OWNED)
        try:
            labeler.update({nodelabels.COUNT: "0", nodelabels.SHARING: "guaranteed"})
            assert await labeler.settled(30)
            with pytest.raises(ValueError, match="not owned"):
                labeler.update({"gpufrac.dev/enabled": "false"})
        finally:
            await labeler.close()
        return labeler

    labeler = asyncio.run(run())
    now = labels(kube_server)
    assert nodelabels.PRODUCT not in now  # the stale Tesla-V100 is gone
    assert now[nodelabels.COUNT] == "0" and now[nodelabels.SHARING] == "guaranteed"
    assert {k: now[k] for k in BEFORE if k not in nodelabels.OWNED} == {
        k: v for k, v in BEFORE.items() if k not in nodelabels.OWNED
    }
    assert labeler.patches == 1
