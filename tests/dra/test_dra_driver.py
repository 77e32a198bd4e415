"""The DRA driver against the kubelet's DRA side: registration, prepare and unprepare, restarts.

The real agent (`mode: dra`) on a simulated 4 x L4 node; the kubelet stand-in
(gpufrac.simgpu.kubelet.dra) speaks the kubelet's protos over unix sockets; claims are
allocated by the scheduler stand-in against the slice the agent published (kmock apiserver).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import yaml

from gpufrac.memguard import abi
from tests.fixtures.dra import DRIVER, DraNode, params
from tests.fixtures.kube import KubeServer
from tests.fixtures.polling import until

MakeNode = Callable[..., DraNode]
GiB = 1 << 30


def test_registers_v1_and_publishes_one_shared_device_per_gpu(dra_node: MakeNode) -> None:
    node = dra_node()
    assert node.kubelet.service_of(DRIVER) == "v1.DRAPlugin"
    spec = node.slice()["spec"]  # type: ignore[index]
    assert (spec["driver"], spec["nodeName"], spec["pool"]["name"]) == (DRIVER, "node-a", "node-a")
    devices = spec["devices"]
    assert [d["attributes"]["uuid"]["string"] for d in devices] == node.gpus
    for d in devices:
        assert d["allowMultipleAllocations"] is True
        mem = d["capacity"]["memory"]
        policy = mem["requestPolicy"]
        # The L4's memory less the 1 GiB reserved (the capacity, fixed), in whole 1 GiB units.
        assert int(mem["value"]) == 23079157760
        assert policy["validRange"] == {"min": str(GiB), "max": str(21 * GiB), "step": str(GiB)}
        assert policy["default"] == str(21 * GiB)  # a request naming no amount: the whole GPU
    # The kubelet's health stream names every device, healthy.
    until(lambda: len(node.kubelet.health(DRIVER)) == 4, what="health of the 4 devices")
    assert {h for h, _ in node.kubelet.health(DRIVER).values()} == {1}  # HEALTHY


def test_a_v1beta1_kubelet_gets_the_v1beta1_service(dra_node: MakeNode) -> None:
    node = dra_node(services=("v1beta1.DRAPlugin",))
    assert node.kubelet.service_of(DRIVER) == "v1beta1.DRAPlugin"
    node.create_claim("c", "4Gi")
    node.run("p", ["c"])
    (rec,) = node.kubelet.prepared().values()
    assert rec.cdi_ids == [f"{DRIVER}/claim={rec.uid}"]


def test_prepare_books_the_consumed_capacity_and_writes_the_claims_files(dra_node: MakeNode) -> None:
    node = dra_node()
    # 7.5Gi asked: the scheduler rounds it up to the policy's 1Gi steps, and 8Gi is booked.
    uid = node.create_claim("c", "7680Mi", config=[params(memoryLimit="12Gi", workloadClass="interactive")])
    pod = node.run("p", ["c"])
    entry = node.state_claims()[uid]
    assert entry["config"]["request_bytes"] == 8 * GiB
    assert entry["config"]["limit_bytes"] == 12 * GiB
    assert entry["consumers"] == [[pod.uid, "main"]]
    # The CDI spec injects the GPU, the shim and the claim's directory, whose config the shim reads.
    env, mounts = node.kubelet.container_edits(pod.uid, "main")
    gpu = node.gpus[0]
    assert env["NVIDIA_VISIBLE_DEVICES"] == gpu
    assert env["LD_PRELOAD"] == "/var/run/gpufrac/libmemguard.so"
    by_path = {m.container_path: m for m in mounts}
    config = by_path["/var/run/gpufrac/config"]
    assert config.read_only and not by_path["/var/run/gpufrac/usage"].read_only
    cfg = abi.read_config(os.path.dirname(config.host_path))
    assert (cfg.gpu_uuid, cfg.request_bytes, cfg.limit_bytes) == (gpu, 8 * GiB, 12 * GiB)
    assert cfg.workload_class == abi.CLASS_INTERACTIVE and cfg.pod_uid == pod.uid


def test_every_claim_is_answered_and_prepare_is_idempotent(dra_node: MakeNode) -> None:
    node = dra_node()
    uid = node.create_claim("c", "2Gi")
    node.run("p", ["c"])
    first = node.kubelet.prepared()[uid].cdi_ids
    # The same claim again (a kubelet retry) with one the apiserver never had: both answered.
    resp = node.kubelet.prepare_raw(DRIVER, [("default", "c", uid), ("default", "ghost", "uid-ghost")])
    assert set(resp.claims) == {uid, "uid-ghost"}
    assert list(resp.claims[uid].devices[0].cdi_device_ids) == first and not resp.claims[uid].error
    assert "not found" in resp.claims["uid-ghost"].error and not resp.claims["uid-ghost"].devices
    # Booked once: one entry in the state, 2 GiB of the GPU.
    assert list(node.state_claims()) == [uid]


def test_unprepare_releases_and_an_unknown_claim_succeeds(dra_node: MakeNode) -> None:
    node = dra_node()
    uid = node.create_claim("c", "2Gi")
    pod = node.run("p", ["c"])
    directory = os.path.dirname(node.kubelet.container_edits(pod.uid, "main")[1][1].host_path)
    spec = node.cdi_dir / f"{DRIVER}-claim_{uid}.json"
    assert spec.exists() and os.path.isdir(directory)
    assert node.delete(pod) == {uid: ""}
    assert uid not in node.state_claims()
    assert not spec.exists()
    until(lambda: not os.path.exists(directory), what="the claim's directory deleted")
    # A claim the driver never prepared (the kubelet lost track, or a retry): success, empty error.
    resp = node.kubelet.unprepare_raw(DRIVER, [("default", "never", "uid-never"), ("default", "c", uid)])
    assert set(resp.claims) == {"uid-never", uid}
    assert not resp.claims["uid-never"].error and not resp.claims[uid].error


def test_the_mode_and_the_apiserver_come_from_the_node_config_alone(
    dra_node: MakeNode, kube_server: KubeServer, tmp_path: Path
) -> None:
    # A kubeconfig file and no apiServer URL, as an agent reaches the cluster from outside it.
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "sim", "cluster": {"server": kube_server.url}}],
                "users": [{"name": "u", "user": {}}],
                "contexts": [{"name": "sim", "context": {"cluster": "sim", "user": "u"}}],
                "current-context": "sim",
            }
        )
    )
    node = dra_node(apiServer="", kubeconfig=str(kubeconfig))  # registered, its slice published
    # One mode: the DRA driver's sockets, no device plugin's.
    assert (node.root / "kubelet" / "plugins_registry" / f"{DRIVER}-reg.sock").exists()
    assert (node.root / "kubelet" / "plugins" / DRIVER / "dra.sock").exists()
    assert not list((node.root / "kubelet").glob("device-plugins/gpufrac-*.sock"))
    node.create_claim("c", "1Gi")
    node.run("p", ["c"])  # the claim read through the kubeconfig's server too


def test_a_claim_two_pods_share_is_one_group_prepared_once(dra_node: MakeNode) -> None:
    node = dra_node()
    uid = node.create_claim("shared", "4Gi")
    first = node.run("p1", ["shared"], containers={"a": ["c0"], "b": ["c0"]})
    second = node.run("p2", ["shared"])  # reserved for it too; the kubelet has it prepared already
    assert [m for m, uids in node.kubelet.sent() if uid in uids] == ["NodePrepareResources"]
    # Every container of both pods is the claim's: one booking, one directory, one limit.
    want = [[first.uid, "a"], [first.uid, "b"], [second.uid, "main"]]
    until(lambda: sorted(node.state_claims()[uid]["consumers"]) == sorted(want), what="the claim's consumers")
    dirs = {
        next(
            m.host_path
            for m in node.kubelet.container_edits(p.uid, c)[1]
            if m.container_path.endswith("/usage")
        )
        for p, c in ((first, "a"), (first, "b"), (second, "main"))
    }
    assert len(dirs) == 1
    # Unprepared only once no pod uses it.
    assert node.kubelet.delete_pod(first.uid) == {}
    assert uid in node.state_claims()
    assert node.kubelet.delete_pod(second.uid) == {uid: ""}
    until(lambda: uid not in node.state_claims(), what="the shared claim released")
