"""memguard: CUDA graph memory is counted, and a graph that does not fit does not run.

Graph memory nodes (cuGraphAddMemAllocNode, cuGraphAddNode with a MEM_ALLOC node,
cuMemAllocAsync while a stream is captured) get physical memory from the device's
graph memory pool when the executable graph is uploaded or first launched; the pool
keeps it until cuDeviceGraphMemTrim. The container is charged for the pool's
reservation, checked against the limit before the memory is taken: an over-limit
launch fails with CUDA_ERROR_OUT_OF_MEMORY and runs nothing, never silently.

Real processes under the real shim on a simulated node, release and ASan+UBSan builds.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable

from tests.fixtures.memguard import NVML, Container, MiB, Shim

OOM = 2

# Helpers for the workloads below (they run after tests.fixtures.memguard' prelude:
# a current primary context, chk/rc/used, `out`).
GRAPH = (
    NVML
    + """
U64, U32 = ctypes.c_uint64, ctypes.c_uint32
def reserved():
    a = cu.CUgraphMem_attribute.CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT
    return int(chk(cu.cuDeviceGetGraphMemAttribute(dev, a)))
def alloc_params(n, kind=cu.CUDA_MEM_ALLOC_NODE_PARAMS):
    p = kind()
    p.poolProps.allocType = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    p.poolProps.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    p.poolProps.location.id = 0
    p.bytesize = n
    return p
def graph_with_alloc(n):
    g = chk(cu.cuGraphCreate(0))
    p = alloc_params(n)
    node = chk(cu.cuGraphAddMemAllocNode(g, None, 0, p))
    return g, node, int(p.dptr)
