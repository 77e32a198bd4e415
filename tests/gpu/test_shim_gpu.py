"""The memguard shim on a real GPU: PyTorch and cuda-python processes under the real
shim (LD_PRELOAD), each with a container directory whose config the test writes as the
agent would. The same promises as on simgpu (docs/design.md section 2), on real hardware:

* what the process sees (torch.cuda.mem_get_info, get_device_properties().total_memory,
  NVML v1/v2, nvidia-smi) is the container: total = limit, free = limit - container usage;
* the container's usage is what PyTorch reserved plus what the driver took for the
  process (its context, measured by the shim: docs/architecture.md, "What the shim
  counts"), so a container pays its contexts from its limit;
* past the limit PyTorch gets its own OutOfMemoryError, its caching allocator gives
  back what it cached and retries, and the process goes on;
* expandable segments (cuMemCreate/cuMemMap) are counted by what is mapped;
* CUDA graphs capture and replay under the native allocator and cudaMallocAsync, their
  launches seen by the shim;
* two processes of one container share one limit, each paying its context.

Sizes are fractions of the room the process found once its context existed (the limit
less its context's charge), so they hold whatever a context costs on this GPU and driver.
The shim's overhead is tests/gpu/test_overhead_gpu.py; the context's cost,
test_context_gpu.py.
"""
# ruff: noqa: F811 - pytest fixtures imported from gpu_support are parameters here

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from gpu_support import (  # noqa: F401
    GiB,
    Gpu,
    MiB,
    Worker,
    aligned,
    assert_container_view,
    beyond_allocator,
    gpu,
    gpu_env,
    spawn,
)

from tests.fixtures.memguard import Container, make_container

pytestmark = pytest.mark.gpu

LIMIT = 4 * GiB
# Expandable segments map physical memory in pages of 2 MiB (small pool) and 20 MiB
# (large pool): counted and reserved bytes may differ by at most one such page.
SEGMENT = 20 * MiB
# What the shim may count besides PyTorch's reservations between two readings of one
# process: module memory a first kernel launch loads through a hooked call.
SLACK = 32 * MiB

Spawn = Callable[..., Worker]


@pytest.fixture
def box(tmp_path: Path, gpu: Gpu) -> Callable[..., Container]:
    """box(request, limit) -> a container directory as the agent writes it."""
    n = iter(range(100))

    def make(request: int = LIMIT, limit: int = LIMIT) -> Container:
        return make_container(tmp_path / f"ctr-{next(n)}", request, limit, pod="gpu-test", container="main")

    return make


def start(
    spawn: Spawn, real_env: dict[str, str], gpu: Gpu, c: Container, name: str = "worker", **extra: str
) -> Worker:
    return spawn(gpu_env(real_env, gpu, c, **extra), name)


def room(w: Worker, limit: int = LIMIT) -> int:
    """What the container had left once `w`'s context existed."""
    used = assert_container_view(w.ready, limit)
    assert used < limit // 2, f"a context took {used} of the {limit}-byte limit: {w.ready}"
    return limit - used


def test_memory_queries_show_the_container(spawn: Spawn, real_env: dict[str, str], gpu: Gpu, box) -> None:
    assert gpu.total > 2 * LIMIT, "the GPU must be larger than the limit for this test to mean anything"
    w = start(spawn, real_env, gpu, box())
    room(w)
    # cudaGetDeviceProperties' totalGlobalMem (cuDeviceTotalMem) is the limit too.
    assert w.ready["total_memory"] == LIMIT, w.ready
    # The context is charged: the shim counts more than PyTorch reserved, from the start.
    ctx = beyond_allocator(w.ready)
    assert ctx > 0, w.ready
    w.ok("alloc", name="a", bytes=256 * MiB)
    info = w.ok("info")
    used = assert_container_view(info, LIMIT)
    # Everything PyTorch reserved since is counted, and nothing else of note.
    assert abs(beyond_allocator(info) - ctx) <= SLACK, (w.ready, info)
    assert info["usage"]["slot"]["used_bytes"] == used
    # Freed and given back by the caching allocator: the container's view follows.
    w.ok("free", name="a")
    w.ok("empty_cache")
    after = w.ok("info")
    assert assert_container_view(after, LIMIT) <= used - 256 * MiB


