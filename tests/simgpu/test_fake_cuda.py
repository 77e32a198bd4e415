"""simgpu's fake libcuda.so.1 driven by real workloads: cuda-python and ctypes in
subprocesses on a simulated node, checked against the node-state file.

The core tests run against both the release build and the ASan/UBSan build."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from gpufrac.core import native
from tests.fixtures.fakecuda import (
    GIB,
    MIB,
    Workload,
    ctx_bytes,
    gpu_fields,
    gpu_used,
    ok,
    run_py,
    slot_fields,
    slot_used,
)
from tests.fixtures.simnode import SimNode


@pytest.fixture(params=["release", "asan"])
def flavour_node(request: pytest.FixtureRequest, make_sim_node: Callable[..., SimNode]) -> SimNode:
    return make_sim_node("dgx-h100", flavour=request.param)


# ----------------------------------------------------------------------------- core


def test_each_flavour_loads_its_own_driver(flavour_node: SimNode) -> None:
    """The ASan runs really run the instrumented fake driver (and the release runs
    the release one), judged from the running process's memory map."""
    code = """
        ck(d.cuInit(0))
        maps = [ln.split(None, 5)[5].strip() for ln in open("/proc/self/maps") if len(ln.split(None, 5)) == 6]
        say(cuda=sorted({p for p in maps if "libcuda.so" in p}), asan=any("libasan" in p for p in maps))
        """
    (res,) = ok(run_py(flavour_node, code))
    builds = native.native_dir(flavour_node.flavour).resolve()
    assert [Path(p).resolve().parent for p in res["cuda"]] == [builds], res
    assert res["asan"] == (flavour_node.flavour == "asan")


def test_devices_contexts_alloc_and_node_state(flavour_node: SimNode) -> None:
    node = flavour_node
    w = Workload(
        node,
        """
        dev, ctx = setup(0)
        Attr = d.CUdevice_attribute
        uuid = bytes(ck(d.cuDeviceGetUuid(dev)).bytes)
        bus = ck(d.cuDeviceGetPCIBusId(32, dev)).split(b"\\0")[0].decode()
        say(count=ck(d.cuDeviceGetCount()), name=ck(d.cuDeviceGetName(64, dev)).split(b"\\0")[0].decode(),
            uuid=uuid.hex(), total=ck(d.cuDeviceTotalMem(dev)), bus=bus,
            by_bus=int(ck(d.cuDeviceGetByPCIBusId(bus.encode()))),
            cc=ck(d.cuDeviceGetAttribute(Attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)),
            sms=ck(d.cuDeviceGetAttribute(Attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev)),
            version=ck(d.cuDriverGetVersion()))
        free0, total = ck(d.cuMemGetInfo())
        p = ck(d.cuMemAlloc(64 << 20))
        free1, _ = ck(d.cuMemGetInfo())
        base, size = ck(d.cuMemGetAddressRange(int(p) + 12345))
        say(free0=free0, free1=free1, total=total, base=int(base), p=int(p), size=size)
        wait_for("free")
        ck(d.cuMemFree(p))
        free2, _ = ck(d.cuMemGetInfo())
        c2 = ck(d.cuCtxCreate(None, 0, dev))
        cur = ck(d.cuCtxGetCurrent())
        ck(d.cuCtxDestroy(c2))
        say(free2=free2, created_is_current=int(cur) == int(c2),
            double_free=err(d.cuMemFree(p)), state=ck(d.cuDevicePrimaryCtxGetState(dev))[1])
        """,
    )
    try:
        info = w.read()
        g = gpu_fields(node, 0)
        assert info["count"] == g["gpu_count"] == 8
        assert info["name"] == g["name"].decode()
        assert info["uuid"] == g["uuid"].decode().removeprefix("GPU-").replace("-", "")
        assert info["total"] == g["total_bytes"]
        assert info["by_bus"] == 0 and info["bus"].endswith(g["pci_bus_id"].decode()[-7:].lower())
        assert (info["cc"], info["sms"], info["version"]) == (g["cc_major"], g["sm_count"], g["driver"])
        mem = w.read()
        assert mem["free0"] - mem["free1"] == 64 * MIB
        assert (mem["base"], mem["size"]) == (mem["p"], 64 * MIB)
        # NVML's view: this process holds the memory on GPU 0, and its context's.
        assert slot_used(node, w.p.pid) == ctx_bytes(node) + 64 * MIB
        w.send("free")
        end = w.read()
        assert end["free2"] == mem["free0"]
        assert end["created_is_current"] and end["state"] == 1
        assert end["double_free"] == 1  # CUDA_ERROR_INVALID_VALUE
        w.finish()
    finally:
        w.kill()
    assert gpu_used(node) == 0


