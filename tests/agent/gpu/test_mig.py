"""Mixed nodes: a GPU in MIG mode (NVML's current MIG mode says so) is not shared.

Its instances belong to a MIG-aware device plugin, so gpufrac must not hand the parent
GPU out as fractions: the kubelet never sees a slice of it, and `gpufrac gpus`,
`gpufrac topo`, `gpufrac status`, the log and the metrics name it as left alone. The
node is simgpu's `h100x4-mig` preset: 4 x H100, GPUs 2 and 3 in MIG mode."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pynvml
import pytest

from gpufrac.core.gpus import MIG_REASON
from gpufrac.core.slices import FRACTION, MEMORY
from gpufrac.simgpu.spec import SpecError, load_preset, spec_from_dict
from tests.fixtures.metrics import InprocNode

if TYPE_CHECKING:
    from tests.fixtures.simnode import SimNode

PRESET = "h100x4-mig"
SPEC = load_preset(PRESET)
MIG = [i for i, g in enumerate(SPEC.gpus) if g.mig_enabled]
SHARED = [i for i, g in enumerate(SPEC.gpus) if not g.mig_enabled]
GPUFRAC = Path(sys.executable).with_name("gpufrac")


@pytest.fixture
def sim_node(make_sim_node: Callable[..., SimNode]) -> SimNode:
    # Overrides tests/conftest.py's sim_node: the node and in_process_nvml fixtures use it.
    return make_sim_node(PRESET)


def test_the_preset_is_mixed() -> None:
    assert MIG == [2, 3] and SHARED == [0, 1]


def test_fake_nvml_reports_the_mig_mode(in_process_nvml: SimNode) -> None:
    for i in range(len(SPEC.gpus)):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        mode = 1 if i in MIG else 0
        assert pynvml.nvmlDeviceGetMigMode(h) == [mode, mode]


def test_a_gpu_without_mig_support_says_not_supported(make_sim_node: Callable[..., SimNode]) -> None:
    from tests.fixtures.simnode import nvml_in_process

    node = make_sim_node("pcie-l4x4")
    with nvml_in_process(node.path):
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        with pytest.raises(pynvml.NVMLError_NotSupported):
            pynvml.nvmlDeviceGetMigMode(h)


def test_spec_refuses_mig_on_a_gpu_that_has_none() -> None:
    with pytest.raises(SpecError, match=r"gpus\[0\]\.mig_enabled.*MIG-capable"):
        spec_from_dict({"preset": "pcie-l4x4", "gpus": [{"mig_enabled": True}, {}, {}, {}]})


def test_gpus_and_topo_name_the_mig_gpus(sim_node: SimNode) -> None:
    env = sim_node.process_env()

    def run(*args: str) -> str:
        r = subprocess.run([str(GPUFRAC), *args], env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        return r.stdout

    doc = json.loads(run("gpus", "-o", "json"))
    assert [g["index"] for g in doc["gpus"]] == SHARED
    assert [(m["index"], m["uuid"]) for m in doc["mig"]] == [(i, SPEC.gpu_uuid(i)) for i in MIG]
    assert all(m["reason"] == MIG_REASON for m in doc["mig"])
    table = run("gpus")
    assert "4 GPUs" in table.splitlines()[0]
    for i in MIG:
        row = next(line for line in table.splitlines() if SPEC.gpu_uuid(i) in line)
        assert row.split()[0] == str(i) and row.endswith(MIG_REASON)

    topo = json.loads(run("topo", "-o", "json"))
    assert [g["index"] for g in topo["gpus"]] == SHARED and [m["index"] for m in topo["mig"]] == MIG
    text = run("topo")
    assert all(f"GPU{i}: {MIG_REASON}" in text for i in MIG)


def test_the_agent_leaves_mig_gpus_to_the_mig_plugin(
    node: InprocNode, caplog: pytest.LogCaptureFixture
) -> None:
    mig_uuids = {SPEC.gpu_uuid(i) for i in MIG}
    shared_uuids = {SPEC.gpu_uuid(i) for i in SHARED}
    # The kubelet is offered slices of the shared GPUs only.
    for resource in (FRACTION, MEMORY):
        offered = {d.split("::")[0] for d in node.kubelet.devices(resource)}
        assert offered == shared_uuids, resource
    assert node.kubelet.capacity(FRACTION) == 100 * len(SHARED)

    status = subprocess.run(
        [str(GPUFRAC), "status", "-o", "json", "--socket", str(node.status_socket)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert status.returncode == 0, status.stderr
    doc = json.loads(status.stdout)
    assert {g["uuid"] for g in doc["gpus"]} == shared_uuids
    assert {m["uuid"] for m in doc["mig"]} == mig_uuids
    table = subprocess.run(
        [str(GPUFRAC), "status", "--socket", str(node.status_socket)],
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    assert sum(1 for line in table.splitlines() if line.endswith(MIG_REASON)) == len(MIG)

    scrape = node.scrape()
    for i in MIG:
        assert scrape.get("gpufrac_gpu_mig_enabled", uuid=SPEC.gpu_uuid(i), index=str(i)) == 1
        assert scrape.get("gpufrac_gpu_memory_total_bytes", uuid=SPEC.gpu_uuid(i)) is None
    for i in SHARED:
        assert scrape.get("gpufrac_gpu_mig_enabled", uuid=SPEC.gpu_uuid(i)) == 0


def test_the_log_names_each_mig_gpu(in_process_nvml: SimNode, caplog: pytest.LogCaptureFixture) -> None:
    from gpufrac.agent.gpu.inventory import read_inventory

    with caplog.at_level(logging.INFO, logger="gpufrac.agent.gpu.inventory"):
        inv = read_inventory()
    assert [g.index for g in inv.mig] == MIG
    for i in MIG:
        assert any(
            SPEC.gpu_uuid(i) in r.getMessage() and MIG_REASON in r.getMessage() and r.levelno == logging.INFO
            for r in caplog.records
        ), caplog.text


def test_sim_show_says_which_gpus_run_mig(sim_node: SimNode) -> None:
    def show(*extra: str) -> str:
        argv = [str(GPUFRAC), "sim", "show", "--state", str(sim_node.path), *extra]
        r = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        return r.stdout

    doc = json.loads(show("-o", "json"))
    assert [g["mig_enabled"] for g in doc["gpus"]] == [i in MIG for i in range(len(SPEC.gpus))]
    import yaml

    assert yaml.safe_load(show("-o", "yaml")) == json.loads(show("--json"))
    rows = [line for line in show().splitlines() if "MIG enabled" in line]
    assert [int(r.split()[0]) for r in rows] == MIG


def test_the_watchdog_leaves_processes_on_mig_gpus_alone(node: InprocNode, sim_node: SimNode) -> None:
    from gpufrac.simgpu.workload import WorkloadProcess

    def cuda_on(index: int) -> WorkloadProcess:
        # A process outside any gpufrac container (no shim), on one GPU of the node.
        env = sim_node.process_env(CUDA_VISIBLE_DEVICES=str(index))
        env.pop("LD_PRELOAD", None)
        argv = WorkloadProcess.argv()
        proc = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        w = WorkloadProcess(proc, f"gpu{index}")
        assert w.do(f"alloc {1 << 30}").startswith("ok")
        return w

    on_mig, on_shared = cuda_on(MIG[0]), cuda_on(SHARED[0])
    try:
        wd = node.agent.watchdog
        assert wd is not None
        node.thread.call(wd.scan)
        # The shared GPU's stray process is reported; the MIG GPU's belongs to the MIG plugin's pods.
        assert set(wd.unowned) == {on_shared.proc.pid}
    finally:
        on_mig.close()
        on_shared.close()
