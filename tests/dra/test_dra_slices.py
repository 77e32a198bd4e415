"""The node's ResourceSlice in DRA mode: MIG GPUs left out, NVLink peers named, an unhealthy GPU
tainted (and reported through the health service) and untainted on recovery, a claim that
names no amount holding its GPU whole."""

from __future__ import annotations

import os
from collections.abc import Callable

import kubernetes_validate
import pytest

from gpufrac.memguard import abi
from gpufrac.simgpu import faults
from tests.fixtures.dra import DRIVER, WHOLE_CLASS, DraNode, params
from tests.fixtures.polling import until

MakeNode = Callable[..., DraNode]
GiB = 1 << 30
TAINT = {"key": f"{DRIVER}/unhealthy", "effect": "NoSchedule"}


def devices(node: DraNode) -> dict[str, dict[str, object]]:
    s = node.slice()
    return {} if s is None else {d["name"]: d for d in s["spec"]["devices"]}


def test_mig_gpus_are_left_out_and_nvlink_peers_are_named(dra_node: MakeNode) -> None:
    node = dra_node("h100x4-mig")  # GPUs 2 and 3 are in MIG mode
    published = devices(node)
    assert sorted(published) == ["gpu-0", "gpu-1"]
    attrs = published["gpu-0"]["attributes"]
    assert attrs["nvlinkPeers"] == {"string": "1"}  # the MIG GPUs are no peers of a share
    assert attrs["computeCapability"] == {"version": "9.0.0"} and attrs["productName"]["string"].startswith(
        "NVIDIA H100"
    )
    # What the agent publishes is a valid resource.k8s.io/v1 ResourceSlice for 1.36 and 1.37.
    for version in ("1.36.0", "1.37.0"):
        kubernetes_validate.validate(node.slice(), version, strict=True)


@pytest.mark.slow  # the XID recovery window
def test_an_unhealthy_gpu_is_tainted_and_untainted_when_it_recovers(dra_node: MakeNode) -> None:
    node = dra_node(health={"pollInterval": "50ms", "xidRecovery": "3s"})
    faults.inject_xid(node.node_state, 1, 79)
    until(lambda: devices(node)["gpu-1"].get("taints") == [TAINT], what="gpu-1 tainted")
    assert all("taints" not in d for name, d in devices(node).items() if name != "gpu-1")
    # The kubelet hears it through the health stream, with the reason.
    health = until(
        lambda: (h := node.kubelet.health(DRIVER).get(("node-a", "gpu-1"))) and h[0] == 2 and h,
        what="UNHEALTHY",
    )
    assert "XID 79" in health[1]
    # The scheduler places no new claim on it; after xidRecovery without an XID it comes back.
    node.create_claim("c", "20Gi")
    status = node.allocator.allocate("default", "c", node="node-a")
    assert status["allocation"]["devices"]["results"][0]["device"] == "gpu-0"
    until(lambda: "taints" not in devices(node)["gpu-1"], what="gpu-1 untainted after xidRecovery")
    until(lambda: node.kubelet.health(DRIVER)[("node-a", "gpu-1")][0] == 1, what="HEALTHY again")


def test_a_claim_naming_no_amount_takes_the_whole_gpu(dra_node: MakeNode) -> None:
    node = dra_node()
    uid = node.create_claim("whole", None, cls=WHOLE_CLASS, config=[params(memoryLimit="4Gi")])
    pod = node.run("p", ["whole"])
    # The scheduler consumed the policy's default, all 21 units of gpu-0: exclusive.
    (result,) = node.read_claim("whole")["status"]["allocation"]["devices"]["results"]
    assert result["consumedCapacity"] == {"memory": "21Gi"}
    entry = node.state_claims()[uid]
    assert entry["resource"] == "gpufrac.dev/gpu-fraction" and len(entry["device_ids"]) == 100
    cfg = abi.read_config(os.path.dirname(node.kubelet.container_edits(pod.uid, "main")[1][1].host_path))
    assert cfg.flags & abi.FLAG_WHOLE_GPU and cfg.limit_bytes == cfg.request_bytes  # no limit of its own
    # Nothing more fits on gpu-0: the next claim, even 1Gi, goes elsewhere.
    node.create_claim("small", "1Gi")
    assert (
        node.allocator.allocate("default", "small", node="node-a")["allocation"]["devices"]["results"][0][
            "device"
        ]
        == "gpu-1"
    )