mod = chk(cu.cuModuleLoadData(b"SIMGPU-MODULE\\0"))
fill = chk(cu.cuModuleGetFunction(mod, b"fill_u32"))
"""
)


def graph_body(body: str) -> str:
    return GRAPH + textwrap.dedent(body)


def test_a_memory_node_within_the_limit_runs_and_is_counted_until_trimmed(
    shim: Shim, container: Callable[..., Container]
) -> None:
    """A graph with a 64 MiB memory node under a 96 MiB limit: nothing is counted
    at instantiate, 64 MiB from its first launch (as NVML shows and the graph pool
    reports), the same after a second launch and after the executable graph is
    destroyed (the pool keeps it), nothing after cuDeviceGraphMemTrim."""
    out = shim.python(
        container(request=96 * MiB, limit=96 * MiB),
        graph_body(
            """
        g, node, ptr = graph_with_alloc(64 * 2**20)
        e = chk(cu.cuGraphInstantiate(g, 0))
        out["instantiated"] = used()
        s = chk(cu.cuStreamCreate(0))
        out["launch"] = rc(cu.cuGraphLaunch(e, s))
        out["launched"] = [used(), nvml(), reserved()]
        out["again"] = rc(cu.cuGraphLaunch(e, s))
        chk(cu.cuStreamSynchronize(s))
        out["twice"] = used()
        chk(cu.cuGraphExecDestroy(e))
        out["destroyed"] = used()
        chk(cu.cuDeviceGraphMemTrim(dev))
        out["trimmed"] = [used(), nvml()]
        """
        ),
    )
    m64 = 64 * MiB
    assert out == {
        "instantiated": 0,
        "launch": 0,
        "launched": [m64, m64, m64],
        "again": 0,
        "twice": m64,
        "destroyed": m64,
        "trimmed": [0, 0],
    }


def test_a_graph_over_the_limit_fails_to_launch(shim: Shim, container: Callable[..., Container]) -> None:
    """A 128 MiB memory node under a 96 MiB limit: cuGraphUpload and cuGraphLaunch
    both fail with CUDA_ERROR_OUT_OF_MEMORY and the GPU holds nothing for it; a
    32 MiB graph on top of 48 MiB of cuMemAlloc fits, a second 32 MiB graph no longer
    does."""
    out = shim.python(
        container(request=96 * MiB, limit=96 * MiB),
        graph_body(
            """
        s = chk(cu.cuStreamCreate(0))
        g, node, ptr = graph_with_alloc(128 * 2**20)
        e = chk(cu.cuGraphInstantiate(g, 0))
        out["upload"] = rc(cu.cuGraphUpload(e, s))
        out["launch"] = rc(cu.cuGraphLaunch(e, s))
        out["after"] = [used(), nvml(), reserved()]
        buf = chk(cu.cuMemAlloc(48 * 2**20))
        g1, _, _ = graph_with_alloc(32 * 2**20)
        e1 = chk(cu.cuGraphInstantiate(g1, 0))
        out["fits"] = [rc(cu.cuGraphLaunch(e1, s)), used()]
        g2, _, _ = graph_with_alloc(32 * 2**20)
        e2 = chk(cu.cuGraphInstantiate(g2, 0))
        out["second"] = [rc(cu.cuGraphLaunch(e2, s)), used(), nvml()]
        """
        ),
    )
    assert out["upload"] == OOM and out["launch"] == OOM
    assert out["after"] == [0, 0, 0]
    assert out["fits"] == [0, 80 * MiB]
    assert out["second"] == [OOM, 80 * MiB, 80 * MiB]


def test_a_memory_node_added_through_cuGraphAddNode_counts(
    shim: Shim, container: Callable[..., Container]
) -> None:
    """The generic entry point: a MEM_ALLOC node through cuGraphAddNode is counted
    like one from cuGraphAddMemAllocNode, and refused the same way past the limit."""
    out = shim.python(
        container(request=96 * MiB, limit=96 * MiB),
        graph_body(
            """
        s = chk(cu.cuStreamCreate(0))
        def generic(n):
            g = chk(cu.cuGraphCreate(0))
            p = cu.CUgraphNodeParams()
            p.type = cu.CUgraphNodeType.CU_GRAPH_NODE_TYPE_MEM_ALLOC
            p.alloc = alloc_params(n, cu.CUDA_MEM_ALLOC_NODE_PARAMS_v2)
            chk(cu.cuGraphAddNode(g, None, None, 0, p))
            return chk(cu.cuGraphInstantiate(g, 0))
        big = generic(256 * 2**20)
        out["big"] = [rc(cu.cuGraphLaunch(big, s)), used()]
        small = generic(40 * 2**20)
        out["small"] = [rc(cu.cuGraphLaunch(small, s)), used(), nvml()]
        """
        ),
    )
    assert out == {"big": [OOM, 0], "small": [0, 40 * MiB, 40 * MiB]}


def test_allocations_captured_into_a_graph_count_when_it_runs(
    shim: Shim, container: Callable[..., Container]
) -> None:
    """cuMemAllocAsync on a capturing stream is a memory node: not memory yet (not
    counted while capturing), counted from the graph's launch, where a kernel of the
    graph fills it; a captured allocation past the limit makes its graph's launch
    fail with OUT_OF_MEMORY (PyTorch's cudaMallocAsync backend with CUDA graphs)."""
    out = shim.python(
        container(request=96 * MiB, limit=96 * MiB),
        graph_body(
            """
        s = chk(cu.cuStreamCreate(1))
        def captured(n):
            chk(cu.cuStreamBeginCapture(s, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL))
            p = chk(cu.cuMemAllocAsync(n, s))
            chk(cu.cuLaunchKernel(fill, 1, 1, 1, 128, 1, 1, 0, s, ((int(p), n // 4, 7), (U64, U64, U32)), 0))
            chk(cu.cuMemFreeAsync(p, s))
            g = chk(cu.cuStreamEndCapture(s))
            return g, p
        g, p = captured(64 * 2**20)
        out["captured"] = used()
        e = chk(cu.cuGraphInstantiate(g, 0))
        out["launch"] = rc(cu.cuGraphLaunch(e, s))
        out["sync"] = rc(cu.cuStreamSynchronize(s))
        out["launched"] = [used(), nvml()]
        first = ctypes.c_uint32()
        chk(cu.cuMemcpyDtoH(ctypes.addressof(first), p, 4))
        out["filled"] = first.value
        g2, _ = captured(64 * 2**20)
        e2 = chk(cu.cuGraphInstantiate(g2, 0))
        out["second"] = [rc(cu.cuGraphLaunch(e2, s)), used(), nvml()]
        """
        ),
    )
    m64 = 64 * MiB
    assert out == {
        "captured": 0,
        "launch": 0,
        "sync": 0,
        "launched": [m64, m64],
        "filled": 7,
        "second": [OOM, m64, m64],
    }
