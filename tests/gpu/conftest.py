"""tests/gpu runs only on a node with a real NVIDIA GPU; everywhere else every test
here is skipped with the reason.

The check runs in a fresh process with simgpu taken out of the environment: this
test process may already have the fake libnvidia-ml.so.1 loaded (the
in_process_nvml fixture), and LD_LIBRARY_PATH may point at it.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import pytest
from gpu_support import real_driver_env

_PROBE = """
import json, pynvml
try:
    pynvml.nvmlInit()
except pynvml.NVMLError as e:
    print(json.dumps({"count": 0, "why": f"nvmlInit: {e}"}))
else:
    print(json.dumps({"count": pynvml.nvmlDeviceGetCount(), "driver": pynvml.nvmlSystemGetDriverVersion()}))
"""


@functools.lru_cache(maxsize=1)
def _why_no_gpu() -> str | None:
    if os.environ.get("SIMGPU_STATE"):
        return "SIMGPU_STATE is set: this is a simulated node"
    r = subprocess.run(
        [sys.executable, "-c", _PROBE],
        env=real_driver_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if r.returncode != 0:
        return f"NVML probe failed: {r.stderr.strip().splitlines()[-1:]}"
    result = json.loads(r.stdout)
    if result["count"] < 1:
        return f"no NVIDIA GPU ({result.get('why', 'NVML reports 0 devices')})"
    return None


# Session scope, so it runs (and skips) before any module-scoped fixture touches NVML.
@pytest.fixture(scope="session", autouse=True)
def _needs_a_real_gpu() -> None:
    why = _why_no_gpu()
    if why:
        pytest.skip(f"needs a real NVIDIA GPU: {why}")


@pytest.fixture(scope="session")
def real_env() -> dict[str, str]:
    return real_driver_env()