def test_not_initialized_and_bad_arguments(sim_node: SimNode) -> None:
    r = run_py(
        sim_node,
        """
        say(before=err(d.cuDeviceGetCount()), flags=err(d.cuInit(1)))
        dev, ctx = setup(0)
        say(bad_dev=err(d.cuDeviceGet(99)), zero=err(d.cuMemAlloc(0)),
            name=ck(d.cuGetErrorName(d.CUresult.CUDA_ERROR_OUT_OF_MEMORY)).decode(),
            text=ck(d.cuGetErrorString(d.CUresult.CUDA_ERROR_INVALID_VALUE)).decode())
        ck(d.cuCtxSetCurrent(None))
        say(no_ctx=err(d.cuMemAlloc(1024)))
        """,
    )
    first, second, third = ok(r)
    assert first == {"before": 3, "flags": 1}  # NOT_INITIALIZED, INVALID_VALUE
    assert second["bad_dev"] == 101 and second["zero"] == 1
    assert second["name"] == "CUDA_ERROR_OUT_OF_MEMORY" and second["text"] == "invalid argument"
    assert third["no_ctx"] == 201  # CUDA_ERROR_INVALID_CONTEXT


def test_visible_devices_filtering(sim_node: SimNode) -> None:
    code = """
        ck(d.cuInit(0))
        n = ck(d.cuDeviceGetCount())
        say(count=n, uuids=[bytes(ck(d.cuDeviceGetUuid(ck(d.cuDeviceGet(i)))).bytes).hex() for i in range(n)])
        """
    uuids = [gpu_fields(sim_node, i)["uuid"].decode().removeprefix("GPU-").replace("-", "") for i in range(8)]
    (res,) = ok(run_py(sim_node, code, CUDA_VISIBLE_DEVICES="2,0"))
    assert res == {"count": 2, "uuids": [uuids[2], uuids[0]]}
    # The container runtime's list applies first; CUDA's indices are into what is left.
    (res,) = ok(run_py(sim_node, code, NVIDIA_VISIBLE_DEVICES="5,3", CUDA_VISIBLE_DEVICES="1"))
    assert res == {"count": 1, "uuids": [uuids[3]]}
    by_uuid = gpu_fields(sim_node, 6)["uuid"].decode()
    (res,) = ok(run_py(sim_node, code, CUDA_VISIBLE_DEVICES=by_uuid))
    assert res == {"count": 1, "uuids": [uuids[6]]}
    r = run_py(sim_node, "say(init=err(d.cuInit(0)))", NVIDIA_VISIBLE_DEVICES="none")
    assert ok(r) == [{"init": 100}]  # CUDA_ERROR_NO_DEVICE


@pytest.mark.parametrize("var", ["CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"])
def test_visible_devices_set_but_empty_hides_every_gpu(sim_node: SimNode, var: str) -> None:
    """Set but empty is not unset: no GPU is visible, as with the real driver
    (CUDA_VISIBLE_DEVICES=) and the container runtime (NVIDIA_VISIBLE_DEVICES=).
    cuInit says CUDA_ERROR_NO_DEVICE and, initialisation having failed, the
    device queries answer CUDA_ERROR_NOT_INITIALIZED, as the real driver does."""
    code = "say(init=err(d.cuInit(0)), count=err(d.cuDeviceGetCount()), get=err(d.cuDeviceGet(0)))"
    assert ok(run_py(sim_node, code, **{var: ""})) == [{"init": 100, "count": 3, "get": 3}]


def test_physical_oom_between_two_processes(make_sim_node: Callable[..., SimNode]) -> None:
    node = make_sim_node("pcie-l4x4")  # 23034 MiB, 318 MiB reserved
    holder = Workload(
        node,
        """
        setup(0)
        p = ck(d.cuMemAlloc(12 << 30))
        say(held=True)
        wait_for("exit")
        """,
    )
    try:
        holder.read()
        r = run_py(
            node,
            """
            setup(0)
            free, total = ck(d.cuMemGetInfo())
            say(big=err(d.cuMemAlloc(12 << 30)), free=free)
            p = ck(d.cuMemAlloc(8 << 30))
            say(small=int(p) != 0, other_gpu=err(d.cuMemAlloc(1)))
            """,
        )
        first, second = ok(r)
        assert first["big"] == 2  # CUDA_ERROR_OUT_OF_MEMORY
        # Free is what neither process holds: the holder's 12 GiB, and both contexts.
        assert first["free"] == (23034 - 318) * MIB - 12 * GIB - 2 * ctx_bytes(node)
        assert second["small"]
        assert slot_used(node, holder.p.pid) == 12 * GIB + ctx_bytes(node)
        holder.send("exit")
        holder.finish()
    finally:
        holder.kill()
    assert gpu_used(node) == 0  # both exited: everything given back


def test_sigkill_holder_is_reaped(make_sim_node: Callable[..., SimNode]) -> None:
    node = make_sim_node("pcie-l4x4")
    holder = Workload(node, "setup(0)\np = ck(d.cuMemAlloc(16 << 30))\nsay(held=True)\nwait_for('exit')\n")
    try:
        holder.read()
        assert slot_used(node, holder.p.pid) == 16 * GIB + ctx_bytes(node)
        os.kill(holder.p.pid, signal.SIGKILL)
        holder.p.wait(timeout=30)
    finally:
        holder.kill()
    # The killed process could not give its memory back; the next allocation that
    # does not fit reaps it, as a real driver frees a dead process's memory.
    (res,) = ok(run_py(node, "setup(0)\np = ck(d.cuMemAlloc(16 << 30))\nsay(ok=True)\n"))
    assert res == {"ok": True}
    assert slot_fields(node, holder.p.pid) == []


