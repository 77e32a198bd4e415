"""A simulated GPU node: its node-state file, and the ways a test sees it.

* make_sim_node / sim_node: a fresh node per test (SimNode: its state file and the environment
  a subprocess needs to load the fake libnvidia-ml.so.1 / libcuda.so.1);
* in_process_nvml: this test process's own nvidia-ml-py on that node (the agent's NVML reads);
* nvml_node(directory, preset): the same as a context manager, for wider-scoped fixtures.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pynvml
import pytest

from gpufrac.core import native
from gpufrac.simgpu.spec import NodeSpec, create_node, load_preset, spec_from_dict


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


@contextlib.contextmanager
def nvml_in_process(state: Path) -> Iterator[None]:
    """Point this process's nvidia-ml-py at the node-state file `state`, all of its GPUs visible.

    glibc reads LD_LIBRARY_PATH only at start-up, so the fake library is loaded by absolute
    path first; nvidia-ml-py's CDLL("libnvidia-ml.so.1") then finds it by soname, as it would
    find the real one. Only the fake libnvidia-ml is needed (NVML readers never load libcuda)."""
    ctypes.CDLL(str(native.library(native.FAKE_NVML)), mode=ctypes.RTLD_GLOBAL)
    saved = {k: os.environ.get(k) for k in ("SIMGPU_STATE", "NVIDIA_VISIBLE_DEVICES")}
    os.environ["SIMGPU_STATE"] = str(state)
    os.environ.pop("NVIDIA_VISIBLE_DEVICES", None)  # a CI runner's own setting must not hide GPUs
    pynvml.nvmlInit()
    try:
        yield
    finally:
        pynvml.nvmlShutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def nvml_node(directory: Path, preset: str = "dgx-h100", context_memory: int | None = None) -> Iterator[Path]:
    """A fresh node of `preset` in `directory`, seen by this process's nvidia-ml-py
    (context_memory: see preset_spec)."""
    path = create_node(preset_spec(preset, context_memory), directory / "node.state")
    with nvml_in_process(path):
        yield path


def preset_spec(preset: str, context_memory: int | None = None) -> NodeSpec:
    """`preset` as it is (each CUDA context takes the preset's estimate, as on the real part),
    or with every context taking `context_memory` bytes instead (0: contexts are free)."""
    if context_memory is None:
        return load_preset(preset)
    return spec_from_dict({"preset": preset, "gpu_defaults": {"context_memory": context_memory}})


@pytest.fixture
def make_sim_node(tmp_path: Path) -> Callable[..., SimNode]:
    """Factory: make_sim_node("pcie-l4x4") -> SimNode (default preset dgx-h100, its contexts
    charged as the preset says; context_memory=N overrides that, see preset_spec)."""
    counter = iter(range(1000))

    def make(
        preset: str = "dgx-h100", flavour: str = "release", context_memory: int | None = None
    ) -> SimNode:
        path = tmp_path / f"node-{next(counter)}.state"
        create_node(preset_spec(preset, context_memory), path)
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
    """This test process's nvidia-ml-py on a fresh simulated node (see nvml_in_process)."""
    with nvml_in_process(sim_node.path):
        yield sim_node
