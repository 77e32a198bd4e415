"""simgpu's fake libcuda.so.1: the virtual memory API, stream-ordered pools and
symbol resolution through cuGetProcAddress, each driven by a real subprocess."""

from __future__ import annotations

import textwrap
from collections.abc import Callable

import pytest

from tests.fixtures.fakecuda import MIB, Workload, gpu_used, ok, run_py, slot_used
from tests.fixtures.simnode import SimNode


@pytest.fixture
def sim_node(make_sim_node: Callable[..., SimNode]) -> SimNode:
    # Contexts cost nothing here: these tests read the GPU's used memory to the byte to check
    # what VMM and pools charge, and each process's context would only add a constant.
    # test_fake_cuda.py checks a context's charge on the presets' own figures.
    return make_sim_node(context_memory=0)


def script(*parts: str) -> str:
    """Join workload fragments written at different indentations."""
    return "\n".join(textwrap.dedent(p) for p in parts)


VMM_PRELUDE = """
dev, ctx = setup(0)
k = kernels()
prop = d.CUmemAllocationProp()
prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
prop.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
prop.location.id = 0
acc = d.CUmemAccessDesc()
acc.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
acc.location.id = 0
acc.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
MINIMUM = d.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
gran = ck(d.cuMemGetAllocationGranularity(prop, MINIMUM))
"""


def test_vmm_counts_at_create_and_keeps_addresses(sim_node: SimNode) -> None:
    w = Workload(
        sim_node,
        script(
            VMM_PRELUDE,
            """
        va = ck(d.cuMemAddressReserve(8 * gran, 0, 0, 0))
        say(step="reserved", gran=gran)
        wait_for("go")
        h = ck(d.cuMemCreate(4 * gran, prop, 0))
        say(step="created", misaligned=err(d.cuMemCreate(gran + 4096, prop, 0)))
        wait_for("go")
        n = 4 * gran // 4
        ck(d.cuMemMap(va, 4 * gran, 0, h, 0))
        no_access = err(d.cuMemsetD32(va, 1, 4))
        ck(d.cuMemSetAccess(va, 4 * gran, [acc], 1))
        fill(k, va, n, 0x5EED)
        ck(d.cuCtxSynchronize())
        ck(d.cuMemUnmap(va, 4 * gran))
        unmapped = err(d.cuMemsetD32(va, 1, 4))
        ck(d.cuMemMap(va, 4 * gran, 0, h, 0))           # the same address again
        ck(d.cuMemSetAccess(va, 4 * gran, [acc], 1))
        same_va = mismatches(k, va, n, 0x5EED)
        ck(d.cuMemUnmap(va, 4 * gran))
        other = int(va) + 4 * gran                       # and somewhere else in the reservation
        ck(d.cuMemMap(other, 4 * gran, 0, h, 0))
        ck(d.cuMemSetAccess(other, 4 * gran, [acc], 1))
        moved = mismatches(k, other, n, 0x5EED)
        retained = ck(d.cuMemRetainAllocationHandle(other + 12345))
        same_handle = int(retained) == int(h)
        ck(d.cuMemRelease(retained))
        ck(d.cuMemRelease(h))
        say(step="released-but-mapped", no_access=no_access, unmapped=unmapped, same_va=same_va,
            moved=moved, same_handle=same_handle,
            range=[int(x) for x in ck(d.cuMemGetAddressRange(other + 8))])
        wait_for("go")
        ck(d.cuMemUnmap(other, 4 * gran))
        ck(d.cuMemAddressFree(va, 8 * gran))
        say(step="unmapped", double_release=err(d.cuMemRelease(h)))
        wait_for("exit")
        """,
        ),
    )
    try:
        r = w.read()
        gran = r["gran"]
        assert gran == 2 * MIB
        assert gpu_used(sim_node) == 0  # a reservation is address space, not memory
        w.send("go")
        r = w.read()
        assert r == {"step": "created", "misaligned": 1}
        assert gpu_used(sim_node) == slot_used(sim_node, w.p.pid) == 4 * gran
        w.send("go")
        r = w.read()
        assert r["no_access"] == 1 and r["unmapped"] == 1  # CUDA_ERROR_INVALID_VALUE
        assert r["same_va"] == 0 and r["moved"] == 0 and r["same_handle"]
        assert r["range"][1] == 4 * gran
        assert gpu_used(sim_node) == 4 * gran  # still mapped: still held
        w.send("go")
        r = w.read()
        assert r == {"step": "unmapped", "double_release": 1}
        assert gpu_used(sim_node) == slot_used(sim_node, w.p.pid) == 0
        w.send("exit")
        w.finish()
    finally:
        w.kill()


