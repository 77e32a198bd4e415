"""A swapped-out container comes back on its next GPU work, whatever that call is.

An idle notebook is swapped to host RAM; its user then copies a tensor to the host
(`t.cpu()`: cuMemcpyDtoH, no kernel launched) or synchronizes; a stream-ordered pool
(PyTorch's cudaMallocAsync backend, RAPIDS) serves its next tensor from bytes the pool holds
idle, which the shim counted already and never charges again; PyTorch's expandable segments
give memory back in `empty_cache()` by cuMemUnmap and cuMemRelease. The driver blocks every
CUDA call of a locked process until it is restored (simgpu's fake libcuda does the same), and
only the shim can ask for that: so each of these calls must pass the shim's swap-in gate and
come back within the container's wait timeout, with its bytes intact.

Every part real (tests/fixtures/e2e.py): the agent a subprocess, cuda-python under the
memguard shim (every function through cuGetProcAddress_v2), the fake driver's checkpoint API.

Nor only the entry points the shim hooks: a stream or an event created, a context made
current, pinned host memory, a kernel looked up, a pointer's attributes asked
(cudaStreamCreate, cudaEventCreate, cudaPointerGetAttributes reach them) pass the gate too,
however the program found the function: through cuGetProcAddress (cudart, cuda-python), dlsym
on the driver's handle (ctypes), or the global scope a linked program binds in. There the
arbiter runs in this process (tests/fixtures/arbiter_harness.py), swapping the container out
on request as the idle reaper does, and the process is single-threaded: nobody else in it
could ask for it to come back.
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Callable

import pytest

from gpufrac.core import native
from gpufrac.memguard import abi
from gpufrac.simgpu.nodestate import NodeState
from gpufrac.simgpu.workload import ENTRY_POINTS
from tests.fixtures.arbiter_harness import ArbiterNode, GiB
from tests.fixtures.e2e import E2ENode, MiB, PodRun
from tests.fixtures.swapping import swapped_out

pytestmark = pytest.mark.security

WAIT_TIMEOUT = 20.0  # the victim's gpufrac.dev/wait-timeout: its swap-in is arbitrated within it
EXTRA = 64 * MiB  # the pool's idle bytes, the VMM mapping: room for both on the 1 GiB GPU


@pytest.mark.parametrize(
    "first_call",
    [
        "read",  # cuMemcpyDtoH
        "sync",  # cuCtxSynchronize
        "pool",  # cuMemAllocAsync served wholly from the pool's idle bytes (no charge)
        "vmm",  # cuMemUnmap, then cuMemRelease
    ],
)
def test_a_swapped_out_container_whose_next_call_is_not_a_launch_comes_back(
    e2e_node: Callable[..., E2ENode], first_call: str
) -> None:
    node = e2e_node(resolvers=["swap", "wait"], swap={"idleThreshold": "1s"})
    mapping: list[str] = []

    def prepare(victim: PodRun) -> None:
        if first_call == "pool":
            assert victim.app.do(f"pool {EXTRA}") == "ok"
        elif first_call == "vmm":
            answer = victim.app.do(f"vmm {EXTRA}").split()
            assert answer[0] == "ok", answer
            mapping.append(answer[1])

    victim, guarantee, burst = swapped_out(node, wait_timeout=f"{WAIT_TIMEOUT:g}s", then=prepare)
    log = node.sim.agent.log
    if first_call == "read":
        assert victim.app.do(f"read {burst[1]}", WAIT_TIMEOUT) == "value 2222", log()[-3000:]
    elif first_call == "sync":
        assert victim.app.do("sync", WAIT_TIMEOUT) == "ok", log()[-3000:]
    elif first_call == "pool":
        assert victim.app.do(f"palloc {EXTRA}", WAIT_TIMEOUT).startswith("ok "), log()[-3000:]
    else:
        assert victim.app.do(f"vfree {mapping[0]}", WAIT_TIMEOUT) == "ok", log()[-3000:]
    assert not any(s.swapped for s in abi.read_usage(victim.host_dir).slots)
    assert victim.app.do(f"read {guarantee[1]}", WAIT_TIMEOUT) == "value 1111"
    assert victim.app.do(f"check {guarantee[1]}") == "ok" and victim.app.do(f"check {burst[1]}") == "ok"
    assert victim.alive()


# Every entry point of the workload as cudart and cuda-python find it (cuGetProcAddress), and a
# few as ctypes does (dlsym on the driver's handle) and as a linked program binds them.
CALLS = [(name, "proc") for name in ENTRY_POINTS] + [
    ("cuStreamCreate", "dlsym"),
    ("cuPointerGetAttributes", "dlsym"),
    ("cuEventCreate", "export"),
    ("cuMemHostAlloc", "export"),
]
CALL_TIMEOUT = 30.0  # a call that waits in the locked driver never answers; one that came back did


def on_gpu(state: object, pid: int) -> int:
    """What the driver holds for process `pid` now (its NVML figure)."""
    with NodeState(str(state)) as n:
        return sum(p.used_bytes for p in n.live_procs() if p.pid == pid)


@pytest.mark.slow
def test_a_swapped_out_process_whose_next_call_is_any_driver_entry_point_comes_back(
    make_node: Callable[..., ArbiterNode],
) -> None:
    # The agent's side of the checkpoint API is cuda-python in this process: the fake
    # libcuda.so.1 loaded first is what it finds by soname (its cuInit binds make_node's node).
    ctypes.CDLL(str(native.library(native.FAKE_CUDA)), mode=ctypes.RTLD_GLOBAL)
    node = make_node(resolvers=["swap", "wait"], paths={"shimHostPath": str(native.library(native.SHIM))})
    swap = node.arbiter.swap
    assert swap is not None and node.on_loop(swap.detect).available
    box = node.add("notebook", 2, "8Gi", start=False)
    node.swappable(box)
    app = node.start_cuda(box, timeout=CALL_TIMEOUT)
    assert app.do(f"alloc {GiB} 1111", CALL_TIMEOUT) == "ok 1"
    for name, via in CALLS:  # found before it is swapped out (a lookup is a driver call too)
        assert app.do(f"resolve {name} {via}") == "ok libmemguard.so", (name, via)
    assert os.listdir(f"/proc/{app.pid}/task") == [str(app.pid)]  # one thread: nobody else to ask
    held = on_gpu(node.state_path, app.pid)
    assert held > GiB

    took = {}
    for name, via in CALLS:
        ok, why = node.on_loop(lambda: swap.swap_out(box.alloc, "the test"))
        assert ok, why
        assert on_gpu(node.state_path, app.pid) == 0  # in host RAM, the process locked
        t0 = time.monotonic()
        assert app.do(f"call {name} {via}", CALL_TIMEOUT) == "ok", (name, via)
        took[f"{name}/{via}"] = round(time.monotonic() - t0, 3)
        assert not swap.is_swapped(box.alloc.key), (name, via)
        assert not any(s.swapped for s in abi.read_usage(box.alloc.directory).slots)
        assert on_gpu(node.state_path, app.pid) == held  # back on the GPU, all of it
    print("swapped out, then back on its next call (seconds):", took)
    assert app.do("check 1", CALL_TIMEOUT) == "ok"  # its bytes came back with it