def test_memcpy_round_trip_and_kernels(flavour_node: SimNode) -> None:
    r = run_py(
        flavour_node,
        """
        import os
        dev, ctx = setup(0)
        k = kernels()
        n = 1 << 16
        data = os.urandom(n * 4)
        src = (ctypes.c_char * len(data)).from_buffer_copy(data)
        back = (ctypes.c_char * len(data))()
        a = ck(d.cuMemAlloc(n * 4)); b = ck(d.cuMemAlloc(n * 4))
        ck(d.cuMemcpyHtoD(a, ctypes.addressof(src), n * 4))
        ck(d.cuMemcpyDtoD(b, a, n * 4))
        ck(d.cuMemcpyDtoH(ctypes.addressof(back), b, n * 4))
        say(round_trip=bytes(back) == data)
        s = ck(d.cuStreamCreate(0))
        fill(k, a, n, 0xC0FFEE, s)
        clean = mismatches(k, a, n, 0xC0FFEE, s)
        ck(d.cuMemsetD32(int(a) + 40, 7, 3))   # corrupt three words
        dirty = mismatches(k, a, n, 0xC0FFEE, s)
        ck(d.cuMemsetD8Async(b, 0xAB, n * 4, s))
        ck(d.cuStreamSynchronize(s))
        ck(d.cuMemcpyDtoH(ctypes.addressof(back), b, 16))
        say(clean=clean, dirty=dirty, memset=bytes(back)[:16] == b"\\xab" * 16,
            bad_ptr=err(d.cuMemcpyHtoD(12345, ctypes.addressof(src), 4)))
        e0 = ck(d.cuEventCreate(0)); e1 = ck(d.cuEventCreate(0))
        ck(d.cuEventRecord(e0, s))
        ck(d.cuLaunchKernel(k["busy_us"], 1, 1, 1, 1, 1, 1, 0, s, ((20000,), (U64,)), 0))
        ck(d.cuEventRecord(e1, s))
        ck(d.cuEventSynchronize(e1))
        say(elapsed_ms=ck(d.cuEventElapsedTime(e0, e1)), query=err(d.cuStreamQuery(s)))
        """,
    )
    a, b, c = ok(r)
    assert a == {"round_trip": True}
    assert b == {"clean": 0, "dirty": 3, "memset": True, "bad_ptr": 1}
    assert c["elapsed_ms"] >= 20.0 and c["query"] == 0


def test_launches_show_in_node_state(sim_node: SimNode) -> None:
    w = Workload(
        sim_node,
        """
        dev, ctx = setup(1)
        k = kernels()
        for _ in range(5):
            ck(d.cuLaunchKernel(k["busy_us"], 1, 1, 1, 1, 1, 1, 0, 0, ((1000,), (U64,)), 0))
        ck(d.cuCtxSynchronize())
        say(done=True)
        wait_for("exit")
        """,
    )
    try:
        w.read()
        (slot,) = slot_fields(sim_node, w.p.pid)
        assert (slot["gpu"], slot["launches"]) == (1, 5)
        assert slot["busy_ns_total"] >= 5 * 1_000_000 and slot["last_launch_ns"] > 0
        w.send("exit")
        w.finish()
    finally:
        w.kill()


def test_graph_capture_and_explicit_graph(sim_node: SimNode) -> None:
    r = run_py(
        sim_node,
        """
        dev, ctx = setup(0)
        k = kernels()
        n = 4096
        buf = ck(d.cuMemAlloc(n * 4))
        s = ck(d.cuStreamCreate(0))
        ck(d.cuStreamBeginCapture(s, d.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL))
        fill(k, buf, n, 11, s)
        capturing = ck(d.cuStreamIsCapturing(s))
        g = ck(d.cuStreamEndCapture(s))
        before = mismatches(k, buf, n, 11, s)     # captured, not run
        ge = ck(d.cuGraphInstantiate(g, 0))
        ck(d.cuGraphLaunch(ge, s))
        after = mismatches(k, buf, n, 11, s)
        g2 = ck(d.cuGraphCreate(0))
        p = d.CUDA_KERNEL_NODE_PARAMS()
        p.func = k["fill_u32"]
        p.gridDimX = p.gridDimY = p.gridDimZ = 1
        p.blockDimX, p.blockDimY, p.blockDimZ = 128, 1, 1
        p.kernelParams = ((int(buf), n, 22), (U64, U64, U32))
        ck(d.cuGraphAddKernelNode(g2, None, 0, p))
        ge2 = ck(d.cuGraphInstantiate(g2, 0))
        ck(d.cuGraphLaunch(ge2, s))
        explicit = mismatches(k, buf, n, 22, s)
        say(capturing=int(capturing), before=before, after=after, explicit=explicit)
        """,
    )
    (res,) = ok(r)
    assert res == {"capturing": 1, "before": 4096, "after": 0, "explicit": 0}
