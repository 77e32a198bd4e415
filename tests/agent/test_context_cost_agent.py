"""A container of several CUDA processes on a node whose contexts cost what they cost on an H100.

The in-process agent on the dgx-h100 preset as it is (each CUDA context takes the H100
estimate, docs/simgpu.md), its kubelet emulator, and real mg_ctest processes under the shim
in one pod's container. Each process pays its own context: the container reaches its limit
sooner than its allocations alone would, the third process is refused its context as a full
GPU refuses it, and what the agent reports for the container is what NVML shows for its
processes, byte for byte.
"""

from __future__ import annotations

import subprocess

import pynvml

from gpufrac.core import slices
from tests.fixtures.metrics import CTX, GiB, InprocNode, MiB, finish, read_line

MEMORY = "gpufrac.dev/gpu-memory"
OOM = 2  # CUDA_ERROR_OUT_OF_MEMORY
WORK = 448 * MiB  # what each worker allocates


def lines_until(p: subprocess.Popen[bytes], command: str) -> tuple[int, list[str]]:
    """The CUresult mg_ctest printed for `command`, and every line up to it."""
    seen = []
    while True:
        line = read_line(p)
        assert line, (
            f"the worker exited before {command!r} (printed {seen}): {p.stderr.read() if p.stderr else b''!r}"
        )
        seen.append(line.strip())
        parts = line.split()
        if parts and parts[0] == command:
            return int(parts[1]), seen


def nvml_per_process(uuid: str) -> dict[int, int]:
    """NVML's per-process used memory on the GPU: pid -> bytes (what the driver holds for each)."""
    h = pynvml.nvmlDeviceGetHandleByUUID(uuid)
    return {int(p.pid): int(p.usedGpuMemory) for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)}


def test_each_worker_pays_its_context_and_the_container_fills_sooner(node: InprocNode) -> None:
    limit = 2 * GiB
    pod = node.admit("workers", MEMORY, 2, {"gpufrac.dev/gpu-memory-limit": "2Gi"})
    ((ids,),) = [list(per.values()) for per in node.kubelet.pod_devices(pod.uid).values()]
    uuid = slices.parse(ids[0]).gpu_uuid
    # Three workers' allocations alone would fit in the limit; with their contexts (sizes
    # chosen for the H100 estimate, checked here), two do and a third context does not.
    assert limit >= 3 * WORK
    assert 2 * (CTX + WORK) <= limit < 2 * (CTX + WORK) + CTX

    workers: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(2):  # one after the other, each on a quiet GPU (see mg_ctx.c's measuring)
            w = node.workload(pod, "alloc", WORK, "hold")
            workers.append(w)
            assert lines_until(w, "init")[0] == 0
            assert lines_until(w, "alloc")[0] == 0
            assert lines_until(w, "hold")[0] == 0

        # NVML sees each worker hold its context and its allocation ...
        per_process = nvml_per_process(uuid)
        assert {w.pid: per_process.get(w.pid) for w in workers} == {w.pid: CTX + WORK for w in workers}
        # ... and the agent reports exactly their sum for the container.
        held = 2 * (CTX + WORK)
        s = node.wait_scrape(
            lambda s: s.get("gpufrac_container_memory_used_bytes", pod="workers") == held,
            "the container's two contexts and allocations",
        )
        assert s.get("gpufrac_container_memory_limit_bytes", pod="workers") == limit

        # The third worker's context would take the container past its limit: refused at
        # cuDevicePrimaryCtxRetain, as on a full GPU, before it allocates anything.
        third = node.workload(pod, "alloc", WORK, "hold")
        workers.append(third)
        rc, said = lines_until(third, "init")
        assert rc == OOM, said
        assert third.wait(60) == 2  # mg_ctest gives up when it has no context
        assert third.pid not in nvml_per_process(uuid)  # it holds nothing on the GPU
        s = node.wait_scrape(
            lambda s: s.get("gpufrac_container_memory_used_bytes", pod="workers") == held,
            "the container's count unchanged by the refused context",
        )
        assert s.get("gpufrac_container_memory_used_bytes", pod="workers") == sum(
            nvml_per_process(uuid)[w.pid] for w in workers[:2]
        )
    finally:
        for w in workers:
            finish(w)
    # The workers gone, their contexts go with them: nothing left counted.
    node.wait_scrape(
        lambda s: s.get("gpufrac_container_memory_used_bytes", pod="workers") == 0,
        "the workers' memory freed",
    )
