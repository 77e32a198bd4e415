"""simgpu's fake libcuda: memory a program holds besides its allocations, as a GPU
charges it — contexts, modules, limits, graph memory — and memory that is not the
GPU's (host-located cuMem buffers and pools). Real cuda-python workloads, no shim.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from gpufrac.core import native
from gpufrac.simgpu.spec import create_node, spec_from_dict
from tests.fixtures.fakecuda import ctx_bytes, ok, run_py
from tests.fixtures.simnode import SimNode

MiB = 1 << 20

MINE = """
import os
from gpufrac.simgpu.nodestate import NodeState
def mine():
    with NodeState(os.environ["SIMGPU_STATE"]) as n:
        return sum(p.used_bytes for p in n.live_procs() if p.pid == os.getpid())
def gpu():
    with NodeState(os.environ["SIMGPU_STATE"]) as n:
        return int(n.gpus[0].used_bytes)
"""


def node_of(tmp_path: Path, gpu: dict, flavour: str = "release") -> SimNode:
    """A one-GPU node of the given GPU spec."""
    path = tmp_path / "node.state"
    create_node(spec_from_dict({"node_name": "n", "gpus": [gpu]}), path)
    native.library(native.FAKE_NVML, flavour)
    native.library(native.FAKE_CUDA, flavour)
    env = {"SIMGPU_STATE": str(path), "LD_LIBRARY_PATH": str(native.native_dir(flavour))}
    return SimNode(path=path, flavour=flavour, env=env)


def run(node: SimNode, body: str) -> list[dict]:
    """Run `body` with a primary context current on GPU 0 (`dev`, `ctx`) and MINE's
    helpers; what it said, after checking it exited cleanly."""
    return ok(run_py(node, MINE + "dev, ctx = setup(0)\n" + body))


H100 = {"model": "NVIDIA H100 80GB HBM3", "memory": "81559Mi", "reserved": "540Mi", "sm_count": 132}


def test_contexts_modules_and_limits_take_device_memory(tmp_path: Path) -> None:
    node = node_of(tmp_path, {**H100, "context_memory": "512Mi"})
    out = run(
        node,
        """
say(step="primary", mine=mine())
again = ck(d.cuDevicePrimaryCtxRetain(dev))
say(step="retained twice", mine=mine())
own = ck(d.cuCtxCreate(None, 0, dev))
mod = ck(d.cuModuleLoadData(b"SIMGPU-MODULE:3000000\\0"))
say(step="created", mine=mine())
ck(d.cuCtxSetLimit(d.CUlimit.CU_LIMIT_STACK_SIZE, 1024 + 256))
ck(d.cuCtxSetLimit(d.CUlimit.CU_LIMIT_MALLOC_HEAP_SIZE, (8 << 20) + (16 << 20)))
ck(d.cuCtxSetLimit(d.CUlimit.CU_LIMIT_PRINTF_FIFO_SIZE, 1 << 20))
say(step="limits", mine=mine(), heap=int(ck(d.cuCtxGetLimit(d.CUlimit.CU_LIMIT_MALLOC_HEAP_SIZE))))
ck(d.cuCtxDestroy(own))
say(step="destroyed", mine=mine())
ck(d.cuDevicePrimaryCtxRelease(dev))
say(step="released once", mine=mine())
ck(d.cuDevicePrimaryCtxRelease(dev))
say(step="inactive", mine=mine(), gpu=gpu())
""",
    )
    by = {o["step"]: o for o in out}
    ctx, mod, stack = 512 * MiB, 4 * MiB, 256 * 132 * 2048  # the module rounds up to 2 MiB granules
    assert by["primary"]["mine"] == ctx
    assert by["retained twice"]["mine"] == ctx
    assert by["created"]["mine"] == 2 * ctx + mod
    assert by["limits"] == {"step": "limits", "mine": 2 * ctx + mod + stack + 16 * MiB, "heap": 24 * MiB}
    assert by["destroyed"]["mine"] == ctx  # its module and limits went with it
    assert by["released once"]["mine"] == ctx
    assert by["inactive"] == {"step": "inactive", "mine": 0, "gpu": 0}


def test_a_context_or_limit_that_does_not_fit_fails(tmp_path: Path) -> None:
    node = node_of(tmp_path, {"model": "X", "memory": "1Gi", "sm_count": 8, "context_memory": "600Mi"})
    out = run(
        node,
        """
say(step="second", rc=err(d.cuCtxCreate(None, 0, dev)), mine=mine())
say(step="heap", rc=err(d.cuCtxSetLimit(d.CUlimit.CU_LIMIT_MALLOC_HEAP_SIZE, 1 << 30)),
    heap=int(ck(d.cuCtxGetLimit(d.CUlimit.CU_LIMIT_MALLOC_HEAP_SIZE))), mine=mine())
""",
    )
    assert out == [
        {"step": "second", "rc": 2, "mine": 600 * MiB},
        {"step": "heap", "rc": 2, "heap": 8 * MiB, "mine": 600 * MiB},
    ]


def test_graph_memory_comes_from_the_device_graph_pool(tmp_path: Path) -> None:
    node = node_of(tmp_path, {"model": "X", "memory": "1Gi"})
    out = run(
        node,
        """
