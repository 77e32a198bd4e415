"""Timed loops for the shim's overhead on a real GPU; prints one JSON object.

    python overhead.py train        a tiny MLP trained on random data (PyTorch, Adam)
    python overhead.py torch-alloc  torch.empty / del of varied sizes; run it with
                                    PYTORCH_NO_CUDA_MEMORY_CACHING=1 so every one reaches
                                    cudaMalloc / cudaFree
    python overhead.py cuda-alloc   cuMemAlloc / cuMemFree pairs of varied sizes (cuda-python)

tests/gpu/test_overhead_gpu.py runs each with and without the shim, interleaved, in the
same run. Sizes: GPUFRAC_BENCH_STEPS (loop length) and GPUFRAC_BENCH_ROUNDS (timed rounds
in this process), defaults below. Each loop is warmed up first and every round timed
between device synchronisations; "per_iter" is the median round's, "rounds" all of them.
"usage_ready" and "usage_after" are the container's counted bytes once the warm-up's and
the loop's allocations were freed (what is left: the context the shim charged; None without
the shim). "t_ready" (time.monotonic(), CLOCK_MONOTONIC: the same clock in the parent) is
when the process had its CUDA context and first allocation: the parent takes its start-up
time from it.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

SIZES = [4 << 10, 64 << 10, 1 << 20, 3 << 20, 16 << 20, 64 << 20]  # bytes, cycled


def steps(default: int) -> int:
    return int(os.environ.get("GPUFRAC_BENCH_STEPS", default))


def timed(n: int, one: Callable[[int], object], sync: Callable[[], object]) -> dict[str, Any]:
    """ROUNDS rounds of `n` calls of one(i), each timed between synchronisations."""
    rounds = []
    for _ in range(int(os.environ.get("GPUFRAC_BENCH_ROUNDS", "5"))):
        sync()
        t0 = time.perf_counter()
        for i in range(n):
            one(i)
        sync()
        rounds.append((time.perf_counter() - t0) / n)
    return {"per_iter": statistics.median(rounds), "rounds": rounds, "iters": n}


def usage() -> int | None:
    cdir = os.environ.get("GPUFRAC_CONTAINER_DIR")
    if not cdir:
        return None
    from gpufrac.memguard import abi

    return int(abi.read_usage(cdir).total_used)


def train() -> dict[str, Any]:
    import torch

    torch.manual_seed(0)
    dev = torch.device("cuda", 0)
    torch.zeros(1, device=dev)
    torch.cuda.synchronize(dev)
    t_ready = time.monotonic()
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
    out = timed(steps(500), lambda i: step(), lambda: torch.cuda.synchronize(dev))
    last = float(step())
    return {"unit": "s/step", **out, "loss_first": first, "loss_last": last, "t_ready": t_ready}


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
    t_ready, ready = time.monotonic(), usage()

    def pair(i: int) -> None:
        t = torch.empty(SIZES[i % len(SIZES)], dtype=torch.uint8, device=dev)
        del t

    out = timed(steps(1000), pair, lambda: torch.cuda.synchronize(dev))
    return {"unit": "s/pair", **out, "usage_ready": ready, "usage_after": usage(), "t_ready": t_ready}


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
    t_ready, ready = time.monotonic(), usage()

    def pair(i: int) -> None:
        err, p = alloc(SIZES[i % len(SIZES)])
        if int(err) != 0:
            raise SystemExit(f"cuMemAlloc: {err!r}")
        chk(free(p))

    out = timed(steps(2000), pair, lambda: chk(cu.cuCtxSynchronize()))
    return {"unit": "s/pair", **out, "usage_ready": ready, "usage_after": usage(), "t_ready": t_ready}


MODES = {"train": train, "torch-alloc": torch_alloc, "cuda-alloc": cuda_alloc}

if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in MODES:
        raise SystemExit(f"usage: overhead.py {{{','.join(MODES)}}}")
    print(json.dumps({"mode": sys.argv[1], **MODES[sys.argv[1]]()}))
