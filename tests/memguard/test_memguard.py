"""memguard, the CUDA allocation shim, holding real processes on a simulated node.

Every workload here is a real process under the real shim (LD_PRELOAD) talking
to simgpu's fake libcuda.so.1 / libnvidia-ml.so.1: mg_ctest (a C program linked
against libcuda: direct symbols), cuda-python (every function through
cuGetProcAddress_v2) and ctypes / pynvml (dlsym on the library handle).

The core behaviours run twice: against the release builds and against the
ASan+UBSan builds of the shim and the fake driver (`flavour`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from gpufrac.core import native
from tests.fixtures.memguard import LIMIT, Container, Line, MiB, Shim


def by_cmd(lines: list[Line], cmd: str) -> list[Line]:
    return [ln for ln in lines if ln.cmd == cmd]


# ----------------------------------------------------------------- the builds under test

MAPS_PY = """
import pynvml
pynvml.nvmlInit()  # maps libnvidia-ml.so.1 as the agent and tools do
names = ("libmemguard", "libcuda.so", "libnvidia-ml.so", "libasan")
paths = [ln.split(None, 5)[5].strip() for ln in open("/proc/self/maps") if len(ln.split(None, 5)) == 6]
out = {n: sorted({p for p in paths if n in p.rsplit("/", 1)[-1]}) for n in names}
"""


def test_each_flavour_runs_its_own_builds(
    shim: Shim, container: Callable[..., Container], flavour: str
) -> None:
    """The ASan+UBSan runs really run the instrumented shim, fake driver and test
    program, and the release runs the release builds: judged from the memory map
    of the running process, not from the environment it was given."""
    builds = native.native_dir(flavour).resolve()
    (line,) = by_cmd(shim.ctest(container(), "maps"), "maps")
    assert line.rc == 0
    for key in ("exe", "shim", "cuda"):
        assert Path(line.kv[key]).resolve().parent == builds, line.kv
    assert line.kv["asan"] == ("1" if flavour == "asan" else "0")
    out = shim.python(container(), MAPS_PY)  # cuda-python, pynvml: the libraries found by soname
    for name in ("libmemguard", "libcuda.so", "libnvidia-ml.so"):
        assert [Path(p).resolve().parent for p in out[name]] == [builds], out
    assert bool(out["libasan"]) == (flavour == "asan")


# ----------------------------------------------------------------- every hook


def test_every_hook_through_direct_symbols(shim: Shim, container: Callable[..., Container]) -> None:
    """A program linked against libcuda: each allocation kind is counted at the
    right size and uncounted at its free; memory queries show the container."""
    c = container()
    one = 1 * MiB
    script = [
        *("alloc", one, "used", "free", "used"),
        *("managed", one, "used", "free", "used"),
        *("pitch", 1000, 100, "used", "free", "used"),
        *("async", one, "used", "freeasync", "used"),
        *("asyncptsz", one, "used", "freeasyncptsz", "used"),
        *("pool", one, "used", "freeasync", "used"),
        *("poolptsz", one, "used", "freeasyncptsz", "used"),
        *("create", 2 * MiB, "used", "release", "used"),
        *("array", 256, 128, "used", "destroy", "used"),
        *("array3d", 64, 32, 4, "used", "destroy", "used"),
        *("alloc", 8 * MiB, "info", "total", "info1", "total1", "free"),
    ]
    lines = shim.ctest(c, *script)
    assert all(ln.rc == 0 for ln in lines), lines
    used = by_cmd(lines, "used")
    pitch = by_cmd(lines, "pitch")[0].int("pitch")
    expected_held = [one, one, pitch * 100, one, one, one, one, 2 * MiB, 256 * 128 * 4, 64 * 32 * 4 * 4]
    held, after_free = used[0::2], used[1::2]
    assert [u.int("mine") for u in held] == expected_held
    assert [u.int("total") for u in held] == expected_held
    assert all(u.int("mine") == 0 and u.int("total") == 0 for u in after_free)
    info = by_cmd(lines, "info")[0]
    assert info.int("total") == LIMIT
    assert info.int("free") == LIMIT - 8 * MiB
    assert by_cmd(lines, "total")[0].int("total") == LIMIT
    # The CUDA 2.x (32-bit) entry points tell the same story.
    assert by_cmd(lines, "info1")[0].kv == info.kv
    assert by_cmd(lines, "total1")[0].int("total") == LIMIT
    assert c.total() == 0 and not c.live_slots()


def test_launch_entry_points_record_activity(shim: Shim, container: Callable[..., Container]) -> None:
    c = container()
    launches = ["launch", "launchptsz", "launchex", "launchexptsz", "coop", "coopptsz", "graph", "graphptsz"]
    script = [x for name in launches for x in (name, "used")]
    lines = shim.ctest(c, *script)
    assert all(ln.rc == 0 for ln in lines), lines
    assert [u.int("launches") for u in by_cmd(lines, "used")] == list(range(1, len(launches) + 1))


# (name, cudaVersion, flags, the export the driver means)
PROC_CASES = [
    ("cuGetProcAddress", 12000, 0, "cuGetProcAddress_v2"),
    ("cuGetProcAddress", 11030, 0, "cuGetProcAddress"),
    ("cuMemAlloc", 12000, 0, "cuMemAlloc_v2"),
    ("cuMemAllocPitch", 12000, 0, "cuMemAllocPitch_v2"),
    ("cuMemAllocManaged", 12000, 0, "cuMemAllocManaged"),
    ("cuMemAllocAsync", 12000, 0, "cuMemAllocAsync"),
    ("cuMemAllocAsync", 12000, 2, "cuMemAllocAsync_ptsz"),
    ("cuMemAllocFromPoolAsync", 12000, 0, "cuMemAllocFromPoolAsync"),
    ("cuMemAllocFromPoolAsync", 12000, 2, "cuMemAllocFromPoolAsync_ptsz"),
    ("cuMemFreeAsync", 12000, 0, "cuMemFreeAsync"),
    ("cuMemFreeAsync", 12000, 2, "cuMemFreeAsync_ptsz"),
    ("cuMemFree", 12000, 0, "cuMemFree_v2"),
    ("cuMemCreate", 12000, 0, "cuMemCreate"),
    ("cuMemRelease", 12000, 0, "cuMemRelease"),
    ("cuMemMap", 12000, 0, "cuMemMap"),
    ("cuMemUnmap", 12000, 0, "cuMemUnmap"),
    ("cuMemRetainAllocationHandle", 12000, 0, "cuMemRetainAllocationHandle"),
    ("cuArrayCreate", 12000, 0, "cuArrayCreate_v2"),
    ("cuArray3DCreate", 12000, 0, "cuArray3DCreate_v2"),
    ("cuArrayDestroy", 12000, 0, "cuArrayDestroy"),
    ("cuMemGetInfo", 12000, 0, "cuMemGetInfo_v2"),
    ("cuDeviceTotalMem", 12000, 0, "cuDeviceTotalMem_v2"),
    ("cuLaunchKernel", 12000, 0, "cuLaunchKernel"),
    ("cuLaunchKernel", 12000, 1, "cuLaunchKernel"),
    ("cuLaunchKernel", 12000, 2, "cuLaunchKernel_ptsz"),
    ("cuLaunchKernelEx", 12000, 2, "cuLaunchKernelEx_ptsz"),
    ("cuLaunchCooperativeKernel", 12000, 2, "cuLaunchCooperativeKernel_ptsz"),
    ("cuGraphLaunch", 12000, 0, "cuGraphLaunch"),
    ("cuGraphLaunch", 12000, 2, "cuGraphLaunch_ptsz"),
    ("cuMemPoolTrimTo", 12000, 0, "cuMemPoolTrimTo"),
    ("cuMemPoolDestroy", 12000, 0, "cuMemPoolDestroy"),
    ("cuStreamSynchronize", 12000, 0, "cuStreamSynchronize"),
    ("cuStreamSynchronize", 12000, 2, "cuStreamSynchronize_ptsz"),
    ("cuEventSynchronize", 12000, 0, "cuEventSynchronize"),
    ("cuCtxSynchronize", 12000, 0, "cuCtxSynchronize"),
    # The swap-in gate alone (mg_copy.c): copies, memsets, stream and event queries.
    ("cuMemcpy", 12000, 0, "cuMemcpy"),
    ("cuMemcpy", 12000, 2, "cuMemcpy_ptds"),
    ("cuMemcpyDtoH", 12000, 0, "cuMemcpyDtoH_v2"),
    ("cuMemcpyDtoH", 12000, 2, "cuMemcpyDtoH_v2_ptds"),
    ("cuMemcpyHtoD", 12000, 0, "cuMemcpyHtoD_v2"),
    ("cuMemcpyDtoD", 12000, 2, "cuMemcpyDtoD_v2_ptds"),
    ("cuMemcpyAsync", 12000, 2, "cuMemcpyAsync_ptsz"),
    ("cuMemcpyDtoHAsync", 12000, 0, "cuMemcpyDtoHAsync_v2"),
    ("cuMemcpyDtoHAsync", 12000, 2, "cuMemcpyDtoHAsync_v2_ptsz"),
    ("cuMemsetD8", 12000, 0, "cuMemsetD8_v2"),
    ("cuMemsetD32", 12000, 2, "cuMemsetD32_v2_ptds"),
    ("cuMemsetD32Async", 12000, 2, "cuMemsetD32Async_ptsz"),
    ("cuStreamQuery", 12000, 0, "cuStreamQuery"),
    ("cuStreamQuery", 12000, 2, "cuStreamQuery_ptsz"),
    ("cuStreamWaitEvent", 12000, 2, "cuStreamWaitEvent_ptsz"),
    ("cuEventQuery", 12000, 0, "cuEventQuery"),
    ("cuEventRecord", 12000, 0, "cuEventRecord"),
    ("cuEventRecordWithFlags", 12000, 2, "cuEventRecordWithFlags_ptsz"),
]


def test_cu_get_proc_address_hands_out_the_right_hook(
    shim: Shim, container: Callable[..., Container]
) -> None:
    """(name, version, flags) -> the hook of exactly the variant the driver means,
    through cuGetProcAddress_v2 and the CUDA 11 cuGetProcAddress; a function the shim
    does not hook comes back as the shim's gate trampoline of that name, the very one a
    program linked against libcuda binds to (mg_gate.c)."""
    script: list[object] = []
    for name, ver, flags, want in PROC_CASES:
        script += ["getproc", name, ver, flags, want, "getproc1", name, ver, flags, want]
    script += ["getproc", "cuCtxGetDevice", 12000, 0, "cuCtxGetDevice"]
    lines = shim.ctest(container(), *script)
    results = by_cmd(lines, "getproc") + by_cmd(lines, "getproc1")
    assert len(results) == 2 * len(PROC_CASES) + 1
    assert all(ln.rc == 0 and ln.kv["match"] == "1" for ln in results), results
    assert all(ln.kv["shim"] == "1" for ln in results), results  # cuCtxGetDevice: gated


def test_dlsym_on_the_driver_handle_returns_hooks(shim: Shim, container: Callable[..., Container]) -> None:
    """A lookup on the driver's handle finds the shim's hooks, and for a function it does not
    hook (cuCtxGetDevice) its gate trampoline; a name the driver lacks, nothing."""
    names = sorted({want for *_, want in PROC_CASES})
    script = [x for n in [*names, "cuCtxGetDevice", "cuNoSuchFunction"] for x in ("dlsym", n)]
    lines = by_cmd(shim.ctest(container(), *script), "dlsym")
    assert [ln.kv["shim"] for ln in lines] == ["1"] * (len(names) + 1) + ["0"]
    assert [ln.kv["found"] for ln in lines] == ["1"] * (len(names) + 1) + ["0"]


def test_a_probe_of_the_global_scope_finds_the_shim_only_where_the_driver_has_the_function(
    shim: Shim, container: Callable[..., Container]
) -> None:
    """The shim exports a gate trampoline under every name the driver may export; a program
    probing dlsym(RTLD_DEFAULT, name) for a feature still finds nothing where the installed
    driver lacks it (cuGLInit: simgpu has no OpenGL interop), and the trampoline where it has
    it (cuCtxGetDevice)."""
    lines = by_cmd(shim.ctest(container(), "global", "cuCtxGetDevice", "global", "cuGLInit"), "global")
    assert [(ln.kv["found"], ln.kv["shim"]) for ln in lines] == [("1", "1"), ("0", "0")]


CUDA_PYTHON_HOOKS = """
MiB = 1 << 20
ptr = chk(cu.cuMemAlloc(3 * MiB)); out["alloc"] = used()
chk(cu.cuMemFree(ptr)); out["alloc_freed"] = used()
ptr, pitch = chk(cu.cuMemAllocPitch(1000, 100, 4)); out["pitch"] = [used(), int(pitch) * 100]
chk(cu.cuMemFree(ptr))
ptr = chk(cu.cuMemAllocManaged(MiB, 1)); out["managed"] = used(); chk(cu.cuMemFree(ptr))
stream = chk(cu.cuStreamCreate(0))
ptr = chk(cu.cuMemAllocAsync(2 * MiB, stream)); out["async"] = used()
chk(cu.cuMemFreeAsync(ptr, stream)); chk(cu.cuStreamSynchronize(stream)); out["async_freed"] = used()
pool = chk(cu.cuDeviceGetDefaultMemPool(dev))
ptr = chk(cu.cuMemAllocFromPoolAsync(MiB, pool, stream)); out["pool"] = used()
chk(cu.cuMemFreeAsync(ptr, stream)); chk(cu.cuStreamSynchronize(stream)); out["pool_freed"] = used()
prop = cu.CUmemAllocationProp()
prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
prop.location.id = 0
MINIMUM = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
gran = chk(cu.cuMemGetAllocationGranularity(prop, MINIMUM))
va = chk(cu.cuMemAddressReserve(64 * int(gran), 0, 0, 0)); out["reserve"] = used()
h = chk(cu.cuMemCreate(2 * int(gran), prop, 0)); out["create"] = [used(), 2 * int(gran)]
chk(cu.cuMemMap(va, 2 * int(gran), 0, h, 0))
acc = cu.CUmemAccessDesc()
acc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
acc.location.id = 0
acc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
chk(cu.cuMemSetAccess(va, 2 * int(gran), [acc], 1))
chk(cu.cuMemUnmap(va, 2 * int(gran))); chk(cu.cuMemRelease(h)); out["release"] = used()
chk(cu.cuMemAddressFree(va, 64 * int(gran)))
d = cu.CUDA_ARRAY_DESCRIPTOR()
d.Width, d.Height, d.NumChannels = 128, 64, 2
d.Format = cu.CUarray_format.CU_AD_FORMAT_HALF
arr = chk(cu.cuArrayCreate(d)); out["array"] = used()
chk(cu.cuArrayDestroy(arr)); out["array_freed"] = used()
d3 = cu.CUDA_ARRAY3D_DESCRIPTOR()
d3.Width, d3.Height, d3.Depth, d3.NumChannels = 32, 16, 8, 4
d3.Format = cu.CUarray_format.CU_AD_FORMAT_FLOAT
arr = chk(cu.cuArray3DCreate(d3)); out["array3d"] = used(); chk(cu.cuArrayDestroy(arr))
keep = chk(cu.cuMemAlloc(5 * MiB))
out["info"] = [int(x) for x in chk(cu.cuMemGetInfo())]
out["devtotal"] = int(chk(cu.cuDeviceTotalMem(dev)))
chk(cu.cuMemFree(keep))
mod = chk(cu.cuModuleLoadData(b"SIMGPU-MODULE"))
fn = chk(cu.cuModuleGetFunction(mod, b"busy_us"))
import ctypes as C
arg = C.c_uint64(1)
params = (C.c_void_p * 1)(C.addressof(arg))
chk(cu.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, stream, C.addressof(params), 0))
cfg = cu.CUlaunchConfig()
cfg.gridDimX = cfg.gridDimY = cfg.gridDimZ = cfg.blockDimX = cfg.blockDimY = cfg.blockDimZ = 1
cfg.hStream = stream
chk(cu.cuLaunchKernelEx(cfg, fn, C.addressof(params), 0))
chk(cu.cuLaunchCooperativeKernel(fn, 1, 1, 1, 1, 1, 1, 0, stream, C.addressof(params)))
graph = chk(cu.cuGraphCreate(0))
np = cu.CUDA_KERNEL_NODE_PARAMS()
np.func = fn
np.gridDimX = np.gridDimY = np.gridDimZ = np.blockDimX = np.blockDimY = np.blockDimZ = 1
np.kernelParams = C.addressof(params)
chk(cu.cuGraphAddKernelNode(graph, None, 0, np))
gexec = chk(cu.cuGraphInstantiate(graph, 0))
chk(cu.cuGraphLaunch(gexec, stream))
chk(cu.cuStreamSynchronize(stream))
u = abi.read_usage(DIR)
out["launches"] = [int(s.launches) for s in u.slots if s.pid == os.getpid()]
"""


# Per-thread-stream variants under ASan are covered by the direct-link tests.
@pytest.mark.parametrize(
    ("flavour", "ptds"),
    [("release", "0"), ("release", "1"), ("asan", "0")],
    ids=["release-legacy-stream", "release-per-thread-stream", "asan-legacy-stream"],
)
def test_every_hook_through_cuda_python(shim: Shim, container: Callable[..., Container], ptds: str) -> None:
    """cuda-python resolves every function through cuGetProcAddress_v2 (with the
    per-thread-stream flag when asked): each one lands on its hook."""
    c = container()
    out = shim.python(c, CUDA_PYTHON_HOOKS, CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM=ptds)
    assert out["alloc"] == 3 * MiB and out["alloc_freed"] == 0
    assert out["pitch"][0] == out["pitch"][1] >= 1000 * 100
    assert out["managed"] == MiB
    assert out["async"] == 2 * MiB and out["async_freed"] == 0
    assert out["pool"] == MiB and out["pool_freed"] == 0
    assert out["reserve"] == 0  # an address reservation is not memory
    assert out["create"][0] == out["create"][1]
    assert out["release"] == 0
    assert out["array"] == 128 * 64 * 2 * 2 and out["array_freed"] == 0
    assert out["array3d"] == 32 * 16 * 8 * 4 * 4
    assert out["info"] == [LIMIT - 5 * MiB, LIMIT]
    assert out["devtotal"] == LIMIT
    assert out["launches"] == [4]
    assert c.total() == 0


CTYPES_HOOKS = """
import ctypes as C
lib = C.CDLL("libcuda.so.1")  # symbols come from dlsym on this handle
MiB = 1 << 20
p = C.c_ulonglong()
out["rc"] = lib.cuMemAlloc_v2(C.byref(p), C.c_size_t(6 * MiB))
out["held"] = used()
f, t = C.c_size_t(), C.c_size_t()
lib.cuMemGetInfo_v2(C.byref(f), C.byref(t))
out["info"] = [f.value, t.value]
out["free_rc"] = lib.cuMemFree_v2(p)
out["freed"] = used()
mod, fn = C.c_void_p(), C.c_void_p()
lib.cuModuleLoadData(C.byref(mod), b"SIMGPU-MODULE")
lib.cuModuleGetFunction(C.byref(fn), mod, b"busy_us")
arg = C.c_uint64(1)
params = (C.c_void_p * 1)(C.addressof(arg))
u = C.c_uint
out["launch_rc"] = lib.cuLaunchKernel(fn, u(1), u(1), u(1), u(1), u(1), u(1), u(0), None, params, None)
out["launches"] = [int(s.launches) for s in abi.read_usage(DIR).slots if s.pid == os.getpid()]
"""


def test_every_hook_through_ctypes(shim: Shim, container: Callable[..., Container]) -> None:
    """ctypes finds each function with dlsym on the libcuda handle."""
    out = shim.python(container(), CTYPES_HOOKS)
    assert (out["rc"], out["free_rc"], out["launch_rc"]) == (0, 0, 0)
    assert out["held"] == 6 * MiB and out["freed"] == 0
    assert out["info"] == [LIMIT - 6 * MiB, LIMIT]
    assert out["launches"] == [1]
