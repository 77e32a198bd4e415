"""Timed loops for the shim's overhead on a real GPU; prints one JSON object.

    python overhead.py train        a tiny MLP trained on random data (PyTorch, Adam)
    python overhead.py torch-alloc  torch.empty / del of varied sizes; run it with
                                    PYTORCH_NO_CUDA_MEMORY_CACHING=1 so every one reaches
                                    cudaMalloc / cudaFree
    python overhead.py cuda-alloc   cuMemAlloc / cuMemFree pairs of varied sizes (cuda-python)

tests/gpu/test_shim_gpu.py runs each with and without the shim, interleaved, in the
same run. Sizes: GPUFRAC_BENCH_STEPS (loop length), defaults below. Each loop is
warmed up first and timed between device synchronisations; "usage_after" is the
container's counted bytes once everything was freed (None without the shim).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

SIZES = [4 << 10, 64 << 10, 1 << 20, 3 << 20, 16 << 20, 64 << 20]  # bytes, cycled


def steps(default: int) -> int:
    return int(os.environ.get("GPUFRAC_BENCH_STEPS", default))


def usage_after() -> int | None:
    cdir = os.environ.get("GPUFRAC_CONTAINER_DIR")
    if not cdir:
        return None
    from gpufrac.memguard import abi

    return int(abi.read_usage(cdir).total_used)


def train() -> dict[str, Any]:
    import torch

    torch.manual_seed(0)
    dev = torch.device("cuda", 0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(),
        torch.nn.Linear(512, 64),
    ).to(dev)  # fmt: skip
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    target = torch.nn.Linear(256, 64).to(dev)  # a fixed function to learn
    x = torch.randn(128, 256, device=dev)
    with torch.no_grad():
        y = target(x)

    def step() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss

    first = float(step())
    for _ in range(50):
        step()
    torch.cuda.synchronize(dev)
    n = steps(2000)
    t0 = time.perf_counter()
    for _ in range(n):
        loss = step()
    torch.cuda.synchronize(dev)
    secs = time.perf_counter() - t0
    return {"unit": "s/step", "per_iter": secs / n, "iters": n, "loss_first": first, "loss_last": float(loss)}


def torch_alloc() -> dict[str, Any]:
    import torch

    dev = torch.device("cuda", 0)
    assert os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING") == "1", (
        "run with PYTORCH_NO_CUDA_MEMORY_CACHING=1"
    )
    for s in SIZES:
        del_me = torch.empty(s, dtype=torch.uint8, device=dev)
        del del_me
    torch.cuda.synchronize(dev)
    n = steps(3000)
    t0 = time.perf_counter()
    for i in range(n):
        t = torch.empty(SIZES[i % len(SIZES)], dtype=torch.uint8, device=dev)
        del t
    torch.cuda.synchronize(dev)
    secs = time.perf_counter() - t0
    return {"unit": "s/pair", "per_iter": secs / n, "iters": n, "usage_after": usage_after()}


def cuda_alloc() -> dict[str, Any]:
    from cuda.bindings import driver as cu

    def chk(r: Any) -> Any:
        r = r if isinstance(r, tuple) else (r,)
        if int(r[0]) != 0:
            raise SystemExit(f"CUDA error {r[0]!r}")
        return r[1] if len(r) == 2 else r[1:]

    chk(cu.cuInit(0))
    ctx = chk(cu.cuDevicePrimaryCtxRetain(chk(cu.cuDeviceGet(0))))
    chk(cu.cuCtxSetCurrent(ctx))
    alloc, free = cu.cuMemAlloc, cu.cuMemFree
    for s in SIZES:
        chk(free(chk(alloc(s))))
    n = steps(5000)
    t0 = time.perf_counter()
    for i in range(n):
        err, p = alloc(SIZES[i % len(SIZES)])
        if int(err) != 0:
            raise SystemExit(f"cuMemAlloc: {err!r}")
        chk(free(p))
    chk(cu.cuCtxSynchronize())
    secs = time.perf_counter() - t0
    return {"unit": "s/pair", "per_iter": secs / n, "iters": n, "usage_after": usage_after()}


MODES = {"train": train, "torch-alloc": torch_alloc, "cuda-alloc": cuda_alloc}

if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in MODES:
        raise SystemExit(f"usage: overhead.py {{{','.join(MODES)}}}")
    print(json.dumps({"mode": sys.argv[1], **MODES[sys.argv[1]]()}))
