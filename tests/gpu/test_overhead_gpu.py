"""The shim's overhead on a real GPU, shim against no shim in the same run (recorded for
bench/gpu_suite.sh's report, which sets the goals beside them; not asserted here):

* train: a small training loop (goal: under 2 %);
* torch-alloc: torch.empty/del of varied sizes with the caching allocator off, so every
  one reaches cudaMalloc/cudaFree;
* cuda-alloc: cuMemAlloc/cuMemFree pairs of varied sizes through cuda-python;
* startup: a PyTorch process's start until its CUDA context and first tensor exist,
  taken from the train runs (spawn to the workload's `t_ready`).

Processes alternate (none, shim, shim, none, ...), so drift in clocks or neighbours hits
both; each process times GPUFRAC_BENCH_ROUNDS rounds and reports its median round.
"""
# ruff: noqa: F811 - pytest fixtures imported from gpu_support are parameters here

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from gpu_support import OVERHEAD, TIMEOUT, GiB, Gpu, gpu, gpu_env, record  # noqa: F401

from bench.gpu_report import summarize
from tests.fixtures.memguard import make_container

pytestmark = pytest.mark.gpu

PROCESSES = int(os.environ.get("GPUFRAC_BENCH_PROCESSES", "2"))  # per variant and loop


def run_overhead(mode: str, env: dict[str, str]) -> dict[str, Any]:
    spawned = time.monotonic()
    r = subprocess.run(
        [sys.executable, str(OVERHEAD), mode],
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )
    assert r.returncode == 0, f"{mode} failed ({r.returncode}):\n{r.stderr[-4000:]}"
    out: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1])
    out["startup_s"] = out["t_ready"] - spawned
    return out


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["train", "torch-alloc", "cuda-alloc"])
def test_shim_overhead(mode: str, real_env: dict[str, str], gpu: Gpu, tmp_path: Path) -> None:
    # The whole loop stays within the request: the shim's fast path, as in production.
    room = min(8 * GiB, gpu.total // 2)
    c = make_container(tmp_path / "ctr", room, room, pod="gpu-test", container="main")
    extra = {"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"} if mode == "torch-alloc" else {}
    envs = {"none": gpu_env(real_env, gpu, None, **extra), "shim": gpu_env(real_env, gpu, c, **extra)}
    runs: dict[str, list[dict[str, Any]]] = {"none": [], "shim": []}
    for i in range(PROCESSES):
        for variant in ("none", "shim") if i % 2 == 0 else ("shim", "none"):
            out = run_overhead(mode, envs[variant])
            runs[variant].append(out)
            if mode == "train":
                assert out["loss_last"] < out["loss_first"], (variant, out)  # it really trained
            elif variant == "shim":
                # Thousands of varied pairs, nothing of them left counted (the context stays).
                assert out["usage_after"] == out["usage_ready"] > 0, out
            else:
                assert out["usage_after"] is None
    # Every round of every process: the median of them is compared.
    per = {v: [x for r in runs[v] for x in r["rounds"]] for v in runs}
    record(
        mode,
        summarize(
            mode,
            runs["none"][0]["unit"],
            per["none"],
            per["shim"],
            iters=runs["none"][0]["iters"],
            gpu=gpu.name,
        ),
    )
    if mode == "train":
        record(
            "startup",
            summarize(
                "startup",
                "s/process",
                [r["startup_s"] for r in runs["none"]],
                [r["startup_s"] for r in runs["shim"]],
                gpu=gpu.name,
            ),
        )
