"""The real CUDA runtime's driver lookups, under the shim.

The real libcudart (12.x and 13.x, from NVIDIA's PyPI wheels, loaded with ctypes)
starts over simgpu's libcuda, which logs every cuGetProcAddress it answers
($SIMGPU_PROC_LOG). Names the fake does not simulate are answered with a
NOT_SUPPORTED stand-in ($SIMGPU_PROC_STUB=1), since cudart resolves its whole
table before anything else. cudart's start-up then stops where a simulated driver
must (it needs the driver's private export tables, cuGetExportTable), after every
lookup it makes. Checked: cudart found cuGetProcAddress_v2 by dlsym and probed it
as the real one does; each lookup was answered; and each, asked again through the
shim's cuGetProcAddress_v2 (the entry point cudart itself was handed), gives the
shim's hook of the very variant the driver chose wherever the shim hooks it,
and everywhere else a gated trampoline of the shim (the swap-in gate, mg_gate.c)
that jumps to the very function the driver answered.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gpufrac.simgpu.spec import create_node, load_preset
from tests.fixtures.memguard import Container, Shim

REPLAY = r"""
import ctypes as C, json, os, sys
rt = C.CDLL(sys.argv[1])
n = C.c_int(-1)
count_rc = rt.cudaGetDeviceCount(C.byref(n))  # cudart's start-up: every lookup


class Dl(C.Structure):
    _fields_ = [("fname", C.c_char_p), ("fbase", C.c_void_p), ("sname", C.c_char_p), ("saddr", C.c_void_p)]


libc = C.CDLL(None)
libc.dladdr.argtypes = [C.c_void_p, C.POINTER(Dl)]


def where(p):
    d = Dl()
    if not p or not libc.dladdr(p, C.byref(d)):
        return None, None
    return os.path.basename(d.fname.decode()), d.sname.decode() if d.sname else None


def bound(p):  # where a gate trampoline of the shim jumps (its `jmp *slot(%rip)`, 13 bytes in)
    code = C.string_at(p, 19)
    if code[:3] != b"\x4c\x8b\x1d" or code[13:15] != b"\xff\x25":
        return None
    slot = p + 19 + int.from_bytes(code[15:19], "little", signed=True)
    return C.c_void_p.from_address(slot).value


cuda = C.CDLL("libcuda.so.1")  # the handle cudart opened
gpa = cuda.cuGetProcAddress_v2  # dlsym on it, as cudart does
gpa.argtypes = [C.c_char_p, C.POINTER(C.c_void_p), C.c_int, C.c_ulonglong, C.POINTER(C.c_int)]
out = {"count_rc": count_rc, "gpa": where(C.cast(gpa, C.c_void_p).value), "lookups": []}
for line in open(os.environ["SIMGPU_PROC_LOG"]).read().splitlines():
    parts = line.split(" ")
    name, ver, flags, rc, status, driver_sym = parts
    pfn, st = C.c_void_p(), C.c_int(-1)
    rrc = gpa(name.encode(), C.byref(pfn), int(ver), int(flags), C.byref(st))
    lib, sym = where(pfn.value)
    to = where(bound(pfn.value)) if lib and lib.startswith("libmemguard") else (None, None)
    out["lookups"].append([name, int(ver), int(flags), int(rc), driver_sym, rrc, st.value, lib, sym, *to])
