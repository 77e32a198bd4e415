"""The ResourceSlice the agent publishes (gpufrac.agent.gpu.dra_devices), as the 1.36 and 1.37 API
validates it: one shared device per GPU, capacity = allocatable in memoryUnit steps, versions as
semver where they read as one, the PCIe root from sysfs, an unhealthy GPU tainted."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest

from gpufrac.agent.gpu import dra_devices
from gpufrac.core import slices
from gpufrac.core.config import Config, GiB
from gpufrac.core.gpus import Gpu, Inventory, Link, PcieLink

pytestmark = pytest.mark.unit


def make_inventory(n: int) -> Inventory:
    """n 17 GiB GPUs on one NUMA node, linked through the system."""
    gpus = [
        Gpu(i, f"GPU-{i:08d}-0000-0000-0000-000000000000", "Sim", 17 * GiB, f"0000:{i:02x}:00.0", 0, (), i)
        for i in range(n)
    ]
    links = {(a, b): Link(0, PcieLink.SYSTEM) for a in range(n) for b in range(n) if a != b}
    return Inventory(gpus=gpus, links=links)


def built(unhealthy: dict[str, str] | None = None) -> dict[str, object]:
    inv = make_inventory(3)
    inv.driver_version, inv.cuda_driver_version = "535.104.05", 12020
    inv.links[(0, 1)] = inv.links[(1, 0)] = Link(12, PcieLink.SYSTEM)
    geo = slices.geometry(Config(), inv)
    return dra_devices.resource_slice(
        inv,
        geo,
        unhealthy or {},
        node="node-a",
        driver="gpufrac.dev",
        generation=3,
        roots={inv.gpus[0].uuid: "pci0000:00"},
    )


@pytest.mark.parametrize("version", ["1.36.0", "1.37.0"])
def test_the_slice_is_valid_for_the_api(version: str) -> None:
    kubernetes_validate.validate(built(), version, strict=True)
    kubernetes_validate.validate(built({make_inventory(3).gpus[2].uuid: "XID 79"}), version, strict=True)


def test_devices_capacity_and_attributes() -> None:
    spec = built({make_inventory(3).gpus[2].uuid: "XID 79"})["spec"]
    assert isinstance(spec, dict)
    d0, d1, d2 = spec["devices"]
    assert [d["name"] for d in (d0, d1, d2)] == ["gpu-0", "gpu-1", "gpu-2"]
    mem = d0["capacity"]["memory"]
    # 17 GiB GPUs, 1 GiB reserved: capacity 16 GiB, shared in 1 GiB units, whole by default.
    assert mem == {
        "value": str(16 * GiB),
        "requestPolicy": {
            "default": str(16 * GiB),
            "validRange": {"min": str(GiB), "max": str(16 * GiB), "step": str(GiB)},
        },
    }
    attrs = d0["attributes"]
    assert attrs["driverVersion"] == {"version": "535.104.5"}  # no leading zero in semver
    assert attrs["cudaDriverVersion"] == {"version": "12.2.0"}
    assert attrs["resource.kubernetes.io/pcieRoot"] == {"string": "pci0000:00"}
    assert attrs["nvlinkPeers"] == {"string": "1"} and "nvlinkPeers" not in d2["attributes"]
    assert "resource.kubernetes.io/pcieRoot" not in d1["attributes"]  # no sysfs for it: left out
    assert d2["taints"] == [{"key": "gpufrac.dev/unhealthy", "effect": "NoSchedule"}]
    assert "taints" not in d0 and all(d["allowMultipleAllocations"] for d in (d0, d1, d2))


def test_pcie_root_is_read_from_sysfs(tmp_path: Path) -> None:
    devices = tmp_path / "bus" / "pci" / "devices"
    real = tmp_path / "devices" / "pci0000:17" / "0000:17:01.0" / "0000:18:00.0"
    real.mkdir(parents=True)
    devices.mkdir(parents=True)
    (devices / "0000:18:00.0").symlink_to(real)
    assert dra_devices.pcie_root("00000000:18:00.0", str(devices)) == "pci0000:17"
    assert dra_devices.pcie_root("00000000:19:00.0", str(devices)) is None
