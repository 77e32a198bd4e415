"""The pure parts of the inventory and its reports: CPU lists, PCI addresses, the
NVLink pair rule, and the gpus/topo renderings of a given inventory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpufrac.agent.cli.gpus import (
    cpu_list,
    cuda_version,
    format_gpus,
    format_topo,
    gpus_to_dict,
    link_label,
    topo_to_dict,
)
from gpufrac.agent.gpu import inventory
from gpufrac.core.gpus import Gpu, GpuHealth, Inventory, Link, PcieLink

pytestmark = pytest.mark.unit

GiB = 1 << 30


@given(st.sets(st.integers(min_value=0, max_value=4095)))
def test_cpu_list_round_trips(cpus: set[int]) -> None:
    text = cpu_list(cpus)
    assert inventory.parse_cpu_list(text) == tuple(sorted(cpus))
    assert " " not in text


def test_cpu_list_uses_ranges() -> None:
    assert cpu_list([*range(0, 56), *range(112, 168)]) == "0-55,112-167"
    assert cpu_list([3, 1, 2, 7]) == "1-3,7"
    assert cpu_list([]) == ""


def test_affinity_mask_words_become_cpu_numbers() -> None:
    assert inventory._mask_to_cpus([0b101, 1 << 63, 1]) == (0, 2, 127, 128)


def test_nvml_and_sysfs_bus_ids_compare_equal() -> None:
    assert (
        inventory.parse_bus_id("00000000:1A:00.0")
        == inventory.parse_bus_id("0000:1a:00.0")
        == (0, 0x1A, 0, 0)
    )
    assert inventory.sysfs_pci_dir("00000001:B2:03.1").name == "0001:b2:03.1"


@pytest.mark.parametrize("bad", ["", "1A:00", "0000:zz:00.0", "0000:1a:00"])
def test_bad_bus_id_is_named_in_the_error(bad: str) -> None:
    with pytest.raises(ValueError, match="is not a PCI bus id"):
        inventory.parse_bus_id(bad)


def test_sysfs_is_trusted_only_for_the_same_nvidia_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(inventory, "SYSFS_PCI", tmp_path)
    d = tmp_path / "0000:18:00.0"
    d.mkdir()
    (d / "vendor").write_text("0x10de\n")
    (d / "device").write_text("0x2330\n")
    assert inventory._sysfs_device("00000000:18:00.0", 0x233010DE) == d
    # Another device at that address (a simulated GPU's bus id on a real host): not used.
    assert inventory._sysfs_device("00000000:18:00.0", 0x27B810DE) is None
    (d / "vendor").write_text("0x8086\n")
    assert inventory._sysfs_device("00000000:18:00.0", 0x233010DE) is None
    assert inventory._sysfs_device("00000000:19:00.0", 0x233010DE) is None


def test_nvlink_pairs_direct_and_through_nvswitch() -> None:
    peers = {0: {1: 12}, 1: {0: 12}, 2: {-1: 18}, 3: {-1: 12}, 4: {1: 2}}
    assert inventory._pair_nvlinks(peers, 0, 1) == 12
    assert inventory._pair_nvlinks(peers, 2, 3) == 12  # the less-connected GPU bounds the pair
    assert inventory._pair_nvlinks(peers, 0, 2) == 0
    assert inventory._pair_nvlinks(peers, 1, 4) == 0  # a link one end does not report is not counted


def _inventory() -> Inventory:
    gpus = [
        Gpu(0, "GPU-aaaa", "NVIDIA A100-SXM4-40GB", 40 * GiB, "00000000:07:00.0", 0, tuple(range(0, 4)), 0),
        Gpu(1, "GPU-bbbb", "NVIDIA A100-SXM4-40GB", 40 * GiB, "00000000:0F:00.0", 0, tuple(range(0, 4)), 1),
        Gpu(3, "GPU-dddd", "NVIDIA A100-SXM4-40GB", 40 * GiB, "00000000:8A:00.0", None, (), 3),
    ]
    links = {}
    for (a, b), link in {
        (0, 1): Link(12, PcieLink.SWITCH),
        (0, 3): Link(0, PcieLink.SYSTEM),
        (1, 3): Link(0, PcieLink.SYSTEM),
    }.items():
        links[(a, b)] = links[(b, a)] = link
    return Inventory(gpus, links, "570.124.06", 12080, unreachable={2: "reading GPU 2: GPU is lost"})


def test_link_labels() -> None:
    assert link_label(Link(18, PcieLink.NUMA)) == "NV18"
    assert link_label(Link(0, PcieLink.BOARD)) == "PIX"
    assert link_label(Link(0, PcieLink.SELF)) == "X"
    assert cuda_version(12080) == "12.8" and cuda_version(13000) == "13.0"


def test_topo_text() -> None:
    lines = format_topo(_inventory()).splitlines()
    assert lines[0].split()[:3] == ["GPU0", "GPU1", "GPU3"]
    assert lines[1].split() == ["GPU0", "X", "NV12", "SYS", "0-3", "0"]
    assert lines[2].split() == ["GPU1", "NV12", "X", "SYS", "0-3", "0"]
    assert lines[3].split() == ["GPU3", "SYS", "SYS", "X", "N/A", "N/A"]
    assert lines[4] == "GPU2: unreachable (reading GPU 2: GPU is lost)"
    assert "Legend:" in lines


def test_topo_json_lists_each_pair_once() -> None:
    doc = json.loads(json.dumps(topo_to_dict(_inventory())))
    assert [(x["a"], x["b"], x["label"]) for x in doc["links"]] == [
        (0, 1, "NV12"),
        (0, 3, "SYS"),
        (1, 3, "SYS"),
    ]
    assert doc["matrix"][2] == ["SYS", "SYS", "X"]
    assert doc["gpus"][0]["cpu_affinity_list"] == "0-3"


def test_gpus_text_and_json_carry_usage_and_health() -> None:
    inv = _inventory()
    used = {"GPU-aaaa": 10 * GiB}
    health = {
        "GPU-aaaa": GpuHealth(True),
        "GPU-bbbb": GpuHealth(False, "XID 79 at 2026-01-01T00:00:00Z"),
    }
    text = format_gpus(inv, used, health)
    rows = {line.split()[0]: line for line in text.splitlines()[3:]}
    assert "10.0GiB" in rows["0"] and rows["0"].endswith("Healthy")
    assert rows["1"].endswith("Unhealthy: XID 79 at 2026-01-01T00:00:00Z")
    assert rows["3"].split()[-1] == "?"  # no health known
    assert "Unhealthy: reading GPU 2: GPU is lost" in rows["2"]
    assert text.splitlines()[0] == "Driver 570.124.06  CUDA 12.8  4 GPUs"

    doc = gpus_to_dict(inv, used, health)
    assert [g["memory_used"] for g in doc["gpus"]] == [10 * GiB, None, None]
    assert [g["healthy"] for g in doc["gpus"]] == [True, False, None]
    assert doc["unreachable"] == [{"index": 2, "reason": "reading GPU 2: GPU is lost"}]
