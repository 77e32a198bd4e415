"""Node specs: the presets describe the real machines, spec files are validated
with errors naming the key and value, and create_node writes the state file."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gpufrac.simgpu import nodestate as ns
from gpufrac.simgpu.spec import (
    NVLINK_NVSWITCH,
    TOPO_LEVEL_NAMES,
    NodeSpec,
    SpecError,
    create_node,
    load_preset,
    load_spec,
    preset_names,
)

MiB = 1 << 20


def levels(spec: NodeSpec) -> list[list[str]]:
    return [[TOPO_LEVEL_NAMES[v] for v in row] for row in spec.topology]


def test_presets_are_listed() -> None:
    assert {"dgx-h100", "pcie-l4x4", "a100x2-nvlink"} <= set(preset_names())


def test_dgx_h100() -> None:
    s = load_preset("dgx-h100")
    assert len(s.gpus) == 8
    assert {g.model for g in s.gpus} == {"NVIDIA H100 80GB HBM3"}
    assert all(g.memory == 81559 * MiB for g in s.gpus)
    assert [g.numa_node for g in s.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert all(g.nvlink_peers == (NVLINK_NVSWITCH,) * 18 for g in s.gpus)
    # NVSwitch: every pair of GPUs talks over all 18 links.
    assert all(s.nvlinks(a, b) == 18 for a in range(8) for b in range(8) if a != b)
    lv = levels(s)
    assert lv[0] == ["X", "NODE", "NODE", "NODE", "SYS", "SYS", "SYS", "SYS"]
    assert lv[5] == ["SYS", "SYS", "SYS", "SYS", "NODE", "X", "NODE", "NODE"]
    assert len(s.gpus[0].cpu_affinity) == 112 and 0 in s.gpus[0].cpu_affinity and 56 in s.gpus[4].cpu_affinity
    assert not set(s.gpus[0].cpu_affinity) & set(s.gpus[7].cpu_affinity)


def test_pcie_l4x4() -> None:
    s = load_preset("pcie-l4x4")
    assert [g.model for g in s.gpus] == ["NVIDIA L4"] * 4
    assert all(g.memory == 23034 * MiB and g.nvlink_peers == () for g in s.gpus)
    assert [g.numa_node for g in s.gpus] == [0, 0, 1, 1]
    assert levels(s) == [
        ["X", "PIX", "SYS", "SYS"],
        ["PIX", "X", "SYS", "SYS"],
        ["SYS", "SYS", "X", "PIX"],
        ["SYS", "SYS", "PIX", "X"],
    ]
    assert all(s.nvlinks(a, b) == 0 for a in range(4) for b in range(4))


def test_a100x2_nvlink() -> None:
    s = load_preset("a100x2-nvlink")
    assert [g.model for g in s.gpus] == ["NVIDIA A100-SXM4-40GB"] * 2
    assert all(g.memory == 40960 * MiB for g in s.gpus)
    assert s.gpus[0].nvlink_peers == (1,) * 12 and s.gpus[1].nvlink_peers == (0,) * 12
    assert s.nvlinks(0, 1) == s.nvlinks(1, 0) == 12
    assert levels(s) == [["X", "PXB"], ["PXB", "X"]]


@pytest.mark.parametrize("preset", ["dgx-h100", "pcie-l4x4", "a100x2-nvlink"])
def test_uuids_and_bus_ids_are_deterministic_and_unique(preset: str) -> None:
    a, b = load_preset(preset), load_preset(preset)
    uuids = [a.gpu_uuid(i) for i in range(len(a.gpus))]
    assert uuids == [b.gpu_uuid(i) for i in range(len(b.gpus))]
    assert len(set(uuids)) == len(uuids)
    assert all(u.startswith("GPU-") and len(u) == 40 for u in uuids)
    other = load_preset(preset, node_name="another-node")
    assert not set(uuids) & {other.gpu_uuid(i) for i in range(len(other.gpus))}
    bus = [g.pci_bus_id for g in a.gpus]
    assert len(set(bus)) == len(bus) and all(len(x) == 16 for x in bus)


def test_spec_file_preset_with_overrides(tmp_path: Path) -> None:
    f = tmp_path / "node.yaml"
    f.write_text("preset: pcie-l4x4\nnode_name: w3\ngpu_defaults: {memory: 16Gi, reserved: 0}\n")
    s = load_spec(f)
    assert s.node_name == "w3"
    assert all(g.memory == 16 << 30 and g.reserved == 0 for g in s.gpus)
    assert [g.numa_node for g in s.gpus] == [0, 0, 1, 1]  # the rest stays the preset's


def test_spec_file_full_gpu_list_json(tmp_path: Path) -> None:
    f = tmp_path / "node.json"
    doc = {
        "node_name": "tiny",
        "driver_version": "550.54.15",
        "cuda_driver_version": 12040,
        "checkpoint_supported": False,
        "gpus": [
            {
                "model": "NVIDIA T4",
                "memory": "15360Mi",
                "numa_node": 0,
                "cpu_affinity": [0, 1, 2],
                "nvlinks": {"1": 2},
            },
            {"model": "NVIDIA T4", "memory": "15360Mi", "pci_bus_id": "0000:3b:00.0", "nvlinks": {"0": 2}},
        ],
        "topology": [["X", "PHB"], ["PHB", "X"]],
    }
    f.write_text(json.dumps(doc))
    s = load_spec(f)
    assert s.nvml_version == "12.550.54.15" and not s.checkpoint_supported
    assert s.gpus[1].pci_bus_id == "00000000:3B:00.0"  # normalised to NVML's format
    assert s.gpus[0].cpu_affinity == (0, 1, 2) and s.gpus[1].numa_node is None
    assert s.nvlinks(0, 1) == 2 and levels(s)[0][1] == "PHB"


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("preset: nope\n", ["preset", "'nope'"]),
        ("preset: dgx-h100\ncolour: red\n", ["colour", "unknown key"]),
        ("preset: dgx-h100\ngpu_defaults: {memory: 80Q}\n", ["memory", "'80Q'"]),
        ("preset: dgx-h100\ngpu_defaults: {reserved: 90Gi}\n", ["reserved", "'90Gi'"]),
        ("preset: dgx-h100\ngpu_defaults: {nvswitch_links: 19}\n", ["nvlinks", "19 links"]),
        ("preset: dgx-h100\ncuda_driver_version: twelve\n", ["cuda_driver_version", "'twelve'"]),
        ("preset: dgx-h100\ncheckpoint_supported: maybe\n", ["checkpoint_supported", "'maybe'"]),
        ("gpus: []\n", ["gpus", "non-empty"]),
        ("gpus: [{model: X}]\n", ["gpus[0].memory", "missing"]),
        ("gpus: [{model: X, memory: 1Gi, pci_bus_id: '18:00'}]\n", ["gpus[0].pci_bus_id", "'18:00'"]),
        ("gpus: [{model: X, memory: 1Gi, cpu_affinity: '0-999'}]\n", ["cpu_affinity", "'0-999'"]),
        ("gpus: [{model: X, memory: 1Gi, nvlinks: {3: 1}}]\n", ["gpus[0].nvlinks", "3"]),
        (
            "gpus: [{model: X, memory: 1Gi, nvlinks: {1: 2}},"
            " {model: X, memory: 1Gi, pci_bus_id: '0000:02:00.0'}]\n",
            ["gpus[0].nvlinks", "gpus[1].nvlinks"],
        ),
        (
            "gpus: [{model: X, memory: 1Gi}, {model: X, memory: 1Gi, pci_bus_id: '00000000:01:00.0'}]\n",
            ["gpus[1].pci_bus_id", "gpus[0]"],
        ),
        ("gpus: [{model: X, memory: 1Gi}]\ntopology: [[PIX]]\n", ["topology[0][0]", "'PIX'"]),
        ("preset: [1\n", ["not valid YAML"]),
    ],
)
def test_bad_spec_names_key_and_value(tmp_path: Path, text: str, names: list[str]) -> None:
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    with pytest.raises(SpecError) as e:
        load_spec(f)
    msg = str(e.value)
    assert str(f) in msg
    for part in names:
        assert part in msg, msg


def test_missing_spec_file(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="cannot read node spec"):
        load_spec(tmp_path / "absent.yaml")


def test_create_node_writes_the_static_picture(tmp_path: Path) -> None:
    spec = load_preset("a100x2-nvlink")
    path = create_node(spec, tmp_path / "sub" / "node.state")
    assert path.exists() and not (tmp_path / "sub" / "node.state.tmp").exists()
    with ns.NodeState(path) as st:
        n = st.node
        assert (n.gpu_count, n.cuda_driver_version, n.checkpoint_supported) == (2, 12080, 1)
        assert n.driver_version.decode() == spec.driver_version and n.node_name.decode() == spec.node_name
        for i, g in enumerate(st.gpus):
            want = spec.gpus[i]
            assert g.uuid.decode() == spec.gpu_uuid(i)
            assert g.name.decode() == want.model and g.pci_bus_id.decode() == want.pci_bus_id
            assert (g.total_bytes, g.reserved_bytes, g.minor) == (want.memory, want.reserved, i)
            assert list(g.nvlink_peer[: g.nvlink_count]) == list(want.nvlink_peers)
            assert all(p == -1 for p in g.nvlink_peer[g.nvlink_count :])
            assert list(g.topo_level[:2]) == list(spec.topology[i])
            cpus = [c for c in range(ns.CPU_WORDS * 64) if g.cpu_affinity[c // 64] >> (c % 64) & 1]
            assert tuple(cpus) == want.cpu_affinity
            assert (g.used_bytes, g.lost, g.event_seq) == (0, 0, 0)
        assert not st.live_procs()
        del n, g


def test_create_node_replaces_atomically(tmp_path: Path) -> None:
    """A reader holding the old file keeps a complete picture; new readers see the new node."""
    path = tmp_path / "node.state"
    create_node(load_preset("pcie-l4x4"), path)
    old = ns.NodeState(path)
    try:
        create_node(load_preset("dgx-h100"), path)
        assert old.node.gpu_count == 4 and old.node.magic == ns.MAGIC
        with ns.NodeState(path) as new:
            assert new.node.gpu_count == 8
    finally:
        old.close()
    assert sorted(os.listdir(tmp_path)) == ["node.state"]
