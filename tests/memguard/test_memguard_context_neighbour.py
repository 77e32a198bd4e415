"""memguard: a neighbour busy on the same GPU does not move a process's context charge.

A context's memory is measured around its creation. Another tenant allocating
(or freeing) on the GPU meanwhile must not land on the victim's count: that
would give the victim false OOMs inside its guarantee (or under-charge a tenant
that frees elsewhere while it creates contexts). Where NVML names this process
(its pids are this namespace's, or it found its own host pid at its first
context) the charge is the driver's per-process figure, exact whatever the
neighbours do; where it cannot, the device-wide reading is bounded by what a
context can take (docs/architecture.md, "context charge").

Real processes on a simulated node whose contexts cost CTX and take 20 ms to set
up: a neighbour without the shim keeps allocating and freeing GiBs while the
victim, under the shim, creates and destroys contexts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator

import pytest

from gpufrac.core import native
from gpufrac.simgpu.spec import create_node, spec_from_dict
from tests.fixtures.memguard import TIMEOUT, Container, MiB, Shim, read_line
from tests.fixtures.simnode import SimNode

CTX = 512 * MiB
GiB = 1024 * MiB
CTX_MAX = 1 * GiB  # the shim's ceiling on a context measured device-wide (mg_ctx.c)
ROUNDS = 12

PRE = """
import json, os, select, sys
from cuda.bindings import driver as cu
def chk(r):
    rc = int(r[0] if isinstance(r, tuple) else r)
    if rc != 0:
        raise SystemExit(f"CUDA error {r!r}")
    return r[1] if isinstance(r, tuple) and len(r) == 2 else r
def say(**kw):
    print(json.dumps(kw), flush=True)
chk(cu.cuInit(0))
dev = chk(cu.cuDeviceGet(0))
"""

# Allocates 256 MiB every half millisecond up to 12 GiB, frees it all, again,
# until its stdin closes: device-wide used memory swings by GiBs within any
# 20 ms context creation of the victim.
NEIGHBOUR = """
ctx = chk(cu.cuDevicePrimaryCtxRetain(dev))
chk(cu.cuCtxSetCurrent(ctx))
held = []
say(step="churning")
while True:
    if select.select([sys.stdin], [], [], 0.0005)[0]:
        break
    if len(held) < 48:
        held.append(chk(cu.cuMemAlloc(256 * 2**20)))
    else:
        for p in held:
            chk(cu.cuMemFree(p))
        held = []
"""

VICTIM = f"""
from gpufrac.memguard import abi
DIR = os.environ["GPUFRAC_CONTAINER_DIR"]
def used():
    return int(abi.read_usage(DIR).total_used)
out = []
for i in range({ROUNDS}):
    before = used()
    r = cu.cuCtxCreate(None, 0, dev)
    rc = int(r[0])
    out.append({{"rc": rc, "charge": used() - before}})
    if rc == 0:
        chk(cu.cuCtxDestroy(r[1]))
say(rounds=out, left=used())
"""


@pytest.fixture
def ctx_shim(make_sim_node: Callable[..., SimNode], flavour: str) -> Shim:
    node = make_sim_node("dgx-h100", flavour=flavour)
    spec = spec_from_dict({"preset": "dgx-h100", "gpu_defaults": {"context_memory": CTX}})
    create_node(spec, node.path)
    native.library(native.FAKE_CUDA, flavour)
    return Shim(node.env, flavour)


@pytest.fixture
def neighbour(ctx_shim: Shim) -> Iterator[subprocess.Popen[str]]:
    """Another tenant on GPU 0 that does not load the shim, churning memory."""
    env = dict(os.environ)
    env.update(ctx_shim.sim_env)
    if ctx_shim.flavour == "asan":  # the sanitized fake driver needs its runtimes first
        env["LD_PRELOAD"] = ":".join(native.asan_runtime())
        env.setdefault("ASAN_OPTIONS", "detect_leaks=0:abort_on_error=1")
    p = subprocess.Popen(
        [sys.executable, "-c", PRE + NEIGHBOUR],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = read_line(p)
        assert json.loads(line)["step"] == "churning", (line, p.stderr and p.stderr.read())
        yield p
    finally:
        if p.poll() is None:
            p.stdin.close()
            p.wait(timeout=TIMEOUT)


def victim(shim: Shim, c: Container, **env: str) -> dict:
    p = subprocess.run(
        [sys.executable, "-c", PRE + textwrap.dedent(VICTIM)],
        env=shim.env(c, **env),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert p.returncode == 0, f"victim failed ({p.returncode}):\n{p.stdout}\n{p.stderr}"
    return json.loads(p.stdout.splitlines()[-1])


def test_a_neighbour_churning_memory_never_moves_the_context_charge(
    ctx_shim: Shim, neighbour: subprocess.Popen[str], container: Callable[..., Container]
) -> None:
    """NVML names the victim's process: every context is charged exactly what
    the driver shows for it, with GiBs allocated and freed next to it meanwhile,
    and a 2 GiB container never sees a false OOM."""
    c = container(request=2 * GiB, limit=2 * GiB)
    out = victim(ctx_shim, c, MEMGUARD_NVML_PIDS="local")
    assert neighbour.poll() is None, "the neighbour stopped churning"
    assert out["rounds"] == [{"rc": 0, "charge": CTX}] * ROUNDS
    assert out["left"] == 0


def test_with_host_pids_the_process_learns_its_own_and_is_charged_exactly(
    ctx_shim: Shim, neighbour: subprocess.Popen[str], container: Callable[..., Container]
) -> None:
    """NVML's pids are another namespace's (MEMGUARD_NVML_PIDS=host, as in a
    container): at its first context the process finds itself as the one process
    NVML newly lists (the neighbour was listed before), and from then on every
    context is charged the driver's figure for it, exactly, while the neighbour
    churns."""
    c = container(request=2 * GiB, limit=2 * GiB)
    out = victim(ctx_shim, c, MEMGUARD_NVML_PIDS="host")
    assert neighbour.poll() is None, "the neighbour stopped churning"
    assert out["rounds"] == [{"rc": 0, "charge": CTX}] * ROUNDS
    assert out["left"] == 0


def test_without_per_process_figures_the_charge_stays_bounded(
    ctx_shim: Shim, neighbour: subprocess.Popen[str], container: Callable[..., Container]
) -> None:
    """NVML's pids cannot be matched to this process (MEMGUARD_NVML_PIDS=none):
    the device-wide reading is used, and a neighbour's allocations in the window
    raise a context's charge at most to the ceiling, never by GiBs; the victim
    gets no OOM inside its 2 GiB and gives back what it was charged."""
    c = container(request=2 * GiB, limit=2 * GiB)
    out = victim(ctx_shim, c, MEMGUARD_NVML_PIDS="none")
    assert neighbour.poll() is None, "the neighbour stopped churning"
    for r in out["rounds"]:
        assert r["rc"] == 0, out
        assert 0 <= r["charge"] <= CTX_MAX, out
    assert out["left"] == 0