def test_nvidia_smi_shows_the_container(spawn: Spawn, real_env: dict[str, str], gpu: Gpu, box) -> None:
    smi = shutil.which("nvidia-smi", path=real_env.get("PATH"))
    if smi is None:
        pytest.skip("nvidia-smi is not installed")
    c = box()
    holder = start(spawn, real_env, gpu, c)
    holder.ok("alloc", name="a", bytes=300 * MiB)
    used = holder.ok("info")["usage"]["total_used"]
    r = subprocess.run(
        [
            smi,
            f"--id={gpu.uuid}",
            "--query-gpu=memory.total,memory.used,memory.free",
            "--format=csv,noheader,nounits",
        ],
        env=gpu_env(real_env, gpu, c),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    total, smi_used, free = (int(x) for x in r.stdout.strip().split(","))
    assert total == LIMIT // MiB, r.stdout
    # nvidia-smi prints MiB (rounded either way).
    assert abs(smi_used - used / MiB) <= 1 and abs(free - (LIMIT - used) / MiB) <= 1, (r.stdout, used)


def test_past_the_limit_pytorch_frees_its_cache_or_raises_oom(
    spawn: Spawn, real_env: dict[str, str], gpu: Gpu, box
) -> None:
    c = box()
    w = start(spawn, real_env, gpu, c)
    r = room(w)
    a, b = aligned(r * 0.5), aligned(r * 0.75)
    w.ok("alloc", name="a", bytes=a)
    w.ok("free", name="a")  # cached by PyTorch: still reserved, still counted
    assert c.total() >= a
    # b fits the room only without the cache: the shim refuses the first cudaMalloc
    # (CUDA_ERROR_OUT_OF_MEMORY), PyTorch releases its cached blocks and retries. No error.
    w.ok("alloc", name="b", bytes=b)
    info = w.ok("info")
    assert info["usage"]["slot"]["oom_refusals"] >= 1, "the shim never refused: the test proves nothing"
    # What PyTorch still reserves is what the container is counted for: the cache is gone.
    assert abs(beyond_allocator(info) - beyond_allocator(w.ready)) <= SLACK, (w.ready, info)
    # Past the limit for real: PyTorch's own OutOfMemoryError, and the process goes on.
    before = c.total()
    out = w.call("alloc", name="c", bytes=aligned(r * 0.5))
    assert not out["ok"] and out["oom"], out
    assert "out of memory" in out["error"].lower()
    assert c.total() <= before  # nothing leaked into the count by the refused allocation
    w.ok("alloc", name="d", bytes=64 * MiB, seed=7)  # a smaller allocation succeeds
    assert w.ok("check", name="d")["bad_words"] == 0
    w.ok("free", name="b")
    w.ok("empty_cache")
    w.ok("alloc", name="e", bytes=aligned(r * 0.85), seed=9)
    assert w.ok("check", name="e")["bad_words"] == 0
    assert c.total() <= LIMIT


def test_expandable_segments_are_counted_by_what_is_mapped(
    spawn: Spawn, real_env: dict[str, str], gpu: Gpu, box
) -> None:
    c = box()
    w = start(spawn, real_env, gpu, c, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    r = room(w)
    ctx = beyond_allocator(w.ready)
    sizes = {"a": 300 * MiB, "b": 50 * MiB, "c": 3 * MiB, "d": 1 * MiB}
    for i, (name, n) in enumerate(sizes.items()):
        w.ok("alloc", name=name, bytes=n, seed=i)
    info = w.ok("info")
    used = assert_container_view(info, LIMIT)
    # PyTorch reserved address space for 9/8 of the (virtualised) GPU memory: more than the
    # limit, yet the allocations went through. Only mapped memory (cuMemCreate) counts.
    assert used >= sum(sizes.values())
    assert abs(beyond_allocator(info) - ctx) <= SEGMENT + SLACK, (w.ready, info)
    # Past the limit: an error, not a crash, and the mapped segments stay intact.
    out = w.call("alloc", name="big", bytes=aligned(r))
    assert not out["ok"] and out["oom"], out
    for name in sizes:
        assert w.ok("check", name=name)["bad_words"] == 0
    # Unmapped on empty_cache (cuMemUnmap + cuMemRelease): the count goes down with it.
    w.ok("free", name="a")
    w.ok("free", name="b")
    w.ok("empty_cache")
    after = w.ok("info")
    assert assert_container_view(after, LIMIT) <= used - 300 * MiB
    assert abs(beyond_allocator(after) - ctx) <= SEGMENT + SLACK, (w.ready, after)


@pytest.mark.parametrize("allocator", ["native", "cudaMallocAsync"])
def test_cuda_graphs_capture_and_replay_under_the_shim(
    allocator: str, spawn: Spawn, real_env: dict[str, str], gpu: Gpu, box
) -> None:
    extra = {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"} if allocator == "cudaMallocAsync" else {}
    w = start(spawn, real_env, gpu, box(), **extra)
    room(w)
    out = w.ok("graph", replays=5)
    assert out["wrong"] == 0
    # Every replay is one cuGraphLaunch, seen by the shim (activity, the swap-in gate).
    assert len(out["replay_launches"]) == 5 and all(n >= 1 for n in out["replay_launches"]), out
    assert_container_view(out, LIMIT)
    # PyTorch's reservations are counted (with cudaMallocAsync: the pool's reserved memory,
    # mg_pool.c); a graph's own memory pool may add to the count, never take from it.
    assert beyond_allocator(out) >= beyond_allocator(w.ready) - SLACK, (w.ready, out)
    if allocator == "native":
        assert beyond_allocator(out) <= beyond_allocator(w.ready) + SLACK, (w.ready, out)


def test_two_processes_share_one_container_limit(
    spawn: Spawn, real_env: dict[str, str], gpu: Gpu, box
) -> None:
    c = box()
    a = start(spawn, real_env, gpu, c, name="a")
    x = aligned(room(a) * 0.45)
    a.ok("alloc", name="x", bytes=x)
    b = start(spawn, real_env, gpu, c, name="b")
    # b sees the container, not itself: a's context and allocation are gone from its free
    # memory, and b paid its own context.
    used = assert_container_view(b.ready, LIMIT)
    assert b.ready["usage"]["live"] == 2
    assert used >= x + beyond_allocator(a.ready) and 0 < b.ready["usage"]["slot"]["used_bytes"] < x
    left = LIMIT - used
    out = b.call("alloc", name="y", bytes=aligned(left) + 64 * MiB)
    assert not out["ok"] and out["oom"], out
    y = aligned(left * 0.3)
    b.ok("alloc", name="y", bytes=y, seed=3)
    assert_container_view(a.ok("info"), LIMIT)  # and a sees b's
    # x does not fit beside y until a frees it.
    assert left - y < x
    out = b.call("alloc", name="z", bytes=x)
    assert not out["ok"] and out["oom"], out
    a.ok("free", name="x")
    a.ok("empty_cache")
    b.ok("alloc", name="z", bytes=x, seed=4)
    assert b.ok("check", name="y")["bad_words"] == 0 and b.ok("check", name="z")["bad_words"] == 0
    assert c.total() <= LIMIT
