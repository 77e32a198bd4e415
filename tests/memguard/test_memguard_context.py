"""memguard: a process's context, modules and limits are charged to its container.

A CUDA context takes device memory per process (hundreds of MiB on an H100), and so
do loaded modules and what cuCtxSetLimit reserves (every resident thread's stack,
the device malloc heap). NVML counts all of it per process; the shim measures it
around each call and charges it to the container, so several processes of one
container hit the limit where NVML says they should, and the count follows NVML's
exactly on a quiet GPU. Released memory (primary context released to zero, context
destroyed, module unloaded) is uncounted.

Real processes under the real shim on the dgx-h100 preset, whose contexts cost
CTX bytes each as on an H100 (docs/simgpu.md), release and ASan+UBSan builds.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Callable

import pytest

from gpufrac.simgpu.nodestate import NodeState
from gpufrac.simgpu.spec import load_preset
from tests.fixtures.memguard import NVML, TIMEOUT, Container, MiB, Shim, read_line
from tests.fixtures.simnode import SimNode

CTX = load_preset("dgx-h100").gpus[0].context_memory  # the H100 estimate (docs/simgpu.md)
MOD = 8 * MiB
OOM = 2

# Helpers of every workload here (nvml() too); unlike tests.fixtures.memguard' prelude,
# no context yet.
PRE = """
import ctypes, json, os, sys
from cuda.bindings import driver as cu
from gpufrac.memguard import abi
DIR = os.environ["GPUFRAC_CONTAINER_DIR"]
def rc(r):
    return int(r[0] if isinstance(r, tuple) else r)
def chk(r):
    if rc(r) != 0:
        raise SystemExit(f"CUDA error {r!r}")
    return r[1] if len(r) == 2 else r[1:]
def used():
    return int(abi.read_usage(DIR).total_used)
def say(**kw):
    print(json.dumps(kw), flush=True)
