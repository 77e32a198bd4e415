"""`gpufrac sim`: create a node, inject faults, show it — as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from gpufrac.simgpu.spec import load_preset


def sim(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "gpufrac.agent.cli.commands", "sim", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def show(state: Path) -> dict:
    out = sim("show", "--state", str(state), "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_create_fault_show_cycle(tmp_path: Path) -> None:
    state = tmp_path / "node.state"
    out = sim("create", "--preset", "a100x2-nvlink", "--out", str(state), "--node-name", "lab-7")
    assert out.returncode == 0, out.stderr
    doc = show(state)
    spec = load_preset("a100x2-nvlink", node_name="lab-7")
    assert doc["node_name"] == "lab-7"
    assert [g["uuid"] for g in doc["gpus"]] == [spec.gpu_uuid(i) for i in range(2)]
    assert [g["memory_total"] for g in doc["gpus"]] == [g.memory for g in spec.gpus]
    assert all(not g["lost"] and g["events"] == 0 and g["memory_used"] == 0 for g in doc["gpus"])
    assert doc["processes"] == []

    assert sim("xid", "--state", str(state), "--gpu", "1", "--xid", "48").returncode == 0
    assert sim("lose", "--state", str(state), "--gpu", "0").returncode == 0
    doc = show(state)
    assert [(g["lost"], g["events"]) for g in doc["gpus"]] == [(True, 1), (False, 1)]
    assert sim("restore", "--state", str(state), "--gpu", "0").returncode == 0
    assert show(state)["gpus"][0]["lost"] is False

    table = sim("show", "--state", str(state))
    assert (
        table.returncode == 0 and spec.gpu_uuid(1) in table.stdout and "NVIDIA A100-SXM4-40GB" in table.stdout
    )


def test_create_from_spec_file(tmp_path: Path) -> None:
    spec_file = tmp_path / "node.yaml"
    spec_file.write_text("preset: pcie-l4x4\nnode_name: edge-1\ngpu_defaults: {memory: 16Gi}\n")
    state = tmp_path / "node.state"
    assert sim("create", "--spec", str(spec_file), "--out", str(state)).returncode == 0
    doc = show(state)
    assert doc["node_name"] == "edge-1" and [g["memory_total"] for g in doc["gpus"]] == [16 << 30] * 4


def test_bad_input_is_a_clear_error(tmp_path: Path) -> None:
    spec_file = tmp_path / "node.yaml"
    spec_file.write_text("preset: pcie-l4x4\ngpu_defaults: {memory: lots}\n")
    out = sim("create", "--spec", str(spec_file), "--out", str(tmp_path / "x.state"))
    assert out.returncode == 2 and "memory" in out.stderr and "'lots'" in out.stderr
    assert not (tmp_path / "x.state").exists()

    state = tmp_path / "node.state"
    assert sim("create", "--preset", "pcie-l4x4", "--out", str(state)).returncode == 0
    out = sim("xid", "--state", str(state), "--gpu", "4")
    assert out.returncode == 2 and "gpu 4" in out.stderr and "0..3" in out.stderr
    out = sim("show", "--state", str(tmp_path / "missing.state"))
    assert out.returncode == 2 and "missing.state" in out.stderr
