"""The DRA protos carry the kubelet's wire names: the gRPC paths it dials and the service
names a plugin lists in its registration (dra-and-compute-facts.md, kubelet-contract.md)."""

from __future__ import annotations

import pytest

from gpufrac.proto import dra_health_v1_pb2, dra_v1_pb2, dra_v1beta1_pb2, pluginregistration_pb2

pytestmark = pytest.mark.unit


def methods(module: object, service: str) -> set[str]:
    desc = module.DESCRIPTOR.services_by_name[service]  # type: ignore[attr-defined]
    return {f"/{desc.full_name}/{m.name}" for m in desc.methods}


def test_dra_plugin_paths_are_the_kubelets() -> None:
    for module, version in ((dra_v1_pb2, "v1"), (dra_v1beta1_pb2, "v1beta1")):
        base = f"/k8s.io.kubelet.pkg.apis.dra.{version}.DRAPlugin"
        assert methods(module, "DRAPlugin") == {
            f"{base}/NodePrepareResources",
            f"{base}/NodeUnprepareResources",
        }


def test_health_and_registration_paths_are_the_kubelets() -> None:
    # The health service's package is "v1" upstream: its advertised name is v1.DRAResourceHealth.
    assert methods(dra_health_v1_pb2, "DRAResourceHealth") == {"/v1.DRAResourceHealth/NodeWatchResources"}
    assert methods(pluginregistration_pb2, "Registration") == {
        "/pluginregistration.Registration/GetInfo",
        "/pluginregistration.Registration/NotifyRegistrationStatus",
    }


def test_v1_and_v1beta1_messages_are_the_same_wire_format() -> None:
    # The plugin serves both with one implementation: a message of one parses as the other.
    req = dra_v1_pb2.NodePrepareResourcesRequest(claims=[dra_v1_pb2.Claim(namespace="ns", uid="u", name="c")])
    again = dra_v1beta1_pb2.NodePrepareResourcesRequest.FromString(req.SerializeToString())
    assert (again.claims[0].namespace, again.claims[0].uid, again.claims[0].name) == ("ns", "u", "c")
    resp = dra_v1beta1_pb2.NodePrepareResourcesResponse()
    resp.claims["u"].devices.add(
        pool_name="p", device_name="d", cdi_device_ids=["a/b=c"], request_names=["r"]
    )
    back = dra_v1_pb2.NodePrepareResourcesResponse.FromString(resp.SerializeToString())
    assert list(back.claims["u"].devices[0].cdi_device_ids) == ["a/b=c"]