def test_async_pool_accounting_and_release_threshold(sim_node: SimNode) -> None:
    w = Workload(
        sim_node,
        """
        dev, ctx = setup(0)
        pool = ck(d.cuDeviceGetDefaultMemPool(dev))
        A = d.CUmemPool_attribute
        def attr(a):
            return int(ck(d.cuMemPoolGetAttribute(pool, a)))
        def report(step):
            say(step=step, reserved=attr(A.CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT),
                used=attr(A.CU_MEMPOOL_ATTR_USED_MEM_CURRENT), high=attr(A.CU_MEMPOOL_ATTR_USED_MEM_HIGH))
            wait_for("go")
        s = ck(d.cuStreamCreate(0))
        p = ck(d.cuMemAllocAsync(3 << 20, s))
        report("allocated")
        ck(d.cuMemFreeAsync(p, s))
        report("freed")
        ck(d.cuStreamSynchronize(s))
        report("synchronized")
        ck(d.cuMemPoolSetAttribute(pool, A.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, d.cuuint64_t(64 << 20)))
        p = ck(d.cuMemAllocAsync(10 << 20, s))
        ck(d.cuMemFreeAsync(p, s))
        ck(d.cuStreamSynchronize(s))
        q = ck(d.cuMemAllocAsync(10 << 20, s))
        say(reused=int(q) == int(p))
        ck(d.cuMemFreeAsync(q, s))
        ck(d.cuStreamSynchronize(s))
        report("kept")
        ck(d.cuMemPoolTrimTo(pool, 0))
        report("trimmed")
        props = d.CUmemPoolProps()
        props.allocType = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        props.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        props.location.id = 0
        mine = ck(d.cuMemPoolCreate(props))
        r = ck(d.cuMemAllocFromPoolAsync(6 << 20, mine, s))
        say(step="own-pool", gpu_bytes=0)
        wait_for("go")
        ck(d.cuMemFreeAsync(r, s))
        ck(d.cuMemPoolDestroy(mine))
        ck(d.cuStreamSynchronize(s))
        say(step="end", bad_free=err(d.cuMemFreeAsync(r, s)),
            default_destroy=err(d.cuMemPoolDestroy(pool)))
        """,
    )
    try:
        steps = {}
        for step, gpu in [("allocated", 4), ("freed", 4), ("synchronized", 0), ("kept", 10), ("trimmed", 0)]:
            r = w.read()
            if "reused" in r:
                assert r["reused"]  # a freed block is reused from the pool
                r = w.read()
            assert r["step"] == step
            assert gpu_used(sim_node) == gpu * MIB, step  # the pool's reserved memory is what the GPU holds
            steps[step] = r
            w.send("go")
        assert (steps["allocated"]["reserved"], steps["allocated"]["used"]) == (4 * MIB, 4 * MIB)
        assert (steps["freed"]["reserved"], steps["freed"]["used"]) == (4 * MIB, 0)
        assert steps["synchronized"]["reserved"] == 0  # threshold 0: released at synchronize
        assert (steps["kept"]["reserved"], steps["kept"]["high"]) == (10 * MIB, 10 * MIB)
        assert w.read()["step"] == "own-pool"
        assert gpu_used(sim_node) == 6 * MIB
        w.send("go")
        assert w.read() == {"step": "end", "bad_free": 1, "default_destroy": 1}
        w.finish()
    finally:
        w.kill()
    assert gpu_used(sim_node) == 0


PROC_PRELUDE = """
import ctypes
lib = ctypes.CDLL("libcuda.so.1")
gpa = lib.cuGetProcAddress_v2
gpa.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_uint64,
                ctypes.POINTER(ctypes.c_int)]
def look(name, version, flags=0):
    fn, status = ctypes.c_void_p(), ctypes.c_int(-1)
    r = gpa(name.encode(), ctypes.byref(fn), version, flags, ctypes.byref(status))
    return [r, fn.value, status.value]
def addr(symbol):
    return ctypes.cast(getattr(lib, symbol), ctypes.c_void_p).value
"""

