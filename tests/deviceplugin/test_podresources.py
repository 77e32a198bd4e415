"""Reading the kubelet's pod-resources List the way the kubelet writes it."""

from __future__ import annotations

import pytest

from gpufrac.core.slices import ContainerDevices
from gpufrac.deviceplugin.podresources import grouped
from gpufrac.proto import podresources_pb2 as pr

pytestmark = pytest.mark.unit

GPU = "GPU-5b1e7c4a-0000-4000-8000-000000000001"
FRACTION = "gpufrac.dev/gpu-fraction"
MEMORY = "gpufrac.dev/gpu-memory"


def _entry(c: pr.ContainerResources, resource: str, dev: str, numa: int | None) -> None:
    d = c.devices.add(resource_name=resource, device_ids=[dev])
    if numa is not None:
        d.topology.nodes.add(ID=numa)


def test_one_entry_per_device_becomes_one_set_per_container_and_resource() -> None:
    """The kubelet lists each allocated device on its own (once per NUMA node it reports),
    never the set Allocate got; the agent keys a container by that whole set."""
    resp = pr.ListPodResourcesResponse()
    pod = resp.pod_resources.add(name="infer", namespace="ml")
    main = pod.containers.add(name="main")
    _entry(main, FRACTION, f"{GPU}::f03", 0)
    _entry(main, "example.com/nic", "nic-1", 0)
    _entry(main, FRACTION, f"{GPU}::f04", 0)
    _entry(main, FRACTION, f"{GPU}::f04", 1)  # a device on two NUMA nodes is listed twice
    _entry(main, MEMORY, f"{GPU}::m007", None)  # no topology: listed once, without it
    side = pod.containers.add(name="side")
    _entry(side, FRACTION, f"{GPU}::f05", 0)
    pod.containers.add(name="cpu-only")

    assert grouped(resp, (FRACTION, MEMORY)) == [
        ContainerDevices("ml", "infer", "main", FRACTION, (f"{GPU}::f03", f"{GPU}::f04")),
        ContainerDevices("ml", "infer", "main", MEMORY, (f"{GPU}::m007",)),
        ContainerDevices("ml", "infer", "side", FRACTION, (f"{GPU}::f05",)),
    ]
    assert ContainerDevices("ml", "infer", "main", "example.com/nic", ("nic-1",)) in grouped(resp, None)
