"""A swapped-out container whose exited process's pid went to another process comes back.

The swap resolver keeps each process it checkpointed by identity (host pid, with its pid in
its own namespace and its start time: its usage slot), not by number. One of a swapped
container's processes exits while swapped out, and the kernel gives its pid to a process
that holds no CUDA state: the driver answers NOT_FOUND for that pid. Kept by number, the
swap-in asked the driver about it, took NOT_FOUND for a failed restore, undid the rest and
denied every SWAP_IN: the container hung (55 failed restores a minute). Now a process that is
gone is left out (and NOT_FOUND for one that exited meanwhile counts as gone), and the rest of
the container comes back, bytes intact.

The arbiter runs in this process (tests/fixtures/arbiter_harness.py) with the fake driver's
checkpoint API; the container's two processes are the real workload under the real shim in
its real cgroup; the pid is handed on through ns_last_pid, as the kernel's allocator would
in time.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import threading
from collections.abc import Callable

import pynvml
import pytest

from gpufrac.core import native
from gpufrac.memguard import abi
from gpufrac.simgpu.nodestate import NodeState
from gpufrac.simgpu.runtime import _ENTER
from gpufrac.simgpu.workload import WorkloadProcess
from tests.fixtures.arbiter_harness import ArbiterNode, Box, GiB, MiB
from tests.fixtures.hostile_tenant import spawn_with_pid

pytestmark = pytest.mark.security

TIMEOUT = 60.0


def another_process(node: ArbiterNode, box: Box) -> WorkloadProcess:
    """A second workload process in `box`'s container: its cgroup, its environment, the shim."""
    assert box.container is not None
    proc = subprocess.Popen(
        ["/bin/sh", "-c", _ENTER, "sh", *WorkloadProcess.argv()],
        env=box.container.env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    return WorkloadProcess(proc, "second", TIMEOUT)


def driver_knows(state: object, pid: int) -> bool:
    """Whether the driver still holds a process `pid` (an NVML query first: the simulated
    driver frees a killed process's state when the next process looks, sim_reap_dead)."""
    pynvml.nvmlDeviceGetComputeRunningProcesses(pynvml.nvmlDeviceGetHandleByIndex(0))
    with NodeState(str(state)) as n:
        return any(p.pid == pid for p in n.live_procs())


def test_a_swapped_container_whose_exited_process_pid_was_reused_comes_back(
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
    main = node.start_cuda(box, timeout=TIMEOUT)
    assert main.do(f"alloc {GiB} 1111", TIMEOUT) == "ok 1"
    second = another_process(node, box)
    assert second.do(f"alloc {256 * MiB} 2222", TIMEOUT) == "ok 1"
    ok, why = node.on_loop(lambda: swap.swap_out(box.alloc, "the test"))
    assert ok, why
    entry = swap.swapped[box.alloc.key]
    gone = second.proc.pid
    assert sorted(entry.pids) == sorted([main.pid, gone])

    # The second process exits while swapped out (killed: no goodbye to anyone) ...
    second.proc.kill()
    second.proc.wait(TIMEOUT)
    # ... and the kernel gives its pid to a process of the same container that holds no CUDA.
    assert box.container is not None
    procs = box.container.cgroup_dir / "cgroup.procs"
    heir = None
    for _ in range(20):  # another fork on the machine may take the pid first: try again
        heir = spawn_with_pid(gone, procs)
        if heir is not None:
            break
    if heir is None:
        pytest.skip("the pid was always taken by another process first")
    try:
        node.until(
            lambda: not driver_knows(node.state_path, gone), what="the driver to forget the dead process"
        )

        # The main process's next GPU work brings the container back, the exited one left out.
        answer: list[str] = []
        t = threading.Thread(target=lambda: answer.append(main.do("check 1", TIMEOUT)), daemon=True)
        t.start()
        t.join(TIMEOUT + 5)
        assert answer == ["ok"], f"{answer}; arbiter stats {node.arbiter.swap.stats}"
        assert not swap.is_swapped(box.alloc.key)
        assert not any(s.swapped for s in abi.read_usage(box.alloc.directory).slots if s.pid == main.pid)
        assert swap.stats.failed_in == 0
        # The heir was never asked about (a pid is not an identity) and runs on.
        assert os.waitpid(heir, os.WNOHANG) == (0, 0)
    finally:
        os.kill(heir, signal.SIGKILL)
        os.waitpid(heir, 0)
