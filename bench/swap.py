"""Swap round trip on the simulated node: lock + checkpoint + restore + unlock of a process
holding N GiB, through the agent's own checkpoint wrapper (cuda-python on the fake
libcuda.so.1). `swap_roundtrip_ms_per_gib_sim` is what bench/results/arbiter.json
reports; the fake driver keeps device memory in host RAM and moves no bytes, so this
measures the agent's and driver API's overhead, not PCIe (docs/cuda-facts.md section 4).

`python -m bench swap` writes bench/results/swap.json (`--quick`: one small size, once).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

from bench import quick

GiB = 1 << 30

# Holds N bytes of device memory, filled, until stdin closes.
HOLDER = textwrap.dedent(
    """
    import ctypes, sys
    from cuda.bindings import driver as cu
    def chk(r):
        r = r if isinstance(r, tuple) else (r,)
        assert int(r[0]) == 0, r
        return r[1] if len(r) == 2 else r[1:]
    chk(cu.cuInit(0))
    chk(cu.cuCtxSetCurrent(chk(cu.cuDevicePrimaryCtxRetain(chk(cu.cuDeviceGet(0))))))
    p = chk(cu.cuMemAlloc(int(sys.argv[1])))
    chk(cu.cuMemsetD8(p, 0x5A, int(sys.argv[1])))
    print("ready", flush=True)
    sys.stdin.read()
    """
)


def measure_roundtrip(sizes_gib: tuple[int, ...] = (1, 4), repeats: int = 5) -> dict[str, Any]:
    """Median swap round trip (ms) per process size, on a fresh simulated node."""
    from gpufrac.agent.arbiter.swap.checkpoint import Checkpointer
    from gpufrac.core import native
    from gpufrac.simgpu.spec import create_node, load_preset

    root = Path(tempfile.mkdtemp(prefix="gfbs"))
    state = root / "node.state"
    create_node(load_preset("dgx-h100"), state)
    os.environ["SIMGPU_STATE"] = str(state)  # before this process's cuInit binds a node
    ctypes.CDLL(str(native.library(native.FAKE_CUDA)), mode=ctypes.RTLD_GLOBAL)
    ckpt = Checkpointer()
    support = ckpt.detect()
    if not support.available:
        raise RuntimeError(f"checkpoint API unavailable on the simulated node: {support.reason}")
    env = dict(os.environ, LD_LIBRARY_PATH=str(native.native_dir()))
    env.pop("LD_PRELOAD", None)
    per_size: dict[str, float] = {}
    for gib in sizes_gib:
        p = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(gib * GiB)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                ckpt.swap_out([p.pid], 30_000)
                ckpt.swap_in([p.pid])
                times.append((time.perf_counter() - t0) * 1000.0)
            per_size[f"{gib}GiB"] = round(statistics.median(times), 4)
        finally:
            p.kill()
            p.wait()
    shutil.rmtree(root, ignore_errors=True)
    largest = max(sizes_gib)
    return {
        "swap_roundtrip_ms_per_gib_sim": round(per_size[f"{largest}GiB"] / largest, 4),
        "swap_roundtrip_ms": per_size,
        "repeats": repeats,
        "note": "simulated driver: no bytes move; lock+checkpoint+restore+unlock overhead only",
    }


def main() -> dict[str, Any]:
    if quick():
        return measure_roundtrip((1,), repeats=1)
    return measure_roundtrip()


if __name__ == "__main__":
    import json

    print(json.dumps(main(), indent=2))
