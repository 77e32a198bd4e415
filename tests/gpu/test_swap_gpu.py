"""Swap through the driver's checkpoint API on a real GPU: the resolver's own driver calls
(gpufrac.agent.arbiter.swap.checkpoint.Checkpointer.swap_out / swap_in, which
gpufrac.agent.arbiter.swap.resolver runs in a worker thread) on a PyTorch process under the real shim.
No arbiter and no Kubernetes here: test_resolvers_gpu.py runs the whole resolver.

* a process holding several GiB of tensors, a model with Adam's state and a captured CUDA
  graph goes to host RAM (it leaves NVML's process list) and comes back: every tensor
  checked word for word at its old address, the weights bit for bit, the graph replayed,
  and the process trains on;
* time per GiB out and in (NVML's figure for the process: what the driver moves), beside
  the host link's bandwidth measured with pinned copies in the same process (goal: the
  checkpoint moves at least 70 % of it, each way);
* a process swapped mid-kernel, and one with two streams busy: the checkpoint waits for
  the work, and its results are right after the restore.
"""
# ruff: noqa: F811 - pytest fixtures imported from gpu_support are parameters here

from __future__ import annotations

import time
from pathlib import Path

import pytest
from gpu_support import GiB, Gpu, MiB, Worker, gpu, gpu_env, gpu_pids, record, spawn  # noqa: F401

from gpufrac.agent.arbiter.swap.checkpoint import Checkpointer, ProcessState
from tests.fixtures.memguard import make_container

pytestmark = pytest.mark.gpu

LIMIT = 16 * GiB
TENSORS = 4  # of 1 GiB each
LOCK_TIMEOUT_MS = 60_000
TARGET_LINK_SHARE = 0.70  # of the pinned-copy bandwidth, each way
BUSY_S = 2.0  # how long the spinning kernels run


@pytest.fixture(scope="module")
def ckpt(gpu: Gpu) -> Checkpointer:
    """The agent's checkpoint wrapper on this process's real driver."""
    c = Checkpointer()
    support = c.detect()
    if not support.available:
        pytest.skip(f"driver capability: the checkpoint API is unavailable here: {support.reason}")
    return c


def worker(spawn, real_env: dict[str, str], gpu: Gpu, tmp_path: Path, name: str) -> Worker:
    c = make_container(tmp_path / name, LIMIT, LIMIT, pod="gpu-test", container=name)
    return spawn(gpu_env(real_env, gpu, c), name)


def timed_swap(ckpt: Checkpointer, gpu: Gpu, pid: int) -> tuple[float, float]:
    """Swap `pid` out and back in; seconds each way. Between the two it must be off the GPU."""
    t0 = time.monotonic()
    ckpt.swap_out([pid], LOCK_TIMEOUT_MS)
    out_s = time.monotonic() - t0
    assert ckpt.state(pid) == ProcessState.CHECKPOINTED
    assert pid not in gpu_pids(gpu), "NVML still lists the checkpointed process"
    t0 = time.monotonic()
    ckpt.swap_in([pid])
    in_s = time.monotonic() - t0
    assert ckpt.state(pid) == ProcessState.RUNNING
    return out_s, in_s


def test_swap_keeps_every_byte_and_the_process_trains_on(
    spawn, real_env: dict[str, str], gpu: Gpu, tmp_path: Path, ckpt: Checkpointer
) -> None:
    w = worker(spawn, real_env, gpu, tmp_path, "victim")
    link = w.ok("pinned_bw", bytes=GiB, timeout=120)
    w.ok("model")
    assert w.ok("keep_graph")["wrong"] == 0
    for i in range(TENSORS):
        w.ok("alloc", name=f"t{i}", bytes=GiB, seed=100 + i, on_device=True, timeout=120)
    counted = w.ok("info")["usage"]["total_used"]
    held = gpu_pids(gpu)[w.pid]
    assert held >= TENSORS * GiB

    out_s, in_s = timed_swap(ckpt, gpu, w.pid)

    after = gpu_pids(gpu).get(w.pid)
    # Before any new GPU work (the checks below allocate scratch): the count is as it was.
    recounted = w.ok("info")["usage"]["total_used"]
    bad = {f"t{i}": w.ok("check", name=f"t{i}", timeout=120) for i in range(TENSORS)}
    weights = w.ok("same_weights")
    graph = w.ok("replay_graph")
    trained = w.ok("train", steps=50)
    gb = held / 1e9
    out_gbps, in_gbps = gb / out_s, gb / in_s
    record(
        "swap-checkpoint",
        {
            "name": "swap-checkpoint",
            "process_bytes": held,
            "tensor_bytes": TENSORS * GiB,
            "out_s": round(out_s, 3),
            "in_s": round(in_s, 3),
            "out_gbps": round(out_gbps, 2),
            "in_gbps": round(in_gbps, 2),
            "pinned_d2h_gbps": round(link["d2h_gbps"], 2),
            "pinned_h2d_gbps": round(link["h2d_gbps"], 2),
            "out_share_of_d2h": round(out_gbps / link["d2h_gbps"], 3),
            "in_share_of_h2d": round(in_gbps / link["h2d_gbps"], 3),
            "target_share": TARGET_LINK_SHARE,
            "nvml_after_restore": after,
        },
    )
    for name, r in bad.items():
        assert r["bad_words"] == 0 and r["same_address"], (name, r)
    assert weights["differ"] == [], weights
    assert graph["wrong"] == 0, graph
    assert trained["loss_last"] < trained["loss_first"], trained
    assert after is not None and abs(after - held) <= 64 * MiB, (held, after)
    assert recounted == counted, f"the shim's count changed across the swap: {counted} -> {recounted}"


@pytest.mark.parametrize("streams", [1, 2])
def test_swap_while_kernels_run(
    streams: int, spawn, real_env: dict[str, str], gpu: Gpu, tmp_path: Path, ckpt: Checkpointer
) -> None:
    w = worker(spawn, real_env, gpu, tmp_path, f"busy{streams}")
    w.ok("alloc", name="a", bytes=512 * MiB, seed=5, on_device=True)
    busy = w.ok("busy", seconds=BUSY_S, streams=streams)
    t0 = time.monotonic()
    assert not any(busy["done_at_answer"]), f"the kernels ended before the swap began: {busy}"
    out_s, in_s = timed_swap(ckpt, gpu, w.pid)
    done = w.ok("busy_check", timeout=120)
    record(
        f"swap-busy-{streams}",
        {
            "name": f"swap-busy-{streams}",
            "streams": streams,
            "kernel_s": BUSY_S,
            "swap_began_after_launch_s": round(t0 - busy["t_launched"], 3),
            "out_s": round(out_s, 3),
            "in_s": round(in_s, 3),
        },
    )
    assert done["wrong"] == 0, done
    r = w.ok("check", name="a")
    assert r["bad_words"] == 0 and r["same_address"], r
