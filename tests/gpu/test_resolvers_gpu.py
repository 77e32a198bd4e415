"""The arbiter's resolvers on a real GPU: PyTorch processes under the real shim in real
cgroups, the agent's ledger, pod identity (apiserver emulator) and arbiter in this
process, as on the simulated node (tests/fixtures/arbiter_harness.py, reused), but
with the real driver's memory, NVML and checkpoint API.

Each scenario books most of the GPU for a pod that never runs, so the few GiB left are
where two containers' bursts collide; the rest is the default node config. Each container
requests REQUEST_GIB and first allocates what its request leaves beside its context (which
the shim charges to it).

* wait: a burst that does not fit waits until the other container frees, then is granted;
  recorded: how long after the free the waiter's allocation returned (goal in the report);
* evict: a higher-priority burst kills the lower-priority borrower and is granted;
  recorded: the burst's request to its grant, the kill included;
* swap: a burst swaps an idle container to host RAM with the driver's checkpoint API; the
  victim's next GPU work brings it back, at the same addresses, every word intact.

These need the Kubernetes client and kmock (pod identity on the apiserver emulator):
bench/gpu_suite.sh runs this module apart from the others, after installing the wheels
bench/gpu_prepare.sh carries for them.
"""
# ruff: noqa: F811 - pytest fixtures imported from gpu_support are parameters here

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from gpu_support import (  # noqa: F401
    TORCH_WORKER,
    Gpu,
    Worker,
    aligned,
    arbiter_harness,
    assert_real_driver_in_process,
    gpu,
    gpu_env,
    gpu_pids,
    probe_json,
    record,
)

from gpufrac.agent.arbiter.resolvers import REASON_EVICTED
from gpufrac.agent.arbiter.swap import resolver as swap_mod
from gpufrac.core.slices import MEMORY
from gpufrac.deviceplugin.server import container_response
from gpufrac.memguard import abi, build
from gpufrac.simgpu.runtime import mounts_of
from tests.fixtures.kube import KubeServer

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

MiB = 1 << 20
GiB = 1 << 30
POOL_GIB = 12  # memory slices left for the scenario's containers
REQUEST_GIB = 2  # each container's request
LEAVE = 64 * MiB  # left free by a burst "into everything"

Node = Any  # arbiter_harness.ArbiterNode (imported lazily, through gpu_support.arbiter_harness)
Box = Any

# Whether the driver has the checkpoint API (gpufrac.agent.arbiter.swap.checkpoint's own detection
# criteria), asked in a fresh process of the real driver.
_CKPT_PROBE = """
import json, os
from cuda.bindings import driver
from gpufrac.agent.arbiter.swap import checkpoint as ck
driver.cuInit(0)
err, version = driver.cuDriverGetVersion()
version = int(version)
missing = [s for s in ck.SYMBOLS if not ck.Checkpointer._resolves(driver, s, version)]
rc = None
if version >= ck.MIN_DRIVER_VERSION and not missing:
    r = driver.cuCheckpointProcessGetState(os.getpid())
    rc = int(r[0] if isinstance(r, tuple) else r)
print(json.dumps({"version": version, "min": ck.MIN_DRIVER_VERSION, "missing": missing, "rc": rc,
                  "not_supported": ck.CUDA_ERROR_NOT_SUPPORTED}))
"""


@pytest.fixture
def make_node(kube_server: KubeServer, real_env: dict[str, str], gpu: Gpu) -> Iterator[Callable[..., Node]]:
    """make_node(**config overrides) -> an ArbiterNode on this real GPU node."""
    assert_real_driver_in_process()
    harness = arbiter_harness()
    made: list[tuple[Node, str]] = []

    def make(**overrides: Any) -> Node:
        state = tempfile.mkdtemp(prefix="gfg", dir="/tmp")  # short: the socket path
        config: dict[str, Any] = {"paths": {"stateDir": state, "shimHostPath": str(build.shim_path())}}
        config.update(overrides)
        node = harness.ArbiterNode(kube_server, config)
        made.append((node, state))
        assert node.gpu == gpu.uuid, "the ledger's first GPU is not NVML's GPU 0"
        # Everything but POOL_GIB is booked by a pod that never runs: its guarantee is held.
        node.add("holder", node.ledger.geometry[node.gpu].slices(MEMORY) - POOL_GIB, start=False)
        return node

    try:
        yield make
    finally:
        for node, state in made:
            node.close()
            shutil.rmtree(state, ignore_errors=True)


