"""The scheduler stand-in (gpufrac.simgpu.dra_scheduler) plays KEP-5075's consumable-capacity
rules: requests rounded up to the requestPolicy, the default consumed when no amount is named,
the sum never past the capacity, a shareID per share, exclusive devices, taints."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest
from kubernetes import client

from gpufrac.simgpu.apiserver import RESOURCE_CLAIMS
from gpufrac.simgpu.dra_scheduler import AllocationFailed, Allocator, consumed
from tests.fixtures.kube import KubeServer

GiB = 1 << 30
POLICY = {"default": "20Gi", "validRange": {"min": "1Gi", "max": "20Gi", "step": "1Gi"}}


def test_consumed_follows_the_request_policy() -> None:
    cap = {"value": "21Gi", "requestPolicy": POLICY}
    assert consumed(cap, int(7.5 * GiB)) == 8 * GiB  # rounded up to the step
    assert consumed(cap, 100) == 1 * GiB  # at least min
    assert consumed(cap, None) == 20 * GiB  # no amount: the default
    assert consumed(cap, 21 * GiB) is None  # above max: not from this device
    odd = {"value": "10Gi", "requestPolicy": {"default": "2Gi", "validRange": {"min": "2Gi", "step": "3Gi"}}}
    assert consumed(odd, 3 * GiB) == 5 * GiB  # min + k * step
    values = {"value": "16Gi", "requestPolicy": {"default": "8Gi", "validValues": ["4Gi", "8Gi", "16Gi"]}}
    assert consumed(values, 5 * GiB) == 8 * GiB and consumed(values, 17 * GiB) is None
    assert consumed({"value": "16Gi"}, None) == 16 * GiB  # no policy: the whole value
    assert consumed({"value": "16Gi"}, 3 * GiB) == 3 * GiB


def device(
    name: str, *, shared: bool = True, taints: list[dict[str, Any]] | None = None, value: str = "21Gi"
) -> dict[str, Any]:
    d: dict[str, Any] = {"name": name, "capacity": {"memory": {"value": value, "requestPolicy": POLICY}}}
    if shared:
        d["allowMultipleAllocations"] = True
    if taints:
        d["taints"] = taints
    return d


def setup(kube: KubeServer, devices: list[dict[str, Any]]) -> tuple[client.ResourceV1Api, Allocator]:
    api = client.ResourceV1Api(kube.api_client())
    api.create_device_class(
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "DeviceClass",
            "metadata": {"name": "gpu"},
            "spec": {
                "selectors": [{"cel": {"expression": 'device.driver == "gpufrac.dev"'}}],
                "config": [{"opaque": {"driver": "gpufrac.dev", "parameters": {"from": "class"}}}],
            },
        }
    )
    api.create_resource_slice(
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {"name": "n-gpufrac.dev"},
            "spec": {
                "driver": "gpufrac.dev",
                "nodeName": "n",
                "pool": {"name": "n", "generation": 1, "resourceSliceCount": 1},
                "devices": devices,
            },
        }
    )
    return api, Allocator(kube.api_client())


def claim(api: client.ResourceV1Api, name: str, memory: str | None, **exact: Any) -> None:
    req: dict[str, Any] = {"deviceClassName": "gpu", **exact}
    if memory:
        req["capacity"] = {"requests": {"memory": memory}}
    api.create_namespaced_resource_claim(
        "default",
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name},
            "spec": {
                "devices": {
                    "requests": [{"name": "gpu", "exactly": req}],
                    "config": [{"opaque": {"driver": "gpufrac.dev", "parameters": {"from": "claim"}}}],
                }
            },
        },
        _preload_content=False,
    )


def results(status: dict[str, Any]) -> list[dict[str, Any]]:
    return list(status["allocation"]["devices"]["results"])


def test_shares_are_rounded_summed_within_capacity_and_get_share_ids(kube_server: KubeServer) -> None:
    api, alloc = setup(kube_server, [device("gpu-0"), device("gpu-1")])
    claim(api, "a", "7680Mi")
    claim(api, "b", "13Gi")
    claim(api, "c", "1Gi")
    a = results(alloc.allocate("default", "a", node="n", pod=("pa", "uid-a")))
    b = results(alloc.allocate("default", "b", node="n"))
    c = results(alloc.allocate("default", "c", node="n"))
    # 8 + 13 = 21 of gpu-0's 21: full; the third goes to gpu-1.
    assert [(r["device"], r["consumedCapacity"]["memory"]) for r in a + b + c] == [
        ("gpu-0", "8Gi"),
        ("gpu-0", "13Gi"),
        ("gpu-1", "1Gi"),
    ]
    assert len({r["shareID"] for r in a + b + c}) == 3
    stored = kube_server.objects(RESOURCE_CLAIMS)
    by_name = {o["metadata"]["name"]: o for o in stored}
    status = by_name["a"]["status"]
    assert status["reservedFor"] == [{"resource": "pods", "name": "pa", "uid": "uid-a"}]
    # What it writes is a valid allocated claim for the API (1.36 and 1.37).
    for o in stored:
        for version in ("1.36.0", "1.37.0"):
            kubernetes_validate.validate(o, version, strict=True)
    # The class's config first, then the claim's, as the scheduler copies them.
    assert [
        (c["source"], c["opaque"]["parameters"]["from"]) for c in status["allocation"]["devices"]["config"]
    ] == [
        ("FromClass", "class"),
        ("FromClaim", "claim"),
    ]


def test_no_amount_consumes_the_default_and_nothing_fits_past_it(kube_server: KubeServer) -> None:
    # As the agent publishes a GPU: its memory, not a whole number of units, and the default the
    # largest whole number of them (20.5 GiB here: 20 units).
    api, alloc = setup(kube_server, [device("gpu-0", value="20992Mi")])
    claim(api, "whole", None)
    claim(api, "more", "1Gi")
    assert results(alloc.allocate("default", "whole", node="n"))[0]["consumedCapacity"] == {"memory": "20Gi"}
    with pytest.raises(AllocationFailed, match="memory does not fit"):
        alloc.allocate("default", "more", node="n")


def test_an_exclusive_device_and_a_tainted_one(kube_server: KubeServer) -> None:
    taint = {"key": "gpufrac.dev/unhealthy", "effect": "NoSchedule"}
    api, alloc = setup(kube_server, [device("gpu-0", taints=[taint]), device("gpu-1", shared=False)])
    claim(api, "a", "1Gi")
    claim(api, "b", "1Gi")
    claim(api, "tolerant", "1Gi", tolerations=[{"key": "gpufrac.dev/unhealthy", "operator": "Exists"}])
    first = results(alloc.allocate("default", "a", node="n"))[0]
    assert first["device"] == "gpu-1" and "consumedCapacity" not in first  # whole: no share
    with pytest.raises(AllocationFailed, match="gpu-0: tainted; gpu-1: allocated whole"):
        alloc.allocate("default", "b", node="n")
    assert results(alloc.allocate("default", "tolerant", node="n"))[0]["device"] == "gpu-0"