# (base name, cudaVersion, flags) -> the exported symbol real libcuda hands out.
RESOLVES = [
    ("cuMemAlloc", 12000, 0, "cuMemAlloc_v2"),
    ("cuMemAlloc", 3010, 0, "cuMemAlloc"),  # the legacy 32-bit entry point
    ("cuMemFree", 3020, 0, "cuMemFree_v2"),
    ("cuMemGetInfo", 12000, 0, "cuMemGetInfo_v2"),
    ("cuDeviceTotalMem", 12000, 0, "cuDeviceTotalMem_v2"),
    ("cuCtxCreate", 3020, 0, "cuCtxCreate_v2"),
    ("cuCtxCreate", 12000, 0, "cuCtxCreate_v3"),
    ("cuCtxCreate", 12050, 0, "cuCtxCreate_v4"),
    ("cuCtxDestroy", 12000, 0, "cuCtxDestroy_v2"),
    ("cuDevicePrimaryCtxRelease", 11000, 0, "cuDevicePrimaryCtxRelease_v2"),
    ("cuDevicePrimaryCtxRelease", 10020, 0, "cuDevicePrimaryCtxRelease"),
    ("cuMemcpyHtoD", 12000, 0, "cuMemcpyHtoD_v2"),
    ("cuMemcpyHtoD", 12000, 1, "cuMemcpyHtoD_v2"),
    ("cuMemcpyHtoD", 12000, 2, "cuMemcpyHtoD_v2_ptds"),
    ("cuMemcpyAsync", 12000, 2, "cuMemcpyAsync_ptsz"),
    ("cuLaunchKernel", 12000, 0, "cuLaunchKernel"),
    ("cuLaunchKernel", 12000, 2, "cuLaunchKernel_ptsz"),
    ("cuLaunchKernelEx", 12000, 2, "cuLaunchKernelEx_ptsz"),
    ("cuGraphLaunch", 12000, 2, "cuGraphLaunch_ptsz"),
    ("cuMemAllocAsync", 12000, 2, "cuMemAllocAsync_ptsz"),
    ("cuMemAllocFromPoolAsync", 12000, 0, "cuMemAllocFromPoolAsync"),
    ("cuMemCreate", 12000, 2, "cuMemCreate"),  # no stream, no twin: the flag changes nothing
    ("cuStreamBeginCapture", 12000, 0, "cuStreamBeginCapture_v2"),
    ("cuStreamBeginCapture", 10000, 0, "cuStreamBeginCapture"),
    ("cuGraphInstantiate", 12000, 0, "cuGraphInstantiateWithFlags"),
    ("cuGraphInstantiate", 11000, 0, "cuGraphInstantiate_v2"),
    ("cuGraphAddKernelNode", 12000, 0, "cuGraphAddKernelNode_v2"),
    ("cuEventElapsedTime", 12080, 0, "cuEventElapsedTime_v2"),
    ("cuDeviceGetUuid", 12000, 0, "cuDeviceGetUuid_v2"),
    ("cuGetProcAddress", 12000, 0, "cuGetProcAddress_v2"),
    ("cuGetProcAddress", 11030, 0, "cuGetProcAddress"),
    ("cuCheckpointProcessLock", 12080, 0, "cuCheckpointProcessLock"),
]


def test_get_proc_address_maps_versions_and_stream_flavours(sim_node: SimNode) -> None:
    r = run_py(
        sim_node,
        script(
            PROC_PRELUDE,
            f"""
        out = []
        for name, version, flags, symbol in {RESOLVES!r}:
            res, fn, status = look(name, version, flags)
            out.append([name, version, flags, res, status, fn == addr(symbol)])
        say(resolved=out,
            too_old=look("cuMemAllocAsync", 11010), unknown=look("cuNoSuchFunction", 12000),
            too_new=look("cuCheckpointProcessLock", 12000), bad_flags=look("cuMemAlloc", 12000, 4)[0],
            legacy_api=lib.cuGetProcAddress(b"cuInit", ctypes.byref(ctypes.c_void_p()), 12000, 0))
        """,
        ),
    )
    (res,) = ok(r)
    for name, version, flags, result, status, same in res["resolved"]:
        assert (result, status, same) == (0, 0, True), (name, version, flags)
    # Known name, no variant that old: CUDA_ERROR_NOT_FOUND + VERSION_NOT_SUFFICIENT, no pointer.
    assert res["too_old"] == [500, None, 2] and res["too_new"] == [500, None, 2]
    assert res["unknown"] == [500, None, 1]  # SYMBOL_NOT_FOUND
    assert res["bad_flags"] == 1 and res["legacy_api"] == 0


@pytest.mark.parametrize("ptds", ["0", "1"])
def test_cuda_python_per_thread_default_stream_mode(make_sim_node: Callable[..., SimNode], ptds: str) -> None:
    """cuda-python resolves every function with the per-thread flag when asked to;
    the _ptds/_ptsz twins then carry the whole workload."""
    node = make_sim_node("dgx-h100")
    env = {"CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM": "1"} if ptds == "1" else {}
    r = run_py(
        node,
        """
        dev, ctx = setup(0)
        k = kernels()
        buf = ck(d.cuMemAlloc(4096 * 4))
        fill(k, buf, 4096, 3, d.CUstream(2))        # CU_STREAM_PER_THREAD
        ck(d.cuStreamSynchronize(0))
        ck(d.cuMemsetD32(int(buf) + 4, 9, 1))
        say(bad=mismatches(k, buf, 4096, 3))
        """,
        **env,
    )
    assert ok(r) == [{"bad": 1}]