def run_torch(node: Node, box: Box, real_env: dict[str, str], gpu: Gpu) -> Worker:
    """Start the container of `box`: torch_worker.py with what the device plugin's
    Allocate response gives it (LD_PRELOAD of the shim, its directory, the arbiter socket)."""
    resp = container_response(box.alloc, node.cfg)
    c = node.runtime.start(
        box.uid,
        "main",
        [sys.executable, str(TORCH_WORKER)],
        env=gpu_env(real_env, gpu),
        envs=dict(resp.envs),
        mounts=mounts_of(resp),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    box.container = c
    node.set_container_id(box.pod, box.uid, c.runtime_id)
    return Worker(c.proc, box.pod)


def guarantee(w: Worker) -> int:
    """What the container can allocate within its request beside the context it was charged."""
    n = aligned(REQUEST_GIB * GiB - w.ready["usage"]["total_used"] - 16 * MiB)
    assert n >= 256 * MiB, f"the context left too little of the {REQUEST_GIB} GiB request: {w.ready}"
    return n


def burst_into_everything(node: Node, box: Box, w: Worker) -> int:
    """`box` (holding its guarantee) bursts into all the arbiter would grant it but LEAVE.
    Not filled: cudaMalloc takes the physical memory at once, and NVML shows it."""
    free = node.on_loop(lambda: node.arbiter.grantable(box.alloc))
    n = (free - LEAVE) // (2 * MiB) * (2 * MiB)  # whole 2 MiB pages: PyTorch allocates exactly that
    assert n >= 512 * MiB, f"only {free} bytes grantable: the scenario needs room for a burst"
    w.ok("alloc", name="burst", bytes=n)
    assert box.config().grant_bytes > 0
    return n


def waiters(node: Node) -> int:
    return sum(len(v) for v in node.arbiter.queue.waiters.values())


def test_wait_is_granted_once_the_other_container_frees(
    make_node: Callable[..., Node], real_env: dict[str, str], gpu: Gpu
) -> None:
    node = make_node(resolvers=["wait"])
    a = node.add("a", REQUEST_GIB, "12Gi", start=False)
    b = node.add("b", REQUEST_GIB, "12Gi", wait_timeout="120s", start=False)
    wa, wb = run_torch(node, a, real_env, gpu), run_torch(node, b, real_env, gpu)
    wa.ok("alloc", name="guarantee", bytes=guarantee(wa))
    burst_into_everything(node, a, wa)
    wb.ok("alloc", name="guarantee", bytes=guarantee(wb))
    wb.send("alloc", name="burst", bytes=GiB, seed=2)  # does not fit: b's cudaMalloc waits
    node.until(lambda: waiters(node) == 1, timeout=60, what="b's burst waiting")
    assert b.config().grant_bytes == 0
    wa.ok("free", name="burst")
    freed = wa.ok("empty_cache")  # the cudaFree that releases a's burst happens in here
    r = wb.answer(timeout=180)
    assert r["ok"], r
    assert b.config().grant_bytes >= GiB - 8 * MiB
    assert wb.ok("check", name="burst")["bad_words"] == 0
    assert node.arbiter.stats.wait_timeouts == 0
    record(
        "resolver-wait",
        {
            "name": "resolver-wait",
            # b's allocation returned this long after a's empty_cache returned (negative: before)
            # and at most this long after it began.
            "granted_after_free_ms": round((r["t_done"] - freed["t_after"]) * 1e3, 2),
            "granted_after_free_began_ms": round((r["t_done"] - freed["t_before"]) * 1e3, 2),
        },
    )


def test_evict_kills_the_lower_priority_borrower(
    make_node: Callable[..., Node], real_env: dict[str, str], gpu: Gpu, kube_server: KubeServer
) -> None:
    node = make_node(resolvers=["evict", "wait"])
    low = node.add("low", REQUEST_GIB, "12Gi", priority=0, start=False)
    high = node.add("high", REQUEST_GIB, "12Gi", priority=1000, wait_timeout="120s", start=False)
    wl, wh = run_torch(node, low, real_env, gpu), run_torch(node, high, real_env, gpu)
    wl.ok("alloc", name="guarantee", bytes=guarantee(wl))
    burst_into_everything(node, low, wl)
    wh.ok("alloc", name="guarantee", bytes=guarantee(wh))
    t0 = time.monotonic()
    r = wh.ok("alloc", name="burst", bytes=2 * GiB, seed=3)  # granted once low is gone
    secs = r["t_done"] - t0
    assert low.container.proc.wait(60) == -9  # killed by host pid (SIGKILL)
    assert low.config().grant_bytes == 0 and low.used() == 0
    assert high.config().grant_bytes >= 2 * GiB - 8 * MiB
    assert wh.ok("check", name="burst")["bad_words"] == 0
    node.on_loop(lambda: node.identity.events.flush(30))
    evicted = [e for e in kube_server.events() if e["reason"] == REASON_EVICTED]
    assert [e["involvedObject"]["name"] for e in evicted] == ["low"]
    record("resolver-evict", {"name": "resolver-evict", "burst_granted_after_s": round(secs, 3)})


def checkpoint_support(real_env: dict[str, str]) -> None:
    """Skips (a documented driver capability) when the driver has no cuCheckpointProcess*."""
    p = probe_json(_CKPT_PROBE, real_env, "probing the driver's checkpoint API")
    if p["version"] < p["min"]:
        pytest.skip(
            f"driver capability: CUDA driver API {p['version']} < {p['min']} (CUDA 12.8 / driver r570) "
            "has no cuCheckpointProcess* API; swap cannot work on this node"
        )
    if p["missing"]:
        pytest.skip(f"driver capability: the driver does not export {', '.join(p['missing'])}")
    if p["rc"] == p["not_supported"]:
        pytest.skip("driver capability: the driver reports the checkpoint API unsupported on this GPU")


def test_swap_moves_an_idle_container_to_host_ram_and_back_intact(
    make_node: Callable[..., Node], real_env: dict[str, str], gpu: Gpu, kube_server: KubeServer
) -> None:
    checkpoint_support(real_env)
    node = make_node(
        resolvers=["swap", "evict", "wait"],
        swap={"idleThreshold": "1s", "lockTimeout": "60s", "defaultSwappable": True},
    )
    victim = node.add("victim", REQUEST_GIB, "12Gi", wait_timeout="300s", start=False)
    wv = run_torch(node, victim, real_env, gpu)
    wv.ok("alloc", name="guarantee", bytes=guarantee(wv), seed=11, on_device=True)
    wv.ok("alloc", name="burst", bytes=2 * GiB, seed=22, on_device=True)
    requester = node.add("requester", REQUEST_GIB, "12Gi", wait_timeout="300s", start=False)
    wr = run_torch(node, requester, real_env, gpu)
    wr.ok("alloc", name="guarantee", bytes=guarantee(wr))
    held = victim.used()
    assert wv.pid in gpu_pids(gpu)
    threshold = node.cfg.swap.idle_threshold
    node.until(
        lambda: any(
            h.alloc.key == victim.alloc.key and h.idle_s >= threshold
            for h in node.arbiter.resolution.holdings(node.gpu)
        ),
        timeout=60,
        what="the victim idle",
    )
    # More than is free, less than is free plus the victim's burst: only a swap makes room.
    free = node.on_loop(lambda: node.arbiter.grantable(requester.alloc))
    want = (free + GiB) // (2 * MiB) * (2 * MiB)
    t0 = time.monotonic()
    wr.ok("alloc", name="burst", bytes=want, timeout=600)
    out_s = time.monotonic() - t0
    swap = node.arbiter.swap
    assert swap is not None and swap.is_swapped(victim.alloc.key)
    assert wv.pid not in gpu_pids(gpu)  # its GPU memory is released (in host RAM now)
    assert victim.container.alive()
    assert node.v1.read_namespaced_pod("victim", "default").status.phase == "Running"
    assert swap.host_ram_used == held
    assert all(s.swapped for s in abi.read_usage(victim.alloc.directory).slots if s.pid > 0)
    # The requester is done; the victim's next GPU work (check: a kernel first) asks for its
    # memory back through the shim and waits for the restore.
    wr.ok("free", name="burst")
    wr.ok("free", name="guarantee")
    wr.ok("empty_cache")
    requester.container.stop()
    t0 = time.monotonic()
    try:
        r = wv.ok("check", name="burst", timeout=420)
    except AssertionError as e:
        raise AssertionError(
            "the swapped-out victim did not come back: its first CUDA call after the swap-out may block "
            "in the driver (locked by the checkpoint) before it reaches one the shim gates for swap-in "
            f"(launch, allocation); agent swap stats {swap.stats}"
        ) from e
    in_s = time.monotonic() - t0
    assert r["bad_words"] == 0 and r["same_address"], r
    r = wv.ok("check", name="guarantee")
    assert r["bad_words"] == 0 and r["same_address"], r
    assert not swap.is_swapped(victim.alloc.key)
    assert wv.pid in gpu_pids(gpu)
    assert all(s.swapped == 0 for s in abi.read_usage(victim.alloc.directory).slots)
    assert (swap.stats.swapped_out, swap.stats.swapped_in) == (1, 1)
    node.until(
        lambda: any(e.get("reason") == swap_mod.REASON_SWAPPED_IN for e in kube_server.events("default")),
        what="the SwappedIn event",
    )
    record(
        "swap",
        {
            "name": "swap",
            "bytes": held,
            "requester_alloc_s": round(out_s, 3),  # includes the victim's swap-out
            "victim_back_s": round(in_s, 3),  # includes waiting for the requester's grant to return
            "swap_stats": dataclasses.asdict(swap.stats),
        },
    )
