"""The agent's inventory, topology and health on a real NVIDIA GPU node, through the
real driver's NVML — checked for sanity, consistency, and against nvidia-smi.

Everything runs in a fresh process (the test process may hold simgpu's fake NVML)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from gpufrac.agent.cli.gpus import cpu_list
from gpufrac.agent.gpu.inventory import parse_bus_id

pytestmark = pytest.mark.gpu

# The `gpufrac` command, as its entry point runs it (no install needed: the suite runs from a checkout).
GPUFRAC = [sys.executable, "-m", "gpufrac.agent.cli.commands"]

# Dumps the inventory, the memory reading and one health poll as JSON.
_DUMP = """
import dataclasses, json
from gpufrac.core.config import HealthConfig
from gpufrac.agent.gpu.health import HealthMonitor
from gpufrac.agent.gpu.inventory import read_inventory, read_memory
inv = read_inventory()
with HealthMonitor(HealthConfig(), inv.gpus) as m:
    m.poll(100)
    health = {u: dataclasses.asdict(h) for u, h in m.current().items()}
print(json.dumps({
    "gpus": [dataclasses.asdict(g) for g in inv.gpus],
    "links": [[a, b, l.nvlinks, l.pcie.value] for (a, b), l in inv.links.items()],
    "driver": inv.driver_version, "cuda": inv.cuda_driver_version,
    "unreachable": inv.unreachable,
    "memory": {u: dataclasses.asdict(m) for u, m in read_memory().items()},
    "health": health,
}))
"""


@pytest.fixture(scope="module")
def dump(real_env: dict[str, str]) -> dict:
    r = subprocess.run(
        [sys.executable, "-c", _DUMP], env=real_env, capture_output=True, text=True, timeout=300, check=False
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_every_gpu_has_sane_identity(dump: dict) -> None:
    gpus = dump["gpus"]
    assert gpus, "NVML reported a GPU but the inventory is empty"
    assert dump["unreachable"] == {}
    assert [g["index"] for g in gpus] == list(range(len(gpus)))
    assert len({g["uuid"] for g in gpus}) == len(gpus)
    assert len({parse_bus_id(g["pci_bus_id"]) for g in gpus}) == len(gpus)
    assert len({g["minor"] for g in gpus}) == len(gpus)
    cpus = os.cpu_count() or 1
    for g in gpus:
        assert g["uuid"].startswith(("GPU-", "MIG-"))
        assert g["model"]
        assert g["memory_total"] >= 1 << 30
        assert g["numa_node"] is None or g["numa_node"] >= 0
        assert all(0 <= c < max(cpus, 1024) for c in g["cpu_affinity"])
    assert dump["driver"] and dump["cuda"] >= 10000


def test_links_cover_every_pair_symmetrically(dump: dict) -> None:
    n = len(dump["gpus"])
    links = {(a, b): (nv, pcie) for a, b, nv, pcie in dump["links"]}
    assert set(links) == {(a, b) for a in range(n) for b in range(n) if a != b}
    for (a, b), link in links.items():
        assert link == links[(b, a)]
        assert link[0] >= 0 and link[1] in ("PIX", "PXB", "PHB", "NODE", "SYS")


def test_memory_and_health_are_read(dump: dict) -> None:
    for g in dump["gpus"]:
        m = dump["memory"][g["uuid"]]
        assert m["total"] == g["memory_total"]
        assert 0 <= m["used"] <= m["total"]
        assert dump["health"][g["uuid"]]["healthy"] is True, dump["health"][g["uuid"]]


def _smi(real_env: dict[str, str], *args: str) -> str:
    smi = shutil.which("nvidia-smi", path=real_env.get("PATH"))
    if smi is None:
        pytest.skip("nvidia-smi is not installed")
    r = subprocess.run([smi, *args], env=real_env, capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_identity_matches_nvidia_smi(dump: dict, real_env: dict[str, str]) -> None:
    out = _smi(real_env, "--query-gpu=index,uuid,name,pci.bus_id", "--format=csv,noheader")
    rows = [[c.strip() for c in line.split(",")] for line in out.strip().splitlines()]
    assert len(rows) == len(dump["gpus"])
    for (index, uuid, name, bus), g in zip(rows, dump["gpus"], strict=True):
        assert (int(index), uuid, name) == (g["index"], g["uuid"], g["model"])
        assert parse_bus_id(bus) == parse_bus_id(g["pci_bus_id"])


def test_topology_matches_nvidia_smi_topo(dump: dict, real_env: dict[str, str]) -> None:
    # nvidia-smi underlines the header with ANSI escapes on some versions.
    out = re.sub(r"\x1b\[[0-9;]*m", "", _smi(real_env, "topo", "-m"))
    lines = [line for line in out.splitlines() if line.strip()]
    header = lines[0].split("\t")
    n = len(dump["gpus"])
    col = {name.strip(): i for i, name in enumerate(header)}
    links = {(a, b): (nv, pcie) for a, b, nv, pcie in dump["links"]}
    for g in dump["gpus"]:
        a = g["index"]
        row = next(line.split("\t") for line in lines[1:] if line.split("\t")[0].strip() == f"GPU{a}")
        for b in range(n):
            cell = row[col[f"GPU{b}"]].strip()
            if a == b:
                assert cell == "X"
                continue
            nv, pcie = links[(a, b)]
            assert cell == (f"NV{nv}" if nv else pcie), (a, b)
        # Where nvidia-smi knows the affinity, ours must agree (ours may also come from sysfs).
        smi_cpus = row[col["CPU Affinity"]].strip() if "CPU Affinity" in col else "N/A"
        if smi_cpus != "N/A":
            assert smi_cpus == cpu_list(g["cpu_affinity"])
        smi_numa = row[col["NUMA Affinity"]].strip() if "NUMA Affinity" in col else "N/A"
        if smi_numa != "N/A":
            assert smi_numa == str(g["numa_node"])


@pytest.mark.parametrize("command", [["gpus"], ["gpus", "--json"], ["topo"], ["topo", "--json"]])
def test_cli_runs_on_the_real_node(command: list[str], real_env: dict[str, str], dump: dict) -> None:
    r = subprocess.run(
        [*GPUFRAC, *command], env=real_env, capture_output=True, text=True, timeout=120, check=False
    )
    assert r.returncode == 0, r.stderr
    for g in dump["gpus"]:
        if command[0] == "gpus":
            assert g["uuid"] in r.stdout
        else:
            assert f"GPU{g['index']}" in r.stdout
