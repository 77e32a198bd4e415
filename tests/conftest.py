"""Shared fixtures: a simulated GPU node per test, and processes that run on it."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from gpufrac import native

# Every fixture module is registered here, once; test modules import its helpers and
# types, never its fixtures. One module per thing a test needs:
#   a simulated GPU node     make_sim_node, sim_node, in_process_nvml (this file)
#   the apiserver            kube_server (kube_fixtures.py)
#   a container under the shim   container, shim, flavour (memguard_fixtures.py)
#   the agent, a subprocess  make_sim, sim: with the kubelet emulator (agentsim_fixtures.py);
#                            e2e_node: plus the apiserver, runtime and workloads (e2e_support.py)
#   the agent, in-process    node: with metrics and status served (metrics_support.py)
#   the arbiter's parts      make_node: ledger, identity, arbiter on a loop (arbiter_harness.py)
# Polling with a deadline (no fixed sleeps): polling.py.
pytest_plugins = [
    "kube_fixtures",
    "memguard_fixtures",
    "agentsim_fixtures",
    "e2e_support",
    "arbiter_harness",
    "metrics_support",
]


@dataclass
class SimNode:
    """A simulated node: its state file and the environment a process needs to
    see it through the fake libnvidia-ml.so.1 / libcuda.so.1."""

    path: Path
    flavour: str = "release"
    env: dict[str, str] = field(default_factory=dict)

    def process_env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.env)
        env.update(extra)
        return env


@pytest.fixture
def make_sim_node(tmp_path: Path) -> Callable[..., SimNode]:
    """Factory: make_sim_node("pcie-l4x4") -> SimNode (default preset dgx-h100)."""
    from gpufrac.simgpu.spec import create_node, load_preset

    counter = iter(range(1000))

    def make(preset: str = "dgx-h100", flavour: str = "release") -> SimNode:
        path = tmp_path / f"node-{next(counter)}.state"
        create_node(load_preset(preset), path)
        libdir = native.native_dir(flavour)
        native.library(native.FAKE_NVML, flavour)
        native.library(native.FAKE_CUDA, flavour)
        env = {"SIMGPU_STATE": str(path), "LD_LIBRARY_PATH": str(libdir)}
        return SimNode(path=path, flavour=flavour, env=env)

    return make


@pytest.fixture
def sim_node(make_sim_node: Callable[..., SimNode]) -> SimNode:
    return make_sim_node()


@pytest.fixture
def in_process_nvml(sim_node: SimNode) -> Iterator[SimNode]:
    """Point this test process's own nvidia-ml-py at the simulated node.

    glibc reads LD_LIBRARY_PATH only at start-up, so the fake library is loaded
    by absolute path first; nvidia-ml-py's CDLL("libnvidia-ml.so.1") then finds
    it by soname, as it would find the real one."""
    import ctypes

    import pynvml

    ctypes.CDLL(str(native.library(native.FAKE_NVML)), mode=ctypes.RTLD_GLOBAL)
    old = os.environ.get("SIMGPU_STATE")
    os.environ["SIMGPU_STATE"] = str(sim_node.path)
    pynvml.nvmlInit()
    try:
        yield sim_node
    finally:
        pynvml.nvmlShutdown()
        if old is None:
            os.environ.pop("SIMGPU_STATE", None)
        else:
            os.environ["SIMGPU_STATE"] = old
