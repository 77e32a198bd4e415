"""Many processes on one node-state file at once.

Small C workers, built from the same simstate.c the fake drivers use, claim
process slots and take and give GPU memory concurrently on a deliberately small
GPU (so the capacity check is contended). Afterwards the per-GPU total must equal
the sum of the live slots, capacity must never have been exceeded, and memory of
processes that died without giving it back (SIGKILL, or exit) is reaped through
NVML by the next process that looks.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from gpufrac.core import native
from gpufrac.simgpu import nodestate as ns
from gpufrac.simgpu.spec import create_node, spec_from_dict

SIM_SRC = native.REPO_ROOT / "gpufrac/simgpu/native"

WORKER = r"""
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#include "simstate.h"

/* worker GPU ITERATIONS SEED: random takes and gives of 1..8 MiB on GPU, recorded in
 * this process's slot like the fake libcuda records allocations; then report and
 * hold what it has until stdin closes, and exit without giving it back. */
int main(int argc, char **argv) {
    if (argc != 4) return 2;
    unsigned gpu = (unsigned)atoi(argv[1]);
    long iters = atol(argv[2]);
    unsigned seed = (unsigned)atoi(argv[3]);
    simgpu_node_t *n = sim_node();
    if (!n) return 3;
    simgpu_proc_t *slot = sim_my_slot(n, gpu);
    if (!slot) return 4;
    uint64_t held[64];
    int nheld = 0;
    long refused = 0, over = 0;
    uint64_t cap = n->gpus[gpu].total_bytes - n->gpus[gpu].reserved_bytes;
    for (long i = 0; i < iters; i++) {
        if (nheld < 64 && (nheld == 0 || rand_r(&seed) % 2)) {
            uint64_t sz = (uint64_t)(1 + rand_r(&seed) % 8) << 20;
            if (sim_mem_take(n, gpu, sz) == 0) {
                atomic_fetch_add(&slot->used_bytes, sz);
                held[nheld++] = sz;
            } else {
                refused++;
            }
        } else {
            uint64_t sz = held[--nheld];
            atomic_fetch_sub(&slot->used_bytes, sz);
            sim_mem_give(n, gpu, sz);
        }
        if (atomic_load(&n->gpus[gpu].used_bytes) > cap) over++;
    }
    uint64_t mine = 0;
    for (int i = 0; i < nheld; i++) mine += held[i];
    printf("%ld %ld %llu\n", refused, over, (unsigned long long)mine);
    fflush(stdout);
    char c;
    while (read(0, &c, 1) > 0) {
    }
    return 0;
}
"""

REAP_VIA_NVML = """
import pynvml
pynvml.nvmlInit()
for i in range(pynvml.nvmlDeviceGetCount()):
    pynvml.nvmlDeviceGetComputeRunningProcesses(pynvml.nvmlDeviceGetHandleByIndex(i))
pynvml.nvmlShutdown()
"""


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc, "a C compiler is needed to build the native parts"
    d = tmp_path_factory.mktemp("worker")
    (d / "worker.c").write_text(WORKER)
    exe = d / "worker"
    cmd = [cc, "-std=c11", "-D_GNU_SOURCE", "-pthread", "-Wall", "-Wextra", "-Werror", "-O2", f"-I{SIM_SRC}"]
    subprocess.run([*cmd, "-o", str(exe), str(d / "worker.c"), str(SIM_SRC / "simstate.c")], check=True)
    return exe


def small_node(path: Path) -> Path:
    """Two 256 MiB GPUs: 8 workers holding up to 64 x 8 MiB each contend for capacity."""
    gpu = {"model": "Tiny GPU", "memory": "288Mi", "reserved": "32Mi"}
    return create_node(
        spec_from_dict({"node_name": "tiny", "gpus": [gpu, dict(gpu, pci_bus_id="0000:02:00.0")]}), path
    )


def test_concurrent_take_give_keeps_totals_consistent_and_dead_are_reaped(
    worker: Path, tmp_path: Path
) -> None:
    path = small_node(tmp_path / "node.state")
    env = dict(os.environ, SIMGPU_STATE=str(path))
    procs = [
        subprocess.Popen(
            [str(worker), str(i % 2), "200000", str(1000 + i)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(8)
    ]
    try:
        results = []
        for p in procs:
            assert p.stdout is not None
            line = p.stdout.readline()  # blocks until the worker has finished its churn
            assert line, f"worker {p.pid} exited with {p.wait(timeout=60)}"
            results.append([int(x) for x in line.split()])
        assert all(over == 0 for _, over, _ in results), "used_bytes exceeded capacity"
        assert sum(refused for refused, _, _ in results) > 0, "capacity was never contended"

        with ns.NodeState(path) as st:
            live = st.live_procs()
            assert sorted(p.pid for p in live) == sorted(p.pid for p in procs)
            for g in range(2):
                slots = sum(s.used_bytes for s in live if s.gpu == g)
                held = sum(r[2] for i, r in enumerate(results) if i % 2 == g)
                assert st.node.gpus[g].used_bytes == slots == held
            del live

        # One dies by SIGKILL, the rest exit without giving their memory back.
        procs[0].send_signal(signal.SIGKILL)
        for p in procs[1:]:
            assert p.stdin is not None
            p.stdin.close()
        for p in procs:
            p.wait(timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=60)

    nvml_env = dict(env, LD_LIBRARY_PATH=str(native.library(native.FAKE_NVML).parent))
    out = subprocess.run([sys.executable, "-c", REAP_VIA_NVML], env=nvml_env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    with ns.NodeState(path) as st:
        assert not st.live_procs()
        assert [g.used_bytes for g in st.gpus] == [0, 0]
