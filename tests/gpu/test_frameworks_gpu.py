"""What users run, under the real shim on a real GPU, inside a container's limit:

* a transformers causal LM built from a config (random weights, nothing downloaded) runs
  generate(); the container's count stays within the limit and its view holds;
* NCCL initialises a one-rank communicator and all-reduces (NCCL maps its buffers with
  the VMM API, cuMemCreate/cuMemMap, which the shim counts).
"""
# ruff: noqa: F811 - pytest fixtures imported from gpu_support are parameters here

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from gpu_support import GiB, Gpu, Worker, assert_container_view, gpu, gpu_env, record, spawn  # noqa: F401

from tests.fixtures.memguard import make_container

pytestmark = pytest.mark.gpu

LIMIT = 4 * GiB


def start_in_box(spawn, real_env: dict[str, str], gpu: Gpu, tmp_path: Path, name: str) -> tuple[Worker, Path]:
    c = make_container(tmp_path / name, LIMIT, LIMIT, pod="gpu-test", container=name)
    return spawn(gpu_env(real_env, gpu, c), name), c.dir


def test_transformers_generate_inside_a_limit(
    spawn, real_env: dict[str, str], gpu: Gpu, tmp_path: Path
) -> None:
    if importlib.util.find_spec("transformers") is None:
        pytest.fail("transformers is not installed: the suite's packages are incomplete")
    w, _ = start_in_box(spawn, real_env, gpu, tmp_path, "generate")
    out = w.ok("generate", tokens=32, timeout=240)
    assert out["shape"] == [4, 32 + 32], out
    used = assert_container_view(out, LIMIT)
    assert out["usage"]["slot"]["oom_refusals"] == 0, out
    record(
        "transformers-generate",
        {
            "name": "transformers-generate",
            "transformers": out["transformers"],
            "container_used_bytes": used,
            "torch_reserved_bytes": out["reserved"],
        },
    )


def test_nccl_single_gpu_init_under_the_shim(
    spawn, real_env: dict[str, str], gpu: Gpu, tmp_path: Path
) -> None:
    w, _ = start_in_box(spawn, real_env, gpu, tmp_path, "nccl")
    before = w.ok("info")
    out = w.ok("stage", name="nccl", timeout=240)
    assert out["check"], out
    after = w.ok("info")
    used = assert_container_view(after, LIMIT)
    # NCCL's buffers are counted for the container.
    assert used > before["usage"]["total_used"], (before["usage"], after["usage"])
    record(
        "nccl-init",
        {"name": "nccl-init", "nccl": out["nccl"], "counted_bytes": used - before["usage"]["total_used"]},
    )