A = d.CUgraphMem_attribute
def pool():
    return [int(ck(d.cuDeviceGetGraphMemAttribute(dev, a))) for a in (
        A.CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT, A.CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT,
        A.CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH)]
def graph(n):
    g = ck(d.cuGraphCreate(0))
    p = d.CUDA_MEM_ALLOC_NODE_PARAMS()
    p.poolProps.allocType = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    p.poolProps.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    p.bytesize = n
    node = ck(d.cuGraphAddMemAllocNode(g, None, 0, p))
    got = ck(d.cuGraphMemAllocNodeGetParams(node))
    ck(d.cuGraphAddMemFreeNode(g, [node], 1, p.dptr))
    return g, int(p.dptr), int(got.bytesize)
s = ck(d.cuStreamCreate(0))
g, ptr, size = graph(5 << 20)
say(step="added", size=size, has_address=ptr != 0, mine=mine())
e = ck(d.cuGraphInstantiate(g, 0))
say(step="instantiated", mine=mine(), pool=pool(), second=err(d.cuGraphInstantiate(g, 0)))
ck(d.cuGraphUpload(e, s))
ck(d.cuMemsetD32(ptr, 7, 4))
say(step="uploaded", mine=mine(), pool=pool())
ck(d.cuGraphLaunch(e, s))
ck(d.cuGraphExecDestroy(e))
say(step="destroyed", mine=mine(), pool=pool())
g2, _, _ = graph(4 << 20)
e2 = ck(d.cuGraphInstantiate(g2, 0))
ck(d.cuGraphLaunch(e2, s))
say(step="reused", mine=mine(), pool=pool())
big, _, _ = graph(2 << 30)
eb = ck(d.cuGraphInstantiate(big, 0))
say(step="too big", rc=err(d.cuGraphLaunch(eb, s)), mine=mine())
ck(d.cuGraphExecDestroy(e2))
ck(d.cuDeviceGraphMemTrim(dev))
say(step="trimmed", mine=mine(), pool=pool())
""",
    )
    by = {o["step"]: o for o in out}
    assert by["added"] == {"step": "added", "size": 5 * MiB, "has_address": True, "mine": 0}
    assert by["instantiated"] == {"step": "instantiated", "mine": 0, "pool": [0, 0, 0], "second": 801}
    assert by["uploaded"] == {"step": "uploaded", "mine": 6 * MiB, "pool": [6 * MiB, 6 * MiB, 6 * MiB]}
    assert by["destroyed"] == {"step": "destroyed", "mine": 6 * MiB, "pool": [0, 6 * MiB, 6 * MiB]}
    assert by["reused"] == {"step": "reused", "mine": 6 * MiB, "pool": [4 * MiB, 6 * MiB, 6 * MiB]}
    assert by["too big"] == {"step": "too big", "rc": 2, "mine": 6 * MiB}
    assert by["trimmed"] == {"step": "trimmed", "mine": 0, "pool": [0, 0, 6 * MiB]}


def test_host_locations_and_mipmaps(make_sim_node: Callable[..., SimNode]) -> None:
    node = make_sim_node()
    out = run(
        node,
        """
L = d.CUmemLocationType
prop = d.CUmemAllocationProp()
prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
prop.location.type = L.CU_MEM_LOCATION_TYPE_HOST_NUMA
h = ck(d.cuMemCreate(64 << 20, prop, 0))
say(step="host cuMem", mine=mine(), granularity=int(ck(d.cuMemGetAllocationGranularity(prop, 0))))
ck(d.cuMemRelease(h))
props = d.CUmemPoolProps()
props.allocType = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
props.location.type = L.CU_MEM_LOCATION_TYPE_HOST
pool = ck(d.cuMemPoolCreate(props))
s = ck(d.cuStreamCreate(0))
p = ck(d.cuMemAllocFromPoolAsync(32 << 20, pool, s))
ck(d.cuMemsetD32(p, 1, 16))
say(step="host pool", mine=mine(), current=err(d.cuDeviceSetMemPool(dev, pool)))
desc = d.CUDA_ARRAY3D_DESCRIPTOR()
desc.Width, desc.Height, desc.NumChannels = 64, 16, 4
desc.Format = d.CUarray_format.CU_AD_FORMAT_UNSIGNED_INT8
m = ck(d.cuMipmappedArrayCreate(desc, 7))
say(step="mipmap", mine=mine(), too_many=err(d.cuMipmappedArrayCreate(desc, 8)))
ck(d.cuMipmappedArrayDestroy(m))
say(step="mipmap gone", mine=mine())
""",
    )
    # levels 64x16, 32x8, 16x4, 8x2, 4x1, 2x1, 1x1 of 4 bytes, each 512-byte aligned
    mip = 4096 + 1024 + 512 * 5
    ctx = ctx_bytes(node)  # the process's context (the preset's estimate): all it holds on the GPU
    assert ctx > 0
    assert out == [
        {"step": "host cuMem", "mine": ctx, "granularity": 2 * MiB},
        {"step": "host pool", "mine": ctx, "current": 101},
        {"step": "mipmap", "mine": ctx + mip, "too_many": 1},
        {"step": "mipmap gone", "mine": ctx},
    ]
