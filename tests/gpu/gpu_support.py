"""Shared by the real-GPU tests: PyTorch / cuda-python workloads (tests/gpu/workloads/)
as subprocesses under the real memguard shim, and where measurements go.

Nothing here imports torch: the workloads do, in their own processes, so collecting
tests/gpu on a machine without a GPU (or without torch) costs nothing.
"""

from __future__ import annotations

import io
import json
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from gpufrac.core import native
from gpufrac.memguard import build
from tests.fixtures.memguard import Container

WORKLOADS = Path(__file__).resolve().parent / "workloads"
TORCH_WORKER = WORKLOADS / "torch_worker.py"
OVERHEAD = WORKLOADS / "overhead.py"
# Directory the measurement tests write <name>.json into (bench/gpu_suite.sh sets it).
RESULTS_ENV = "GPUFRAC_GPU_RESULTS"
MiB = 1 << 20
GiB = 1 << 30
TIMEOUT = 300.0  # generous: first CUDA context, torch import, a checkpoint of GiBs

_GPU_PROBE = """
import json, pynvml
pynvml.nvmlInit()
h = pynvml.nvmlDeviceGetHandleByIndex(0)
print(json.dumps({"uuid": pynvml.nvmlDeviceGetUUID(h), "name": pynvml.nvmlDeviceGetName(h),
                  "total": int(pynvml.nvmlDeviceGetMemoryInfo(h).total)}))
"""
_TORCH_PROBE = """
import json, torch
print(json.dumps([torch.__version__, torch.version.cuda, torch.cuda.is_available()]))
"""


@dataclass(frozen=True)
class Gpu:
    uuid: str
    name: str
    total: int


def real_driver_env() -> dict[str, str]:
    """This process's environment without anything that would load simgpu's fake driver."""
    sim_dirs = {str(native.native_dir(f).resolve()) for f in native.FLAVOURS}
    env = {k: v for k, v in os.environ.items() if k not in ("SIMGPU_STATE", "LD_PRELOAD")}
    paths = [
        p for p in env.get("LD_LIBRARY_PATH", "").split(":") if p and os.path.realpath(p) not in sim_dirs
    ]
    if paths:
        env["LD_LIBRARY_PATH"] = ":".join(paths)
    else:
        env.pop("LD_LIBRARY_PATH", None)
    return env


def probe_json(code: str, env: Mapping[str, str], what: str) -> Any:
    r = subprocess.run(
        [sys.executable, "-c", code],
        env=dict(env),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )
    if r.returncode != 0:
        pytest.fail(f"{what} failed ({r.returncode}):\n{r.stderr[-4000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def first_gpu(env: Mapping[str, str]) -> Gpu:
    g = probe_json(_GPU_PROBE, env, "reading GPU 0 through NVML")
    return Gpu(g["uuid"], g["name"], g["total"])


def require_torch(env: Mapping[str, str]) -> None:
    """tests/gpu runs PyTorch on the GPU: without it that is a setup error, not a skip."""
    r = subprocess.run(
        [sys.executable, "-c", _TORCH_PROBE], env=dict(env), capture_output=True, text=True, timeout=TIMEOUT
    )
    if r.returncode != 0:
        pytest.fail(
            "PyTorch is not installed in this venv; tests/gpu needs it (bench/gpu_suite.sh installs it: "
            f"{sys.executable} -m pip install torch):\n{r.stderr.strip().splitlines()[-1:]}"
        )
    version, cuda, available = json.loads(r.stdout.strip().splitlines()[-1])
    if not available:
        pytest.fail(f"PyTorch {version} (CUDA {cuda}) cannot use the GPU that NVML reports")


def gpu_env(
    base: Mapping[str, str], gpu: Gpu, container: Container | Path | None = None, **extra: str
) -> dict[str, str]:
    """A workload's environment on `gpu`: under the shim for `container`, or plain."""
    env = dict(base)
    if container is not None:
        env = build.shim_env(container.dir if isinstance(container, Container) else container, "release", env)
    env["CUDA_VISIBLE_DEVICES"] = gpu.uuid
    env["GPUFRAC_TEST_GPU_UUID"] = gpu.uuid
    env.update(extra)
    return env


def assert_real_driver_in_process() -> None:
    """The agent's side (arbiter, checkpoint calls) runs in this test process: it must be
    talking to the real NVML and libcuda, not simgpu's fakes (loaded by earlier tests, or
    found first through LD_LIBRARY_PATH)."""
    sim = [str(native.native_dir(f).resolve()) for f in native.FLAVOURS]
    ldpath = [os.path.realpath(p) for p in os.environ.get("LD_LIBRARY_PATH", "").split(":") if p]
    assert not os.environ.get("SIMGPU_STATE"), "SIMGPU_STATE is set in the test process"
    assert not set(ldpath) & set(sim), f"LD_LIBRARY_PATH names simgpu's fake driver ({sim}); unset it"
    with open("/proc/self/maps") as f:
        fakes = {
            line.split()[-1] for line in f if any(line.rstrip().endswith(d) or d + "/" in line for d in sim)
        }
    assert not fakes, (
        f"this test process has simgpu's fake driver loaded ({sorted(fakes)}): run tests/gpu in a pytest "
        "process of its own (bench/gpu_suite.sh does)"
    )


def aligned(n: float) -> int:
    """`n` bytes down to whole 2 MiB pages: what PyTorch's caching allocator asks the driver
    for exactly, so a test's sizes are the bytes counted."""
    return int(n) // (2 * MiB) * (2 * MiB)


def gpu_pids(gpu: Gpu) -> dict[int, int]:
    """Processes holding memory on the GPU and how much, as NVML (nvidia-smi) shows them, read
    in a fresh process of the real driver (this one may have simgpu's NVML loaded)."""
    code = (
        "import json, pynvml\n"
        "pynvml.nvmlInit()\n"
        f"h = pynvml.nvmlDeviceGetHandleByUUID({gpu.uuid!r})\n"
        "procs = pynvml.nvmlDeviceGetComputeRunningProcesses(h)\n"
        "print(json.dumps({p.pid: p.usedGpuMemory for p in procs}))\n"
    )
    listed = probe_json(code, real_driver_env(), "NVML's process list")
    return {int(k): int(v or 0) for k, v in listed.items()}


def assert_container_view(info: dict[str, Any], limit: int) -> int:
    """total = limit and free = limit - container usage, in CUDA and in NVML; returns the usage."""
    used = info["usage"]["total_used"]
    assert 0 < used <= limit
    mg = info["mem_get_info"]
    assert (mg["total"], mg["free"]) == (limit, limit - used), info
    for version in ("v1", "v2"):
        n = info["nvml"][version]
        assert (n["total"], n["free"], n["used"]) == (limit, limit - used, used), (version, info)
    assert info["nvml"]["v2"]["reserved"] == 0
    return used


def beyond_allocator(info: dict[str, Any]) -> int:
    """What the shim counts for the container besides PyTorch's reservations (the context)."""
    return int(info["usage"]["total_used"] - info["reserved"])


def record(name: str, data: Mapping[str, Any]) -> None:
    """A measurement for bench/gpu_suite.sh's report (nothing is written without $GPUFRAC_GPU_RESULTS)."""
    out = os.environ.get(RESULTS_ENV)
    if not out:
        return
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / f"{name}.json").write_text(json.dumps(dict(data), indent=2) + "\n")