print(json.dumps(out))
"""

RUNTIMES = {
    # wheel, soname, the driver version the node reports (at least the runtime's)
    "12": ("nvidia-cuda-runtime-cu12", "libcudart.so.12", 12090),
    "13": ("nvidia-cuda-runtime", "libcudart.so.13", 13050),
}

# What a survey of the real libraries (docs/cuda-facts.md section 2) found cudart asking, and the
# variant each must reach: (name, version, flags) -> the shim's hook.
EXPECTED = {
    ("cuMemAlloc", 3020, 0): "cuMemAlloc_v2",
    ("cuMemFree", 3020, 0): "cuMemFree_v2",
    ("cuMemGetInfo", 3020, 0): "cuMemGetInfo_v2",
    ("cuMemAllocAsync", 11020, 0): "cuMemAllocAsync",
    ("cuMemAllocAsync", 11020, 2): "cuMemAllocAsync_ptsz",
    ("cuLaunchKernel", 4000, 0): "cuLaunchKernel",
    ("cuLaunchKernel", 7000, 2): "cuLaunchKernel_ptsz",
    ("cuStreamSynchronize", 7000, 2): "cuStreamSynchronize_ptsz",
    ("cuGraphLaunch", 10000, 2): "cuGraphLaunch_ptsz",
}


def _cudart(wheel: str, soname: str) -> Path:
    try:
        dist = importlib.metadata.distribution(wheel)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"{wheel} is not installed (a dev dependency: make setup)")
    for f in dist.files or []:
        if f.name == soname:
            return Path(str(dist.locate_file(f)))
    pytest.fail(f"{wheel} has no {soname}")


def _shim_exports(shim: Shim) -> set[str]:
    """The names the shim hooks: its cu* exports defined strong (its gate trampolines, one for
    every other name of the driver, are weak: a hook of the same name wins over them)."""
    nm = subprocess.run(
        ["nm", "-D", "--defined-only", str(_shim_path(shim))], capture_output=True, text=True, check=True
    ).stdout
    rows = [ln.split() for ln in nm.splitlines()]
    return {r[-1] for r in rows if len(r) == 3 and r[1] == "T" and r[-1].startswith("cu")}


def _shim_path(shim: Shim) -> Path:
    from gpufrac.memguard import build

    return build.shim_path(shim.flavour)


@pytest.mark.parametrize("runtime", sorted(RUNTIMES))
def test_cudart_lookups_reach_the_hooks(
    runtime: str, shim: Shim, container: Callable[..., Container], tmp_path: Path
) -> None:
    wheel, soname, driver = RUNTIMES[runtime]
    lib = _cudart(wheel, soname)
    node = create_node(
        dataclasses.replace(load_preset("dgx-h100"), cuda_driver_version=driver), tmp_path / "n"
    )
    log = tmp_path / "lookups.log"
    env = shim.env(container(), SIMGPU_STATE=str(node), SIMGPU_PROC_LOG=str(log), SIMGPU_PROC_STUB="1")
    p = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(REPLAY), str(lib)],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert p.returncode == 0, f"replay failed ({p.returncode}):\n{p.stdout}\n{p.stderr}"
    out: dict[str, Any] = json.loads(p.stdout.strip().splitlines()[-1])
    shim_lib = _shim_path(shim).name
    hooked = _shim_exports(shim)
    assert out["gpa"] == [shim_lib, "cuGetProcAddress_v2"]  # dlsym gave cudart the hook
    lookups = out["lookups"]
    assert len(lookups) > 300  # cudart resolves its whole table at start-up
    # Its first question is the probe ("", 0, 0): not found, as on a real driver.
    assert lookups[0][:4] == ["", 0, 0, 500]
    seen = {}
    gated = 0
    for name, ver, flags, rc, driver_sym, rrc, status, got_lib, got_sym, to_lib, to_sym in lookups[1:]:
        assert flags in (0, 2), name
        assert rc == 0 and rrc == 0 and status == 0, (name, ver, flags, rc, rrc, status)  # answered
        if driver_sym in hooked:
            assert (got_lib, got_sym) == (shim_lib, driver_sym), (
                name,
                ver,
                flags,
            )  # the hook of that variant
        elif driver_sym == "stub" and any(h == name or h.startswith(name + "_") for h in hooked):
            # Stood in for by the fake (it does not simulate it), but hooked: the
            # shim wraps whatever entry the driver answers with, as with a real
            # driver's internal entries, with its hook of that name and version
            # (cuMemcpy2DUnaligned at 3020 is cuMemcpy2DUnaligned_v2, as in cuda.h).
            assert got_lib == shim_lib and got_sym in hooked, (name, ver, flags, got_lib, got_sym)
            assert got_sym == name or got_sym.startswith(name + "_"), (name, ver, flags, got_sym)
        else:
            # Not hooked: a trampoline of the shim (a named export, or one of its pool) that
            # passes the swap-in gate, then jumps to the driver's answer itself.
            assert got_lib == shim_lib and got_sym in (None, driver_sym), (name, ver, flags, got_lib, got_sym)
            assert to_lib == "libcuda.so.1", (name, ver, flags, to_lib, to_sym)
            assert to_sym == (None if driver_sym == "stub" else driver_sym), (name, ver, flags, to_sym)
            gated += 1
            continue
        seen[(name, ver, flags)] = got_sym if got_lib == shim_lib else None
    assert gated > 200  # most of cudart's table is no hook of the shim's
    for key, sym in EXPECTED.items():
        assert seen.get(key) == sym, (key, seen.get(key))
    # Every way cudart launches a kernel or a graph reaches the shim's hook: where a compute
    # share paces the container (docs/compute.md).
    launch_names = ("cuLaunchKernel", "cuLaunchKernelEx", "cuLaunchCooperativeKernel", "cuGraphLaunch")
    launches = {k: v for k, v in seen.items() if k[0] in launch_names}
    assert {k[0] for k in launches} == set(launch_names), sorted(launches)
    assert all(launches.values()), launches
    if runtime == "13":  # 13.x asks for the context-taking variant
        assert seen[("cuCtxSynchronize", 13000, 0)] == "cuCtxSynchronize_v2"
    # Beyond the lookups cudart needs the driver's private export tables, which no
    # simulated driver has: it stops with NOT_SUPPORTED from there, not earlier.
    assert out["count_rc"] == 801
