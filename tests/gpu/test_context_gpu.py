"""What a CUDA process really costs on this GPU, and whether the shim counts it.

One PyTorch process under the shim and one without go through the same steps a real
workload takes: its context (torch.cuda.init() and a first tensor), cuBLAS (a matmul),
cuDNN (a convolution), a one-rank NCCL communicator, a CuPy kernel. After each, NVML's
per-process figure (what the driver holds for the process, what nvidia-smi and the
watchdog see) is set beside what the shim counted for it and what PyTorch reserved.

* measured: the context's cost (NVML less PyTorch's reservations, the process without
  the shim), the figure simgpu's presets estimate (docs/simgpu.md: 512 MiB for an H100);
  what each later step adds beyond the allocator (handles, workspaces, modules);
* asserted: under the shim, NVML's figure and the shim's count for the process differ by
  no more than the watchdog's allowance (WatchdogConfig.tolerance, docs/watchdog.md) after
  every step; the difference is what lazy module loading takes at first launches, which
  no hooked call sees.

A step that fails (cuDNN missing, NCCL refusing) is recorded as such; the steps after it
still run, and the test fails at the end naming it.
"""
# ruff: noqa: F811 - pytest fixtures imported from gpu_support are parameters here

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from gpu_support import GiB, Gpu, MiB, Worker, gpu, gpu_env, gpu_pids, record, spawn  # noqa: F401

from gpufrac.core.config import WatchdogConfig
from tests.fixtures.memguard import make_container

pytestmark = pytest.mark.gpu

LIMIT = 16 * GiB
STEPS = ("context", "cublas", "cudnn", "nccl", "cupy")
TOLERANCE = WatchdogConfig().tolerance


def walk(w: Worker, gpu: Gpu, usage_dir: Path | None) -> list[dict[str, Any]]:
    """Every step in `w`, with the readings after it."""
    rows = []
    for step in STEPS:
        row: dict[str, Any] = {"step": step}
        if step != "context":  # the context exists once the worker is ready
            r = w.call("stage", name=step, timeout=240)
            if not r["ok"]:
                row["error"] = r["error"]
            elif not r.get("check", True):
                row["error"] = f"wrong result: {r}"
        info = w.ok("info")
        row["torch_reserved"] = info["reserved"]
        row["nvml_process"] = gpu_pids(gpu).get(w.pid)
        if usage_dir is not None:
            row["shim_counted"] = info["usage"]["slot"]["used_bytes"]
        rows.append(row)
    return rows


def mib(n: int | None) -> float | None:
    return None if n is None else round(n / MiB, 1)


def test_what_a_context_costs_and_the_shim_counts(
    spawn, real_env: dict[str, str], gpu: Gpu, tmp_path: Path
) -> None:
    c = make_container(tmp_path / "ctx", LIMIT, LIMIT, pod="gpu-test", container="ctx")
    under = walk(spawn(gpu_env(real_env, gpu, c), "shim"), gpu, c.dir)
    plain = walk(spawn(gpu_env(real_env, gpu, None), "plain"), gpu, None)
    for rows in (under, plain):
        for row in rows:
            n = row["nvml_process"]
            row["beyond_allocator"] = None if n is None else n - row["torch_reserved"]
    for row in under:
        n, s = row["nvml_process"], row["shim_counted"]
        row["nvml_minus_shim"] = None if n is None else n - s
    ctx = plain[0]["beyond_allocator"]
    record(
        "context-cost",
        {
            "name": "context-cost",
            "context_mib": mib(ctx),
            "tolerance_mib": mib(TOLERANCE),
            "max_abs_nvml_minus_shim_mib": mib(
                max(
                    (abs(r["nvml_minus_shim"]) for r in under if r["nvml_minus_shim"] is not None),
                    default=None,
                )
            ),
            "steps_under_shim": [
                {k: (mib(v) if isinstance(v, int) and k != "step" else v) for k, v in r.items()}
                for r in under
            ],
            "steps_plain": [
                {k: (mib(v) if isinstance(v, int) and k != "step" else v) for k, v in r.items()}
                for r in plain
            ],
            "units": "MiB",
        },
    )
    missing = [r["step"] for r in under + plain if r["nvml_process"] is None]
    assert not missing, (
        f"NVML does not list the worker's pid after {missing}: NVML's pids are not this namespace's, "
        "so no per-process figure can be compared here"
    )
    failed = [(r["step"], r["error"]) for r in under + plain if "error" in r]
    assert not failed, f"steps failed: {failed}"
    off = [(r["step"], mib(r["nvml_minus_shim"])) for r in under if abs(r["nvml_minus_shim"]) > TOLERANCE]
    assert not off, f"NVML and the shim's count differ by more than {mib(TOLERANCE)} MiB (in MiB): {off}"
    assert ctx is not None and ctx > 0
