"""simgpu's fake libcuda.so.1 driven by real workloads: cuda-python and ctypes in
subprocesses on a simulated node, checked against the node-state file.

The core tests run against both the release build and the ASan/UBSan build."""

from __future__ import annotations

import ctypes
import json
import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable

import pytest

from gpufrac import native
from gpufrac.simgpu.nodestate import NodeState
from tests.conftest import SimNode

GIB = 1 << 30
MIB = 1 << 20

# Shared by every workload: thin helpers over cuda.bindings.driver.
PRELUDE = textwrap.dedent(
    """
    import ctypes, json, sys
    from cuda.bindings import driver as d

    def ck(r):
        err = r[0] if isinstance(r, tuple) else r
        if err != d.CUresult.CUDA_SUCCESS:
            raise SystemExit(f"CUDA call failed: {r!r}")
        rest = r[1:] if isinstance(r, tuple) else ()
        return rest[0] if len(rest) == 1 else (rest or None)

    def err(r):
        return int((r[0] if isinstance(r, tuple) else r).value)

    def setup(ordinal=0):
        ck(d.cuInit(0))
        dev = ck(d.cuDeviceGet(ordinal))
        ctx = ck(d.cuDevicePrimaryCtxRetain(dev))
        ck(d.cuCtxSetCurrent(ctx))
        return dev, ctx

    def kernels():
        mod = ck(d.cuModuleLoadData(b"SIMGPU-MODULE\\0"))
        return {n: ck(d.cuModuleGetFunction(mod, n.encode())) for n in ("fill_u32", "check_u32", "busy_us")}

    U64, U32 = ctypes.c_uint64, ctypes.c_uint32

    def fill(k, buf, n, value, stream=0):
        ck(d.cuLaunchKernel(k["fill_u32"], 1, 1, 1, 128, 1, 1, 0, stream,
                            ((int(buf), n, value), (U64, U64, U32)), 0))

    def mismatches(k, buf, n, value, stream=0):
        res = ck(d.cuMemAlloc(8))
        ck(d.cuLaunchKernel(k["check_u32"], 1, 1, 1, 128, 1, 1, 0, stream,
                            ((int(buf), n, value, int(res)), (U64, U64, U32, U64)), 0))
        ck(d.cuStreamSynchronize(stream))
        out = U64()
        ck(d.cuMemcpyDtoH(ctypes.addressof(out), res, 8))
        ck(d.cuMemFree(res))
        return out.value

    def say(**kw):
        print(json.dumps(kw), flush=True)

    def wait_for(word):
        line = sys.stdin.readline().strip()
        if line != word:
            raise SystemExit(f"expected {word!r} on stdin, got {line!r}")
    """
)


def proc_env(node: SimNode, **extra: str) -> dict[str, str]:
    """Environment of a simulated process; an ASan build needs its runtime preloaded."""
    env = node.process_env(**extra)
    if node.flavour == "asan":
        env["LD_PRELOAD"] = ":".join(native.asan_runtime())
        env["ASAN_OPTIONS"] = "detect_leaks=0"
    return env


def run_py(node: SimNode, code: str, timeout: float = 120, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(code)],
        env=proc_env(node, **extra),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def ok(r: subprocess.CompletedProcess[str]) -> list[dict]:
    assert r.returncode == 0, f"workload failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
    return [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]


class Workload:
    """A long-running workload we talk to over stdin/stdout, line by line."""

    def __init__(self, node: SimNode, code: str, **extra: str) -> None:
        self.p = subprocess.Popen(
            [sys.executable, "-c", PRELUDE + textwrap.dedent(code)],
            env=proc_env(node, **extra),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def read(self, timeout: float = 60) -> dict:
        """The workload's next JSON line (a reader thread feeds a queue, so nothing
        buffered is missed)."""
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            line = None
        if line is None:
            self.p.kill()
            raise AssertionError(f"workload said nothing more; stderr:\n{self.p.stderr.read()}")
        return json.loads(line)

    def _pump(self) -> None:
        for line in self.p.stdout:
            if line.startswith("{"):
                self._lines.put(line)
        self._lines.put(None)

    def send(self, word: str) -> None:
        self.p.stdin.write(word + "\n")
        self.p.stdin.flush()

    def finish(self, timeout: float = 60) -> None:
        self.p.stdin.close()
        rc = self.p.wait(timeout=timeout)
        assert rc == 0, f"workload failed ({rc}):\n{self.p.stderr.read()}"

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait(timeout=30)


def _plain(rec: ctypes.Structure) -> dict:
    """Scalar fields of a node-state record, copied (arrays would keep the mapping open)."""
    out = {}
    for name, _ in rec._fields_:
        value = getattr(rec, name)
        if not isinstance(value, ctypes.Array):
            out[name] = value
    return out


def gpu_fields(node: SimNode, gpu: int) -> dict:
    """Plain values of a GPU's node-state record (no reference into the mapping survives)."""
    with NodeState(node.path) as st:
        out = _plain(st.node.gpus[gpu])
        out["driver"] = st.node.cuda_driver_version
        out["gpu_count"] = st.node.gpu_count
    return out


def slot_fields(node: SimNode, pid: int) -> list[dict]:
    with NodeState(node.path) as st:
        return [_plain(p) for p in st.live_procs() if p.pid == pid]


def slot_used(node: SimNode, pid: int) -> int:
    return sum(p["used_bytes"] for p in slot_fields(node, pid))


def gpu_used(node: SimNode, gpu: int = 0) -> int:
    return gpu_fields(node, gpu)["used_bytes"]


def poll_until(cond: Callable[[], bool], timeout: float = 60, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(params=["release", "asan"])
def flavour_node(request: pytest.FixtureRequest, make_sim_node: Callable[..., SimNode]) -> SimNode:
    return make_sim_node("dgx-h100", flavour=request.param)


# ----------------------------------------------------------------------------- core


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
        # NVML's view: this process holds the memory on GPU 0.
        assert slot_used(node, w.p.pid) == 64 * MIB
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
        assert first["free"] == (23034 - 318) * MIB - 12 * GIB
        assert second["small"]
        assert slot_used(node, holder.p.pid) == 12 * GIB
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
        assert slot_used(node, holder.p.pid) == 16 * GIB
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
