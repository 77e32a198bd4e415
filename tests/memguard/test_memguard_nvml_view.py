"""NVML under the shim shows only the caller's container.

Two containers share one simulated GPU, each with a process under the shim that
holds memory and has run kernels. pynvml in container A (the real nvidia-ml-py,
reaching NVML through dlsym on its handle) lists A's processes only, in every
version of every per-process query, with NVML's buffer-size rules applied to
what A may see; BAR1 is A's share. Without the shim the same queries list both
(the driver's truth, checked against the node state)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Callable
from typing import Any

import pytest

from gpufrac.core import native
from gpufrac.memguard import abi
from gpufrac.simgpu.nodestate import NodeState
from tests.fixtures.memguard import LIMIT, Container, MiB, Shim, read_line

QUERIES = """
import ctypes as C, json, os, sys, time
import pynvml as N
from cuda.bindings import driver as cu

def chk(r):
    if int(r[0]) != 0:
        raise SystemExit(f"CUDA error {r!r}")
    return r[1] if len(r) == 2 else r[1:]

chk(cu.cuInit(0))
ctx = chk(cu.cuDevicePrimaryCtxRetain(chk(cu.cuDeviceGet(0))))
chk(cu.cuCtxSetCurrent(ctx))
buf = chk(cu.cuMemAlloc(16 << 20))
fn = chk(cu.cuModuleGetFunction(chk(cu.cuModuleLoadData(b"SIMGPU-MODULE")), b"busy_us"))
arg = C.c_uint64(200000)  # busy for 0.2 s: a utilisation sample exists
params = (C.c_void_p * 1)(C.addressof(arg))
chk(cu.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, 0, C.addressof(params), 0))

N.nvmlInit()
h = N.nvmlDeviceGetHandleByIndex(0)
lib = N.nvmlLib

def raw_v1(name):
    # The legacy (v1) record: pid, usedGpuMemory. No pynvml wrapper calls it.
    class Info(C.Structure):
        _fields_ = [("pid", C.c_uint), ("usedGpuMemory", C.c_ulonglong)]
    f = getattr(lib, name)
    n = C.c_uint(0)
    rc = f(h, C.byref(n), None)
    if rc == 0:
        return {"size_rc": 0, "size": n.value, "pids": []}
    size = n.value
    arr = (Info * (size + 4))()
    n2 = C.c_uint(size + 4)
    rc2 = f(h, C.byref(n2), arr)
    return {"size_rc": rc, "size": size, "rc": rc2, "pids": sorted(arr[i].pid for i in range(n2.value))}

def too_small(name):
    # A one-entry buffer: enough for what the caller may see, not for the whole GPU.
    f = getattr(lib, name)
    arr = (N.c_nvmlProcessInfo_v3_t * 1)()
    n = C.c_uint(1)
    rc = f(h, C.byref(n), arr)
    return {"rc": rc, "n": n.value, "pid": arr[0].pid if rc == 0 else None}

def pids(procs):
    return sorted(p.pid for p in procs)

def util_pids(fn):
    try:
        return sorted(s.pid for s in fn(h, 0))
    except N.NVMLError_NotFound:
        return []