def test_ctypes_workload_with_legacy_and_current_entry_points(sim_node: SimNode) -> None:
    """A ctypes program calling exported symbols directly, as old binaries do."""
    r = run_py(
        sim_node,
        """
        import ctypes
        lib = ctypes.CDLL("libcuda.so.1")
        c_u = ctypes.c_uint
        def call(name, *args):
            rc = getattr(lib, name)(*args)
            if rc:
                raise SystemExit(f"{name} -> {rc}")
        call("cuInit", 0)
        dev, ctx = ctypes.c_int(), ctypes.c_void_p()
        call("cuDeviceGet", ctypes.byref(dev), 0)
        call("cuCtxCreate_v2", ctypes.byref(ctx), 0, dev)
        free0, total = ctypes.c_size_t(), ctypes.c_size_t()
        call("cuMemGetInfo_v2", ctypes.byref(free0), ctypes.byref(total))
        p64, p32 = ctypes.c_uint64(), c_u()
        call("cuMemAlloc_v2", ctypes.byref(p64), ctypes.c_size_t(1 << 20))
        call("cuMemAlloc", ctypes.byref(p32), c_u(1 << 20))
        src = (ctypes.c_char * 8).from_buffer_copy(b"simgpu!!")
        dst = (ctypes.c_char * 8)()
        call("cuMemcpyHtoD_v2", ctypes.c_uint64(p32.value), src, ctypes.c_size_t(8))
        call("cuMemcpyDtoD_v2", p64, ctypes.c_uint64(p32.value), ctypes.c_size_t(8))
        call("cuMemcpyDtoH_v2", dst, p64, ctypes.c_size_t(8))
        free1 = ctypes.c_size_t()
        call("cuMemGetInfo_v2", ctypes.byref(free1), ctypes.byref(total))
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        call("cuMemGetAddressRange_v2", ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(p32.value))
        call("cuMemFree", p32)
        call("cuMemFree_v2", p64)
        call("cuCtxDestroy_v2", ctx)
        say(copied=bytes(dst).decode(), used=free0.value - free1.value,
            legacy_range=[base.value == p32.value, size.value])
        """,
    )
    assert ok(r) == [{"copied": "simgpu!!", "used": 2 * MIB, "legacy_range": [True, MIB]}]


def test_pitch_managed_host_and_array_accounting(sim_node: SimNode) -> None:
    """What each allocation kind draws from the GPU: pitch, managed and arrays do,
    pinned host memory does not."""
    r = run_py(
        sim_node,
        """
        dev, ctx = setup(0)
        def free():
            return ck(d.cuMemGetInfo())[0]
        f0 = free()
        p, pitch = ck(d.cuMemAllocPitch(1000, 300, 4))
        f1 = free()
        m = ck(d.cuMemAllocManaged(3 << 20, d.CUmemAttach_flags.CU_MEM_ATTACH_GLOBAL))
        f2 = free()
        h = ck(d.cuMemAllocHost(8 << 20))
        f3 = free()
        desc = d.CUDA_ARRAY_DESCRIPTOR()
        desc.Width, desc.Height = 1024, 256
        desc.Format = d.CUarray_format.CU_AD_FORMAT_FLOAT
        desc.NumChannels = 4
        arr = ck(d.cuArrayCreate(desc))
        f4 = free()
        ck(d.cuArrayDestroy(arr))
        ck(d.cuMemFreeHost(h))
        ck(d.cuMemFree(m))
        ck(d.cuMemFree(p))
        say(pitch=pitch, pitched=f0 - f1, managed=f1 - f2, host=f2 - f3, array=f3 - f4, back=free() == f0,
            bad_elem=err(d.cuMemAllocPitch(1000, 300, 3)), bad_flags=err(d.cuMemAllocManaged(4096, 0)),
            host_as_device=err(d.cuMemFree(h)))
        """,
    )
    assert ok(r) == [
        {
            "pitch": 1024,
            "pitched": 1024 * 300,
            "managed": 3 * MIB,
            "host": 0,
            "array": 1024 * 256 * 16,
            "back": True,
            "bad_elem": 1,
            "bad_flags": 1,
            "host_as_device": 1,
        }
    ]
