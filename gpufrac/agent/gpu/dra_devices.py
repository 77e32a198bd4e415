"""The node's GPUs as the DRA driver publishes them: one ResourceSlice (resource.k8s.io/v1).

One device per shareable GPU (a GPU in MIG mode is not in the inventory's `gpus`: left to the
MIG-aware driver), named gpu-<NVML index>, with:

* attributes: uuid, productName, index, computeCapability, driverVersion, cudaDriverVersion
  (versions where they read as semver), numaNode, the standard
  resource.kubernetes.io/pcieRoot (from sysfs, when the node has it) and nvlinkPeers (the
  NVML indices of the GPUs it has NVLinks to, comma-separated: an attribute holds one value);
* allowMultipleAllocations: true, so many claims share it (KEP-5075 consumable capacity);
* capacity memory = the GPU's allocatable memory (total - reservedPerGpu), a fixed total: the
  scheduler subtracts what claims consume, so the slice never changes as the agent books;
  requestPolicy in memoryUnit steps from one unit to the largest whole number of units, with
  that largest as the default, so a request that names no amount takes the whole GPU;
* an unhealthy GPU carries the taint gpufrac.dev/unhealthy (NoSchedule): no new claim gets
  it; claims already prepared keep running (the health service says why, gpufrac.dev).

Pure: the inventory, the geometry and health in, a dict out (gpufrac.agent.kube.resourceslices
publishes it).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

from gpufrac.core.claims import MEMORY_CAPACITY
from gpufrac.core.gpus import Gpu, Inventory
from gpufrac.core.slices import GpuGeometry

API_VERSION = "resource.k8s.io/v1"
PCIE_ROOT = "resource.kubernetes.io/pcieRoot"
UNHEALTHY_TAINT = "unhealthy"  # under the driver's domain: gpufrac.dev/unhealthy
_SEMVER = re.compile(r"^\d+\.\d+\.\d+$")
MAX_DEVICES = 128  # a ResourceSlice holds at most this many devices (resource.k8s.io/v1)


def device_name(gpu: Gpu) -> str:
    """A GPU's device name in the slice (a DNS label)."""
    return f"gpu-{gpu.index}"


def slice_name(node: str, driver: str) -> str:
    """The node's one ResourceSlice of this driver (a DNS subdomain, as node names are)."""
    return f"{node}-{driver}"[:253].rstrip("-.")


def _version(text: str) -> dict[str, str]:
    """A version attribute where the text is semver (the API's rule), else a string one.
    NVIDIA driver versions have two or three parts ("535.104.05", "550.54"): a missing
    patch reads as 0; a leading zero (".05") is not semver and is dropped."""
    parts = text.strip().split(".")
    if 2 <= len(parts) <= 3 and all(p.isdigit() for p in parts):
        v = ".".join(str(int(p)) for p in [*parts, "0"][:3])
        if _SEMVER.match(v):
            return {"version": v}
    return {"string": text[:64]}


def _cuda_version(code: int) -> dict[str, str]:
    """NVML's CUDA driver version (12040) as a version attribute (12.4.0)."""
    return {"version": f"{code // 1000}.{code % 1000 // 10}.0"}


def pcie_root(bus_id: str, sys_bus_pci: str = "/sys/bus/pci/devices") -> str | None:
    """The PCIe root complex of a device (pci<domain>:<bus>), as the kubelet's DRA helpers
    name it: the first component of its sysfs path. None without sysfs (simgpu)."""
    bdf = bus_id.lower()
    if len(bdf.split(":")[0]) == 8:  # NVML's 8-digit domain; sysfs uses 4
        bdf = bdf[4:]
    try:
        real = os.path.realpath(os.path.join(sys_bus_pci, bdf), strict=True)
    except OSError:
        return None
    for part in real.split(os.sep):
        if part.startswith("pci") and ":" in part:
            return part
    return None


def device(
    gpu: Gpu,
    geo: GpuGeometry,
    inventory: Inventory,
    *,
    driver: str,
    unhealthy: str | None,
    root: str | None = None,
) -> dict[str, Any]:
    """One GPU as a ResourceSlice device."""
    attrs: dict[str, dict[str, Any]] = {
        "uuid": {"string": gpu.uuid},
        "productName": {"string": gpu.model[:64]},
        "index": {"int": gpu.index},
    }
    if gpu.compute_capability:
        attrs["computeCapability"] = _version(gpu.compute_capability)
    if inventory.driver_version:
        attrs["driverVersion"] = _version(inventory.driver_version)
    if inventory.cuda_driver_version:
        attrs["cudaDriverVersion"] = _cuda_version(inventory.cuda_driver_version)
    if gpu.numa_node is not None and gpu.numa_node >= 0:
        attrs["numaNode"] = {"int": gpu.numa_node}
    if root:
        attrs[PCIE_ROOT] = {"string": root}
    peers = sorted(
        other.index
        for other in inventory.gpus
        if other.index != gpu.index and inventory.link(gpu.index, other.index).nvlinks > 0
    )
    if peers:
        attrs["nvlinkPeers"] = {"string": ",".join(map(str, peers))[:64]}
    unit = geo.memory_unit
    most = geo.memory_slices * unit
    dev: dict[str, Any] = {
        "name": device_name(gpu),
        "allowMultipleAllocations": True,
        "attributes": attrs,
        "capacity": {
            MEMORY_CAPACITY: {
                "value": str(geo.allocatable),
                "requestPolicy": {
                    "default": str(most),
                    "validRange": {"min": str(unit), "max": str(most), "step": str(unit)},
                },
            }
        },
    }
    if unhealthy is not None:
        dev["taints"] = [{"key": f"{driver}/{UNHEALTHY_TAINT}", "effect": "NoSchedule"}]
    return dev


def resource_slice(
    inventory: Inventory,
    geometry: Mapping[str, GpuGeometry],
    unhealthy: Mapping[str, str],
    *,
    node: str,
    driver: str,
    generation: int,
    roots: Mapping[str, str | None] | None = None,
) -> dict[str, Any]:
    """The node's ResourceSlice: every GPU of the inventory that can hold a share of one
    memory unit (`unhealthy`: GPU UUID -> reason; `roots`: GPU UUID -> PCIe root)."""
    devices = [
        device(
            g,
            geometry[g.uuid],
            inventory,
            driver=driver,
            unhealthy=unhealthy.get(g.uuid),
            root=(roots or {}).get(g.uuid),
        )
        for g in inventory.gpus
        if g.uuid in geometry and geometry[g.uuid].memory_slices > 0
    ][:MAX_DEVICES]
    return {
        "apiVersion": API_VERSION,
        "kind": "ResourceSlice",
        "metadata": {"name": slice_name(node, driver)},
        "spec": {
            "driver": driver,
            "nodeName": node,
            "pool": {"name": node, "generation": generation, "resourceSliceCount": 1},
            "devices": devices,
        },
    }