chk(cu.cuInit(0))
dev = chk(cu.cuDeviceGet(0))
"""
PRE += NVML


@pytest.fixture
def ctx_shim(make_sim_node: Callable[..., SimNode], flavour: str) -> Shim:
    """The shim on the preset as it is: every context charged the H100 estimate."""
    assert 512 * MiB == CTX  # the figure docs/simgpu.md states; the sizes below rely on it
    node = make_sim_node("dgx-h100", flavour=flavour)
    return Shim(node.env, flavour)


def run(shim: Shim, c: Container, body: str) -> list[dict]:
    p = subprocess.run(
        [sys.executable, "-c", PRE + textwrap.dedent(body)],
        env=shim.env(c),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert p.returncode == 0, f"workload failed ({p.returncode}):\n{p.stdout}\n{p.stderr}"
    return [json.loads(ln) for ln in p.stdout.splitlines() if ln.startswith("{")]


def start(shim: Shim, c: Container, body: str) -> subprocess.Popen[str]:
    """A workload process of `c` that we talk to line by line (see stop())."""
    return subprocess.Popen(
        [sys.executable, "-c", PRE + body],
        env=shim.env(c),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def stop(procs: list[subprocess.Popen[str]]) -> None:
    """Let each still running process finish: closing its stdin ends its wait."""
    for p in procs:
        if p.poll() is None:
            p.stdin.close()
            p.wait(timeout=TIMEOUT)


def nvml_used(shim: Shim, pid: int) -> int:
    """The memory NVML shows for `pid` (the fake driver's per-process figure)."""
    with NodeState(shim.sim_env["SIMGPU_STATE"]) as node:
        return sum(p.used_bytes for p in node.live_procs() if p.pid == pid)


HOLD = f"""
ctx = chk(cu.cuDevicePrimaryCtxRetain(dev))
chk(cu.cuCtxSetCurrent(ctx))
mod = chk(cu.cuModuleLoadData(b"SIMGPU-MODULE:{MOD}\\0"))
say(step="held", used=used())
sys.stdin.readline()
"""


def test_each_process_context_and_module_count_and_the_third_does_not_fit(
    ctx_shim: Shim, container: Callable[..., Container]
) -> None:
    """Two processes of a 1400 MiB container each hold a context (512 MiB) and a
    module (8 MiB): the container's count is what NVML shows for them, exactly. A
    third process's context would take the container past its limit: its
    cuDevicePrimaryCtxRetain fails with CUDA_ERROR_OUT_OF_MEMORY, as it would on a
    full GPU, and it holds nothing on the GPU."""
    c = container(request=1400 * MiB, limit=1400 * MiB)
    procs = [start(ctx_shim, c, HOLD) for _ in range(2)]
    try:
        for p in procs:
            line = read_line(p)
            assert json.loads(line)["step"] == "held", line
        per_process = [nvml_used(ctx_shim, p.pid) for p in procs]
        assert per_process == [CTX + MOD, CTX + MOD]
        assert c.total() == sum(per_process)

        third = run(
            ctx_shim,
            c,
            """
            r = cu.cuDevicePrimaryCtxRetain(dev)
            say(rc=rc(r), used=used())
            """,
        )
        assert third == [{"rc": OOM, "used": 2 * (CTX + MOD)}]
    finally:
        stop(procs)
    assert c.total() == 0


def test_context_module_and_limits_counted_and_released(
    ctx_shim: Shim, container: Callable[..., Container]
) -> None:
    """In one process: the context and a module are charged; a larger malloc heap
    and stack are charged by what they take (the stack: every resident thread of
    the GPU's 132 SMs); what is left under the limit is all an allocation may take
    (cuMemGetInfo says so); a limit past it fails with OUT_OF_MEMORY and stays as it
    was; unloading, lowering and releasing uncount exactly what was counted."""
    c = container(request=1024 * MiB, limit=1024 * MiB)
    heap, stack_extra = 64 * MiB, 512
    stack_bytes = stack_extra * 132 * 2048
    out = run(
        ctx_shim,
        c,
        f"""
        ctx = chk(cu.cuDevicePrimaryCtxRetain(dev))
        chk(cu.cuCtxSetCurrent(ctx))
        say(step="ctx", used=used(), nvml=nvml())
        mod = chk(cu.cuModuleLoadData(b"SIMGPU-MODULE:{MOD}\\0"))
        say(step="module", used=used(), nvml=nvml())
        chk(cu.cuCtxSetLimit(cu.CUlimit.CU_LIMIT_MALLOC_HEAP_SIZE, 8 * 2**20 + {heap}))
        chk(cu.cuCtxSetLimit(cu.CUlimit.CU_LIMIT_STACK_SIZE, 1024 + {stack_extra}))
        say(step="limits", used=used(), nvml=nvml())
        free, total = chk(cu.cuMemGetInfo())
        say(step="info", free=int(free), total=int(total))
        r = cu.cuMemAlloc(int(free) + 2 * 2**20)
        say(step="too-big", rc=rc(r))
        r = cu.cuCtxSetLimit(cu.CUlimit.CU_LIMIT_MALLOC_HEAP_SIZE, 8 * 2**20 + 512 * 2**20)
        heap_now = int(chk(cu.cuCtxGetLimit(cu.CUlimit.CU_LIMIT_MALLOC_HEAP_SIZE)))
        say(step="heap-too-big", rc=rc(r), heap=heap_now, used=used())
        chk(cu.cuCtxSetLimit(cu.CUlimit.CU_LIMIT_MALLOC_HEAP_SIZE, 8 * 2**20))
        say(step="heap-lowered", used=used(), nvml=nvml())
        chk(cu.cuModuleUnload(mod))
        say(step="unloaded", used=used(), nvml=nvml())
        chk(cu.cuDevicePrimaryCtxRelease(dev))
        say(step="released", used=used(), nvml=nvml())
        """,
    )
    by = {o["step"]: o for o in out}
    assert by["ctx"] == {"step": "ctx", "used": CTX, "nvml": CTX}
    assert by["module"]["used"] == by["module"]["nvml"] == CTX + MOD
    held = CTX + MOD + heap + stack_bytes
    assert by["limits"]["used"] == by["limits"]["nvml"] == held
    assert by["info"]["total"] == 1024 * MiB and by["info"]["free"] == 1024 * MiB - held
    assert by["too-big"]["rc"] == OOM
    assert by["heap-too-big"] == {"step": "heap-too-big", "rc": OOM, "heap": 8 * MiB + heap, "used": held}
    assert by["heap-lowered"]["used"] == by["heap-lowered"]["nvml"] == held - heap
    assert by["unloaded"]["used"] == by["unloaded"]["nvml"] == held - heap - MOD
    assert by["released"] == {"step": "released", "used": 0, "nvml": 0}


def test_a_created_context_goes_with_its_modules(ctx_shim: Shim, container: Callable[..., Container]) -> None:
    """cuCtxCreate is charged like the primary context; cuCtxDestroy uncounts it
    and the module loaded in it (the driver frees both); a context that does not
    fit is refused with OUT_OF_MEMORY and left nowhere."""
    c = container(request=1100 * MiB, limit=1100 * MiB)
    out = run(
        ctx_shim,
        c,
        f"""
        prim = chk(cu.cuDevicePrimaryCtxRetain(dev))
        chk(cu.cuCtxSetCurrent(prim))
        own = chk(cu.cuCtxCreate(None, 0, dev))
        mod = chk(cu.cuModuleLoadData(b"SIMGPU-MODULE:{MOD}\\0"))
        say(step="two", used=used())
        r = cu.cuCtxCreate(None, 0, dev)
        say(step="third", rc=rc(r), used=used())
        chk(cu.cuCtxDestroy(own))
        say(step="destroyed", used=used())
        """,
    )
    by = {o["step"]: o for o in out}
    assert by["two"]["used"] == 2 * CTX + MOD
    assert by["third"] == {"step": "third", "rc": OOM, "used": 2 * CTX + MOD}
    assert by["destroyed"]["used"] == CTX


def test_no_context_cost_counts_nothing_more(shim: Shim, container: Callable[..., Container]) -> None:
    """On a node whose contexts take nothing (context_memory 0, the `shim` fixture's
    node), the count is exactly the allocations: measuring adds nothing of its own."""
    c = container()
    out = shim.python(
        c,
        """
        mod = chk(cu.cuModuleLoadData(b"SIMGPU-MODULE\\0"))
        p = chk(cu.cuMemAlloc(4 * 2**20))
        out["used"] = used()
        """,
    )
    assert out == {"used": 4 * MiB}


def test_workers_starting_together_are_each_charged_their_own_context(
    ctx_shim: Shim, container: Callable[..., Container]
) -> None:
    """Four workers of one container create their contexts and load their modules at
    the same moment (a context takes time to set up, so the calls overlap): the
    measurements are taken in turn across the container, so no worker is charged
    for a sibling's context, and each one's count is what NVML shows for it."""
    c = container(request=4096 * MiB, limit=4096 * MiB)
    body = (
        """
import sys
sys.stdin.readline()
"""
        + HOLD
    )
    procs = [start(ctx_shim, c, body) for _ in range(4)]
    try:
        for p in procs:  # all of them up, waiting
            assert p.stdin is not None
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        for p in procs:
            line = read_line(p)
            assert json.loads(line)["step"] == "held", line
        per_process = [nvml_used(ctx_shim, p.pid) for p in procs]
        slots = {s.pid: int(s.used_bytes) for s in c.live_slots()}
        assert per_process == [CTX + MOD] * 4
        assert [slots.get(p.pid) for p in procs] == per_process
        assert c.total() == 4 * (CTX + MOD)
    finally:
        stop(procs)


def test_a_module_that_does_not_fit_is_refused_and_unloaded(
    ctx_shim: Shim, container: Callable[..., Container], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A module whose code and data would take the container past its limit fails
    to load with OUT_OF_MEMORY and leaves nothing on the GPU (NVML shows only the
    context); one loaded from a file (cuModuleLoad) is charged like one from memory."""
    image = tmp_path_factory.mktemp("mod") / "kernels.simgpu"
    image.write_bytes(b"SIMGPU-MODULE:%d\0" % (32 * MiB))
    c = container(request=600 * MiB, limit=600 * MiB)
    out = run(
        ctx_shim,
        c,
        f"""
        ctx = chk(cu.cuDevicePrimaryCtxRetain(dev))
        chk(cu.cuCtxSetCurrent(ctx))
        r = cu.cuModuleLoadData(b"SIMGPU-MODULE:{128 * MiB}\\0")
        say(step="big", rc=rc(r), used=used(), nvml=nvml())
        mod = chk(cu.cuModuleLoad({str(image)!r}.encode()))
        say(step="file", used=used(), nvml=nvml())
        """,
    )
    by = {o["step"]: o for o in out}
    assert by["big"] == {"step": "big", "rc": OOM, "used": CTX, "nvml": CTX}
    assert by["file"]["used"] == by["file"]["nvml"] == CTX + 32 * MiB
