"""`gpufrac gpus` and `gpufrac topo` as a user runs them: the installed console
script in a fresh process, finding the simulated driver through LD_LIBRARY_PATH."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from gpufrac.agent.gpu.inventory import parse_bus_id
from gpufrac.simgpu import faults
from gpufrac.simgpu.spec import TOPO_LEVEL_NAMES, NodeSpec, load_preset

if TYPE_CHECKING:
    from tests.fixtures.simnode import SimNode

GPUFRAC = Path(sys.executable).with_name("gpufrac")


def gpufrac(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(GPUFRAC), *args], env=env, capture_output=True, text=True, timeout=120, check=False
    )


def ok(node: SimNode, *args: str) -> str:
    r = gpufrac(node.process_env(), *args)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    return r.stdout


def expected_label(spec: NodeSpec, a: int, b: int) -> str:
    if a == b:
        return "X"
    n = spec.nvlinks(a, b)
    return f"NV{n}" if n else TOPO_LEVEL_NAMES[spec.topology[a][b]]


PRESETS = ["dgx-h100", "pcie-l4x4"]


@pytest.fixture(params=PRESETS)
def node_and_spec(
    request: pytest.FixtureRequest, make_sim_node: Callable[..., SimNode]
) -> tuple[SimNode, NodeSpec]:
    return make_sim_node(request.param), load_preset(request.param)


def test_gpus_json_lists_every_gpu(node_and_spec: tuple[SimNode, NodeSpec]) -> None:
    node, spec = node_and_spec
    doc = json.loads(ok(node, "gpus", "--json"))
    assert doc["driver_version"] == spec.driver_version
    assert doc["cuda_driver_version"] == spec.cuda_driver_version
    assert doc["unreachable"] == []
    assert len(doc["gpus"]) == len(spec.gpus)
    for i, (g, want) in enumerate(zip(doc["gpus"], spec.gpus, strict=True)):
        assert g["index"] == i
        assert g["uuid"] == spec.gpu_uuid(i)
        assert g["model"] == want.model
        assert g["memory_total"] == want.memory
        assert 0 <= g["memory_used"] <= g["memory_total"]
        assert parse_bus_id(g["pci_bus_id"]) == parse_bus_id(want.pci_bus_id)
        assert g["numa_node"] == want.numa_node
        assert g["cpu_affinity"] == list(want.cpu_affinity)
        assert g["healthy"] is True and g["health_reason"] == ""


def test_gpus_table_has_one_row_per_gpu(node_and_spec: tuple[SimNode, NodeSpec]) -> None:
    node, spec = node_and_spec
    lines = ok(node, "gpus").splitlines()
    assert spec.driver_version in lines[0] and f"{len(spec.gpus)} GPUs" in lines[0]
    header = next(i for i, line in enumerate(lines) if line.startswith("IDX"))
    for col in ("UUID", "MODEL", "MEMORY", "USED", "PCI BUS ID", "NUMA", "HEALTH"):
        assert col in lines[header]
    rows = lines[header + 1 :]
    assert len(rows) == len(spec.gpus)
    for i, (row, want) in enumerate(zip(rows, spec.gpus, strict=True)):
        cells = row.split()
        assert cells[0] == str(i)
        assert cells[1] == spec.gpu_uuid(i)
        assert want.model in row
        assert f"{want.memory / 2**30:.1f}GiB" in row
        assert want.pci_bus_id in row
        assert cells[-2] == str(want.numa_node)
        assert cells[-1] == "Healthy"


def test_topo_matrix_like_nvidia_smi(node_and_spec: tuple[SimNode, NodeSpec]) -> None:
    node, spec = node_and_spec
    n = len(spec.gpus)
    lines = ok(node, "topo").splitlines()
    head = lines[0].split()
    assert head[:n] == [f"GPU{i}" for i in range(n)]
    assert "CPU Affinity" in lines[0] and "NUMA Affinity" in lines[0]
    for a in range(n):
        cells = lines[1 + a].split()
        assert cells[0] == f"GPU{a}"
        assert cells[1 : n + 1] == [expected_label(spec, a, b) for b in range(n)]
        want = spec.gpus[a]
        assert cells[n + 2] == str(want.numa_node)
        cpus = tuple(c for part in cells[n + 1].split(",") for c in _expand(part))
        assert cpus == want.cpu_affinity
    legend = "\n".join(lines[n + 1 :])
    for key in ("X", "SYS", "NODE", "PHB", "PXB", "PIX", "NV#"):
        assert f"  {key} " in legend


def _expand(part: str) -> range:
    lo, _, hi = part.partition("-")
    return range(int(lo), int(hi or lo) + 1)


def test_topo_json(node_and_spec: tuple[SimNode, NodeSpec]) -> None:
    node, spec = node_and_spec
    n = len(spec.gpus)
    doc = json.loads(ok(node, "topo", "--json"))
    assert doc["matrix"] == [[expected_label(spec, a, b) for b in range(n)] for a in range(n)]
    assert len(doc["links"]) == n * (n - 1) // 2
    for link in doc["links"]:
        a, b = link["a"], link["b"]
        assert link["nvlinks"] == spec.nvlinks(a, b)
        assert link["pcie"] == TOPO_LEVEL_NAMES[spec.topology[a][b]]
    assert [g["numa_node"] for g in doc["gpus"]] == [g.numa_node for g in spec.gpus]
    assert [tuple(g["cpu_affinity"]) for g in doc["gpus"]] == [g.cpu_affinity for g in spec.gpus]


def test_gpus_shows_a_gpu_off_the_bus(make_sim_node: Callable[..., SimNode]) -> None:
    node = make_sim_node("pcie-l4x4")
    faults.fall_off_bus(node.path, 1)
    doc = json.loads(ok(node, "gpus", "--json"))
    assert [g["index"] for g in doc["gpus"]] == [0, 2, 3]
    assert [u["index"] for u in doc["unreachable"]] == [1]
    rows = [line.split() for line in ok(node, "gpus").splitlines()[3:]]
    assert [r[0] for r in rows] == ["0", "1", "2", "3"]
    assert "Unhealthy: fell off the bus" in " ".join(rows[1])
    # The topology of the GPUs still there is shown, with the missing one named.
    topo = ok(node, "topo")
    assert "GPU1: unreachable" in topo
    assert json.loads(ok(node, "topo", "--json"))["unreachable"][0]["index"] == 1


def _no_driver_check(r: subprocess.CompletedProcess[str], reason: str) -> None:
    assert r.returncode == 1
    assert r.stdout == ""
    assert "Traceback" not in r.stderr
    # One line from gpufrac (simgpu's fake driver may print its own note first).
    lines = [line for line in r.stderr.splitlines() if line.startswith("gpufrac")]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("gpufrac: no NVIDIA driver found (libnvidia-ml.so.1")
    assert reason in lines[0]
    assert "gpufrac sim create" in lines[0] and "SIMGPU_STATE" in lines[0] and "make run" in lines[0]


@pytest.mark.parametrize("command", ["gpus", "topo"])
def test_a_library_that_cannot_load_gives_one_clear_line(tmp_path: Path, command: str) -> None:
    # An unloadable libnvidia-ml.so.1 first on the search path fails the load even
    # on a machine with a real driver, so this holds everywhere.
    (tmp_path / "libnvidia-ml.so.1").write_bytes(b"")
    env = {k: v for k, v in os.environ.items() if k != "SIMGPU_STATE"}
    env["LD_LIBRARY_PATH"] = str(tmp_path)
    r = gpufrac(env, command, "--json")
    _no_driver_check(r, "file too short")


def test_the_fake_driver_without_a_node_gives_one_clear_line(make_sim_node: Callable[..., SimNode]) -> None:
    env = make_sim_node().process_env()
    del env["SIMGPU_STATE"]
    r = gpufrac(env, "gpus")
    _no_driver_check(r, "nvmlInit says: Driver Not Loaded")
