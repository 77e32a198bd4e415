"""Swap on a simulated node: real cuda-python processes under the real shim in real cgroups,
the fake driver's checkpoint API across processes, the arbiter on its socket.

A burst that does not fit swaps an idle, swappable container to host RAM (NVML stops
showing its memory, its pod stays Running); the victim's next launch asks for its memory
back, the arbiter arbitrates that like any burst, and its buffers hold the same bytes."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pynvml
import pytest
from arbiter_harness import ArbiterNode, Box, GiB, nvml_node
from kube_fixtures import KubeServer

from gpufrac import native
from gpufrac.agent import swap as swap_mod
from gpufrac.deviceplugin.server import container_response
from gpufrac.memguard import formats
from gpufrac.simgpu.nodestate import NodeState
from gpufrac.simgpu.runtime import mounts_of

TIMEOUT = 120.0
RESULT = 8  # every workload also holds an 8-byte buffer for check_u32's result

# A GPU program driven by lines on stdin: `alloc N V` allocates N bytes and fills them
# with the u32 V (fill_u32 kernel of the fake module), `check` runs check_u32 over every
# buffer and prints how many words differ, `free` frees them all.
WORKLOAD = textwrap.dedent(
    """
    import ctypes, sys
    from cuda.bindings import driver as cu
    def chk(r):
        r = r if isinstance(r, tuple) else (r,)
        if int(r[0]) != 0:
            raise SystemExit(f"CUDA error {r[0]!r}")
        return r[1] if len(r) == 2 else r[1:]
    chk(cu.cuInit(0))
    ctx = chk(cu.cuDevicePrimaryCtxRetain(chk(cu.cuDeviceGet(0))))
    chk(cu.cuCtxSetCurrent(ctx))
    mod = chk(cu.cuModuleLoadData(b"SIMGPU-MODULE"))
    fill, check = (chk(cu.cuModuleGetFunction(mod, k)) for k in (b"fill_u32", b"check_u32"))
    res = chk(cu.cuMemAlloc(8))
    U64, U32 = ctypes.c_uint64, ctypes.c_uint32
    bufs = []
    def launch(f, args, types):
        chk(cu.cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, 0, (args, types), 0))
    print("ready", flush=True)
    for line in sys.stdin:
        cmd, *a = line.split()
        if cmd == "alloc":
            n, v = int(a[0]), int(a[1])
            r = cu.cuMemAlloc(n)
            if int(r[0]) != 0:
                print("oom", flush=True)
                continue
            bufs.append((r[1], n, v))
            launch(fill, (int(r[1]), n // 4, v), (U64, U64, U32))
            chk(cu.cuCtxSynchronize())
            print("ok", flush=True)
        elif cmd == "check":
            bad = 0
            for p, n, v in bufs:
                launch(check, (int(p), n // 4, v, int(res)), (U64, U64, U32, U64))
                out = U64()
                chk(cu.cuMemcpyDtoH(ctypes.addressof(out), res, 8))
                bad += out.value
            print("checked", bad, flush=True)
        elif cmd == "free":
            for p, _, _ in bufs:
                chk(cu.cuMemFree(p))
            bufs.clear()
            print("ok", flush=True)
    """
)


class Gpu:
    """A container running WORKLOAD under the shim; `do` sends a command, `answer` reads."""

    def __init__(self, node: ArbiterNode, box: Box, sim_state: Path) -> None:
        resp = container_response(box.alloc, node.cfg)
        env = dict(os.environ, SIMGPU_STATE=str(sim_state), LD_LIBRARY_PATH=str(native.native_dir()))
        self.c = node.runtime.start(
            box.uid,
            "main",
            [sys.executable, "-c", WORKLOAD],
            env=env,
            envs=dict(resp.envs),
            mounts=mounts_of(resp),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        box.container = self.c
        node.set_container_id(box.pod, box.uid, self.c.runtime_id)
        self.pid = self.c.proc.pid
        assert self.answer() == "ready"

    def send(self, cmd: str) -> None:
        assert self.c.proc.stdin is not None
        self.c.proc.stdin.write((cmd + "\n").encode())
        self.c.proc.stdin.flush()

    def answer(self, timeout: float = TIMEOUT) -> str:
        out: list[str] = []
        assert self.c.proc.stdout is not None
        t = threading.Thread(target=lambda: out.append(self.c.proc.stdout.readline().decode().strip()))  # type: ignore[union-attr]
        t.daemon = True
        t.start()
        t.join(timeout)
        assert out, f"no answer within {timeout}s"
        return out[0]

    def do(self, cmd: str, timeout: float = TIMEOUT) -> str:
        self.send(cmd)
        return self.answer(timeout)


@pytest.fixture(scope="module")
def node_file(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    import ctypes

    # The agent's side of the checkpoint API is cuda-python in this process: the fake
    # libcuda.so.1 loaded first is what it finds by soname. Its cuInit binds one node
    # state per process, so the tests of this module share one node, reset for each.
    ctypes.CDLL(str(native.library(native.FAKE_CUDA)), mode=ctypes.RTLD_GLOBAL)
    with nvml_node(tmp_path_factory.mktemp("swap")) as path:
        yield path


@pytest.fixture
def sim_state(node_file: Path) -> Path:
    """The module's node as new: no processes (the last test's are gone), nothing used,
    the checkpoint API on."""
    with NodeState(node_file) as st:
        for slot in st.node.procs:
            slot.used_bytes = slot.swapped_bytes = slot.ckpt_state = slot.api_inflight = 0
            slot.pid = 0
        for i in range(st.node.gpu_count):
            st.node.gpus[i].used_bytes = 0
        st.node.checkpoint_supported = 1
        del slot
    return node_file


def make_node(kube: KubeServer, **extra: Any) -> ArbiterNode:
    state = tempfile.mkdtemp(prefix="gfs", dir="/tmp")  # short: the socket path
    overrides: dict[str, Any] = {
        "paths": {"stateDir": state, "shimHostPath": str(native.library(native.SHIM))},
        "resolvers": ["swap", "evict", "wait"],
        "swap": {"idleThreshold": "1s"},
    }
    overrides.update(extra)
    node = ArbiterNode(kube, overrides)
    close = node.close

    def close_all() -> None:
        try:
            close()
        finally:
            shutil.rmtree(state, ignore_errors=True)

    node.close = close_all  # type: ignore[method-assign]
    return node


@pytest.fixture
def node(sim_state: Path, kube_server: KubeServer) -> Iterator[ArbiterNode]:
    n = make_node(kube_server)
    try:
        yield n
    finally:
        n.close()


def swappable(node: ArbiterNode, box: Box) -> None:
    """The pod opts in (annotation), and the agent applies it to the container's config."""
    node.v1.patch_namespaced_pod(
        box.pod, "default", {"metadata": {"annotations": {"gpufrac.dev/swappable": "true"}}}
    )
    node.until(
        lambda: bool(node.identity.pods.by_uid(box.uid).annotations.get("gpufrac.dev/swappable")),  # type: ignore[union-attr]
        what="the annotation in the pod cache",
    )
    node.on_loop(lambda: node.identity.resolve(node.listing))
    assert box.config().flags & formats.FLAG_SWAPPABLE


def fill_gpu(sim_state: Path, leave_free: int) -> None:
    """Something outside gpufrac takes all but `leave_free` of GPU 0 (NVML shows it)."""
    with NodeState(sim_state) as st:
        g = st.gpus[0]
        g.used_bytes += g.total_bytes - g.reserved_bytes - g.used_bytes - leave_free
        del g  # the mapping closes only when no structure points into it


def gpu_pids() -> dict[int, int]:
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    return {p.pid: p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)}


def idle(node: ArbiterNode, box: Box) -> None:
    threshold = node.cfg.swap.idle_threshold
    node.until(
        lambda: any(
            h.alloc.key == box.alloc.key and h.idle_s >= threshold for h in node.arbiter.holdings(node.gpu)
        ),
        timeout=TIMEOUT,
        what=f"{box.pod} idle for {threshold}s",
    )


def events(kube: KubeServer, reason: str, pod: str) -> list[dict[str, Any]]:
    return [
        e for e in kube.events("default") if e.get("reason") == reason and e["involvedObject"]["name"] == pod
    ]


def test_swap_frees_the_victim_and_it_resumes_with_its_bytes(
    node: ArbiterNode,
    sim_state: Path,
    kube_server: KubeServer,
) -> None:
    victim = node.add("victim", 2, "8Gi", start=False)
    swappable(node, victim)
    v = Gpu(node, victim, sim_state)
    assert v.do(f"alloc {2 * GiB} 1111") == "ok"  # guarantee
    assert v.do(f"alloc {4 * GiB} 2222") == "ok"  # burst, granted: the GPU is empty
    requester = node.add("requester", 2, "8Gi", start=False)
    r = Gpu(node, requester, sim_state)
    assert r.do(f"alloc {2 * GiB} 3333") == "ok"
    fill_gpu(sim_state, leave_free=2 * GiB)  # a 4 GiB burst does not fit any more
    assert gpu_pids()[v.pid] == 6 * GiB + RESULT
    idle(node, victim)

    # The requester's burst swaps the idle victim out and is granted.
    assert r.do(f"alloc {4 * GiB} 4444") == "ok"
    swap = node.arbiter.swap
    assert swap is not None and swap.is_swapped(victim.alloc.key)
    assert v.pid not in gpu_pids()  # NVML: the victim holds no GPU memory any more
    assert gpu_pids()[r.pid] == 6 * GiB + RESULT
    assert v.c.alive()
    assert node.v1.read_namespaced_pod("victim", "default").status.phase == "Running"
    assert swap.host_ram_used == 6 * GiB + RESULT
    assert victim.config().grant_bytes == 0  # its burst is arbitrated again on the way back
    node.until(lambda: bool(events(kube_server, swap_mod.REASON_SWAPPED_OUT, "victim")), what="Event")
    node.until(lambda: bool(events(kube_server, swap_mod.REASON_SWAPPED_FOR, "requester")), what="Event")
    (out,) = events(kube_server, swap_mod.REASON_SWAPPED_OUT, "victim")
    assert "6.0Gi" in out["message"] and "default/requester" in out["message"]

    # The victim's next launch needs its 6 GiB back: they are free once the requester is done.
    v.send("check")
    assert r.do("free") == "ok"
    r.c.stop()
    assert v.answer() == "checked 0"  # every word of both buffers as it was written
    assert not swap.is_swapped(victim.alloc.key)
    assert gpu_pids()[v.pid] == 6 * GiB + RESULT
    assert victim.config().grant_bytes == 4 * GiB + RESULT  # its burst, granted again
    assert all(s.swapped == 0 for s in formats.read_usage(victim.alloc.directory).slots)
    node.until(lambda: bool(events(kube_server, swap_mod.REASON_SWAPPED_IN, "victim")), what="Event")
    assert swap.stats.swapped_out == 1 and swap.stats.swapped_in == 1


def test_swap_unavailable_is_said_once_and_the_chain_moves_on(
    node: ArbiterNode, sim_state: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with NodeState(sim_state) as st:
        st.node.checkpoint_supported = 0  # a driver without the checkpoint API
    victim = node.add("victim", 2, "8Gi", start=False)
    swappable(node, victim)
    v = Gpu(node, victim, sim_state)
    assert v.do(f"alloc {4 * GiB} 1") == "ok"
    requester = node.add("requester", 2, "8Gi", wait_timeout="1s", start=False)
    r = Gpu(node, requester, sim_state)
    fill_gpu(sim_state, leave_free=GiB)
    idle(node, victim)
    with caplog.at_level(logging.WARNING):
        # Swap steps aside; evict has no lower-priority burst to take; wait times out.
        assert r.do(f"alloc {4 * GiB} 2") == "oom"
        assert r.do(f"alloc {4 * GiB} 2") == "oom"
    said = [m for m in caplog.messages if "swap" in m and "unavailable" in m]
    assert len(said) <= 2 and any("not supported" in m for m in said)
    assert len([m for m in said if m.startswith("swap:")]) == 1
    assert gpu_pids()[v.pid] == 4 * GiB + RESULT  # nothing was swapped
    assert node.arbiter.swap is not None and not node.arbiter.swap.swapped


def test_host_ram_budget_bounds_what_is_swapped(sim_state: Path, kube_server: KubeServer) -> None:
    node = make_node(kube_server, swap={"idleThreshold": "1s", "hostRamBudget": "5Gi"})
    try:
        victim = node.add("victim", 2, "8Gi", start=False)
        swappable(node, victim)
        v = Gpu(node, victim, sim_state)
        assert v.do(f"alloc {6 * GiB} 1") == "ok"  # 6 GiB would not fit in the 5 GiB budget
        requester = node.add("requester", 2, "8Gi", wait_timeout="1s", start=False)
        r = Gpu(node, requester, sim_state)
        fill_gpu(sim_state, leave_free=GiB)
        idle(node, victim)
        assert r.do(f"alloc {4 * GiB} 2") == "oom"
        assert gpu_pids()[v.pid] == 6 * GiB + RESULT
        assert node.arbiter.swap is not None and node.arbiter.swap.host_ram_used == 0
    finally:
        node.close()