class Worker:
    """A running torch_worker.py: `call(op, **args)` sends one request and returns its reply."""

    def __init__(self, proc: subprocess.Popen[Any], name: str = "worker") -> None:
        self.proc = proc
        self.name = name
        self._lines: queue.Queue[str] = queue.Queue()
        # A reader thread owns stdout, so a reply can be waited for with a deadline.
        threading.Thread(target=self._pump, daemon=True).start()
        ready = self.answer()
        assert ready.get("ready"), f"{name} did not start: {ready}"
        self.pid: int = ready["pid"]
        self.ready = ready  # what it saw once its context existed (info(), t_ready)

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line.decode() if isinstance(line, bytes) else line)
        self._lines.put("")

    def send(self, op: str, **args: Any) -> None:
        assert self.proc.stdin is not None
        data = json.dumps({"op": op, **args}) + "\n"
        stdin: Any = self.proc.stdin
        stdin.write(data if isinstance(stdin, io.TextIOBase) else data.encode())
        stdin.flush()

    def answer(self, timeout: float = TIMEOUT) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(
                f"{self.name} (pid {self.proc.pid}) answered nothing within {timeout:.0f}s"
            ) from None
        if not line:
            err = self.proc.stderr.read() if self.proc.stderr else ""
            raise AssertionError(f"{self.name} exited ({self.proc.wait(30)}) without an answer:\n{err}")
        return json.loads(line)

    def call(self, op: str, timeout: float = TIMEOUT, **args: Any) -> dict[str, Any]:
        self.send(op, **args)
        return self.answer(timeout)

    def ok(self, op: str, timeout: float = TIMEOUT, **args: Any) -> dict[str, Any]:
        """call() that must succeed."""
        r = self.call(op, timeout, **args)
        assert r["ok"], f"{self.name}: {op} {args} failed: {r.get('error')}\n{r.get('trace', '')}"
        return r

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send("exit")
                self.proc.wait(60)
            except (OSError, subprocess.TimeoutExpired, ValueError):
                self.proc.kill()
                self.proc.wait(60)


def start_worker(env: Mapping[str, str], name: str = "worker") -> Worker:
    p = subprocess.Popen(
        [sys.executable, str(TORCH_WORKER)],
        env=dict(env),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        return Worker(p, name)
    except BaseException:
        p.kill()
        raise


# -- fixtures (imported by the test modules) ------------------------------------------------------


@pytest.fixture(scope="session")
def gpu(real_env: dict[str, str]) -> Gpu:
    """GPU 0 of the node, and PyTorch able to use it."""
    require_torch(real_env)
    return first_gpu(real_env)


@pytest.fixture
def spawn() -> Iterator[Callable[..., Worker]]:
    """spawn(env, name) -> a started torch_worker.py; every one is stopped after the test."""
    started: list[Worker] = []

    def make(env: Mapping[str, str], name: str = "worker") -> Worker:
        w = start_worker(env, name)
        started.append(w)
        return w

    try:
        yield make
    finally:
        for w in started:
            w.close()


def arbiter_harness() -> ModuleType:
    """tests/fixtures/arbiter_harness.py, reused: the ledger, pod identity on the
    apiserver emulator, the arbiter on its own loop and containers in real cgroups. Only
    its ArbiterNode is used here (its make_node fixture would load simgpu's NVML)."""
    from tests.fixtures import arbiter_harness  # a fixture module of tests/ (tests/conftest.py registers it)

    return arbiter_harness