out = {"me": os.getpid()}
out["v1"] = raw_v1("nvmlDeviceGetComputeRunningProcesses")
out["v2"] = pids(N.nvmlDeviceGetComputeRunningProcesses_v2(h))
out["v3"] = pids(N.nvmlDeviceGetComputeRunningProcesses_v3(h))
out["v3_small"] = too_small("nvmlDeviceGetComputeRunningProcesses_v3")
detail = N.nvmlDeviceGetRunningProcessDetailList(h, N.nvmlProcessDetailList_v1, N.NVML_PROCESS_MODE_COMPUTE)
out["detail"] = pids(detail or [])
out["graphics_v1"] = raw_v1("nvmlDeviceGetGraphicsRunningProcesses")
out["graphics_v2"] = pids(N.nvmlDeviceGetGraphicsRunningProcesses_v2(h))
out["graphics_v3"] = pids(N.nvmlDeviceGetGraphicsRunningProcesses_v3(h))
out["mps_v1"] = raw_v1("nvmlDeviceGetMPSComputeRunningProcesses")
out["mps_v3"] = pids(N.nvmlDeviceGetMPSComputeRunningProcesses_v3(h))
out["util"] = util_pids(N.nvmlDeviceGetProcessUtilization)
out["util_info"] = util_pids(N.nvmlDeviceGetProcessesUtilizationInfo)
b = N.nvmlDeviceGetBAR1MemoryInfo(h)
out["bar1"] = [b.bar1Total, b.bar1Free, b.bar1Used]
print(json.dumps(out))
"""


def _run(env: dict[str, str]) -> dict[str, Any]:
    p = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(QUERIES)], env=env, capture_output=True, text=True, timeout=180
    )
    assert p.returncode == 0, f"queries failed ({p.returncode}):\n{p.stdout}\n{p.stderr}"
    return dict(json.loads(p.stdout.strip().splitlines()[-1]))


def local(shim: Shim, c: Container) -> dict[str, str]:
    """simgpu's NVML reports pids of the namespace the simulated node runs in, which
    is this test's (the initial one on a host, or a CI container's): say so."""
    return shim.env(c, MEMGUARD_NVML_PIDS="local")


@pytest.fixture
def neighbour(shim: Shim, container: Callable[..., Container]):  # type: ignore[no-untyped-def]
    """A process of another container on the same GPU: memory held, a kernel run."""
    p = shim.ctest_popen(container(), "alloc", 8 * MiB, "launch", "hold")
    try:
        assert [read_line(p).split()[:2] for _ in range(4)] == [
            ["init", "0"],
            ["alloc", "0"],
            ["launch", "0"],
            ["hold", "0"],
        ]
        yield p.pid
    finally:
        p.kill()
        p.wait()


def test_nvml_lists_only_the_callers_container(
    shim: Shim, container: Callable[..., Container], neighbour: int
) -> None:
    c = container()
    out = _run(local(shim, c))
    me = out["me"]
    assert neighbour != me
    assert out["v1"] == {"size_rc": 7, "size": 1, "rc": 0, "pids": [me]}  # INSUFFICIENT_SIZE: 1, not 2
    assert out["v2"] == out["v3"] == out["detail"] == [me]
    assert out["v3_small"] == {"rc": 0, "n": 1, "pid": me}  # one slot is enough for what A sees
    assert out["util"] == out["util_info"] == [me]
    # No graphics or MPS clients on a compute node: empty, under the shim too.
    assert out["graphics_v1"] == out["mps_v1"] == {"size_rc": 0, "size": 0, "pids": []}
    assert out["graphics_v2"] == out["graphics_v3"] == out["mps_v3"] == []
    total, free, used = out["bar1"]
    assert total == LIMIT and free + used == total and 0 < free <= LIMIT


def test_without_the_shim_nvml_shows_every_process(
    shim: Shim, container: Callable[..., Container], neighbour: int
) -> None:
    """The control: the driver's view holds both processes, so the filtered view
    above is the shim's doing."""
    env = local(shim, container())
    # The same builds, minus the shim (the ASan runtime still first).
    env["LD_PRELOAD"] = " ".join(native.asan_runtime()) if shim.flavour == "asan" else ""
    out = _run(env)
    both = sorted([out["me"], neighbour])
    assert out["v1"]["pids"] == out["v2"] == out["v3"] == out["detail"] == both
    assert out["v3_small"]["rc"] == 7 and out["v3_small"]["n"] == 2
    assert out["util"] == out["util_info"] == both
    node = NodeState(shim.sim_env["SIMGPU_STATE"])
    try:
        assert neighbour in {pr.pid for pr in node.live_procs()}
    finally:
        node.close()
    assert out["bar1"][0] == 128 << 30  # H100 80 GB: a 128 GiB aperture


def test_a_process_of_the_container_sees_its_siblings(
    shim: Shim, container: Callable[..., Container], neighbour: int
) -> None:
    """Every process of the container running the shim is listed, not only the caller."""
    c = container()
    p = shim.ctest_popen(c, "alloc", 4 * MiB, "hold")
    try:
        assert [read_line(p).split()[:2] for _ in range(3)] == [["init", "0"], ["alloc", "0"], ["hold", "0"]]
        out = _run(local(shim, c))
    finally:
        p.kill()
        p.wait()
    assert out["v3"] == sorted([out["me"], p.pid])
    assert neighbour not in out["v2"]


def test_unknown_pid_namespace_lists_nothing(
    shim: Shim, container: Callable[..., Container], neighbour: int
) -> None:
    """Where NVML's pids cannot be matched to the container's (another pid namespace,
    here forced), nothing is listed: never a neighbour."""
    out = _run(shim.env(container(), MEMGUARD_NVML_PIDS="none"))
    assert out["v3"] == out["v2"] == out["detail"] == out["util"] == []


def test_a_stale_slot_does_not_show_the_process_that_reused_its_pid(
    shim: Shim, container: Callable[..., Container], neighbour: int
) -> None:
    """A slot left by a dead process of the container, whose pid a neighbour's process
    now has (pid reuse): its recorded start time is not that process's, so the
    neighbour stays hidden."""
    c = container()
    usage = abi.UsageFile(c.dir)
    try:
        slot = usage.usage.slots[abi.MAX_PROCS - 1]
        slot.start_time = 1  # a process that started at boot, long gone
        slot.pid = neighbour
        del slot  # no view into the mapping may outlive it
    finally:
        usage.close()
    out = _run(local(shim, c))
    assert out["v3"] == out["v1"]["pids"] == out["util"] == [out["me"]]
