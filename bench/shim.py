"""memguard shim overhead on the simulated node -> shim.json in bench.results_dir().

Run: `python -m bench shim` (or `make bench`; `--quick` for a smoke run at tiny
sizes whose numbers mean nothing). The tight loops run in a small C driver
(bench/shim_bench.c, compiled here into build/bench/) linked against the fake
libcuda, once plainly and once under LD_PRELOAD of the shim, in the same run and
interleaved, so "overhead" is the shim's own cost on top of the same driver call.

The gate (mg_gate.c): the cost the swap-in gate adds to a call of a driver function the shim
does not hook (cuCtxGetDevice, bound as a linked program binds it: to the shim's trampoline),
measured by the same alternation in one process against the driver's own function.

Start-up: STARTUP_PROCS processes started at once in STARTUP_CONTAINERS containers, each
creating its context (dgx-h100: 512 MiB) and making one allocation, with and without the
shim, interleaved: wall time and the processes' CPU time, and their ratios (target: under
1.3x). Then the same start under the shim once more with every process checking that what
its slot counts for its context is NVML's figure for it, byte for byte.

The headline, the shim's added cost per alloc+free pair on both allocation paths
(cuMemAlloc/cuMemFree: an mmap and munmap in the fake; cuMemAllocAsync/
cuMemFreeAsync: the pool, no system call), is measured within one process that
alternates, round by round, between the shim's hooks and the driver's own
functions: the median of the per-round differences, over several processes. A
system call's cost wanders by hundreds of nanoseconds between processes on a
shared machine, far more than the shim costs, so comparing separate processes
(also reported: min and median over interleaved plain/shim runs) cannot resolve
it on the mmap path. The same alternation without the shim gives the noise floor.
Contention uses thread CPU time, which the time-slicing of 8 processes on a
small machine does not inflate but cache-line contention on the shared counter
does.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import quick, results_dir
from gpufrac.core import native
from gpufrac.memguard import abi
from gpufrac.memguard import build as mg_build
from gpufrac.simgpu.spec import create_node, load_preset

ROOT = native.REPO_ROOT
DRIVER_SRC = ROOT / "bench" / "shim_bench.c"
DRIVER = ROOT / "build" / "bench" / "shim_bench"
GiB = 1 << 30

TARGET_NS = 100  # the shim's added cost per alloc+free pair, each path
if quick():  # a smoke run (bench/__init__.py): every figure produced, none meaningful
    ROUNDS, LOOP_N, ALTERNATIONS = 2, 200, 1
    AB_ROUNDS, AB_PAIRS, AB_PROCS = 10, {"abfree": 20, "abasync": 200, "abgate": 200}, 1
    STARTUP_PROCS, STARTUP_CONTAINERS, STARTUP_RUNS = 6, 3, 1
    CONTENTION_PROCS = 2
else:
    ROUNDS, LOOP_N, ALTERNATIONS = 20, 20000, 5
    # Many short rounds: the per-round differences are what the median is taken over.
    AB_ROUNDS, AB_PAIRS, AB_PROCS = 1000, {"abfree": 200, "abasync": 2000, "abgate": 2000}, 5
    STARTUP_PROCS, STARTUP_CONTAINERS = 300, 3  # 100 processes per container: within its 256 slots
    STARTUP_RUNS = 3
    CONTENTION_PROCS = 8


def build_driver() -> Path:
    libdir = native.native_dir()
    native.library(native.FAKE_CUDA)
    native.library(native.SHIM)
    abi_h = ROOT / "gpufrac" / "memguard" / "native" / "memguard_abi.h"
    newest = max(DRIVER_SRC.stat().st_mtime, abi_h.stat().st_mtime)
    if not DRIVER.exists() or DRIVER.stat().st_mtime < newest:
        DRIVER.parent.mkdir(parents=True, exist_ok=True)
        cc = os.environ.get("CC", "cc")
        cmd = [cc, "-std=c11", "-D_GNU_SOURCE", "-O2", "-Wall", "-Wextra", "-Werror", "-o", str(DRIVER)]
        cmd += [f"-I{ROOT / 'gpufrac' / 'memguard' / 'native'}"]  # memguard_abi.h: the usage file
        cmd += [str(DRIVER_SRC), f"-L{libdir}", "-l:libcuda.so.1", f"-Wl,-rpath,{libdir}", "-ldl"]
        subprocess.run(cmd, check=True)
    return DRIVER


class Bench:
    def __init__(self, work: Path) -> None:
        self.work = work
        self.node = work / "node.state"
        create_node(load_preset("dgx-h100"), self.node)
        self.base = dict(os.environ)
        self.base.update({"SIMGPU_STATE": str(self.node), "LD_LIBRARY_PATH": str(native.native_dir())})
        self.base.pop("LD_PRELOAD", None)
        self.containers = [self.container(f"ctr{i}") for i in range(max(STARTUP_CONTAINERS, 1))]

    def container(self, name: str) -> Path:
        d = self.work / name
        d.mkdir()
        abi.ConfigFile(d).write(
            abi.ContainerConfig(gpu_uuid="", request_bytes=64 * GiB, limit_bytes=64 * GiB)
        )
        abi.create_usage(d)
        return d

    def env(self, shim: bool, container: Path | None = None) -> dict[str, str]:
        if not shim:
            return dict(self.base)
        return mg_build.shim_env(container or self.containers[0], base=self.base)

    def drive(self, shim: bool, *argv: object) -> str:
        """The driver program's output for `argv`, with or without the shim."""
        return subprocess.run(
            [str(DRIVER), *map(str, argv)],
            env=self.env(shim),
            capture_output=True,
            text=True,
            check=True,
            timeout=600,
        ).stdout

    def loop(self, op: str, shim: bool, *args: object) -> tuple[float, float]:
        return parse(self.drive(shim, op, ROUNDS, LOOP_N, *args))

    def overhead(self, op: str, *args: object) -> dict[str, float]:
        """Interleave plain and shim runs (separate processes)."""
        plain, shim = [], []
        for _ in range(ALTERNATIONS):
            plain.append(self.loop(op, False, *args)[0])
            shim.append(self.loop(op, True, *args)[0])
        # Median of the differences of adjacent runs: robust to a process that
        # happened to run on a busy core, unlike min(shim) - min(plain).
        diff = statistics.median(b - a for a, b in zip(plain, shim, strict=True))
        return {
            "plain_ns": round(min(plain), 1),
            "shim_ns": round(min(shim), 1),
            "plain_median_ns": round(statistics.median(plain), 1),
            "shim_median_ns": round(statistics.median(shim), 1),
            "overhead_ns": round(diff, 1),
            "overhead_min_ns": round(min(shim) - min(plain), 1),
        }

    def ab(self, op: str, shim: bool) -> dict[str, float]:
        """One process alternating rounds between the hooks and the driver's own functions."""
        out = self.drive(shim, op, AB_ROUNDS, AB_PAIRS[op], 4096).strip().splitlines()[-1]
        kv = dict(p.split("=") for p in out.split()[1:])
        return {k: float(v) for k, v in kv.items()}

    def paired(self, op: str) -> dict[str, Any]:
        """The shim's cost per pair on one path: processes under the shim, each
        alternating hooked and driver rounds, interleaved with the same
        alternation without the shim (both sides the driver: the noise floor)."""
        shim, floor = [], []
        for _ in range(AB_PROCS):
            floor.append(self.ab(op, False))
            shim.append(self.ab(op, True))
        diffs = [r["diff_ns"] for r in shim]
        return {
            "overhead_ns": round(statistics.median(diffs), 1),
            "overhead_per_process_ns": [round(d, 1) for d in diffs],
            "noise_floor_ns": [round(r["diff_ns"], 1) for r in floor],
            "hook_min_ns": round(min(r["hook_ns"] for r in shim), 1),
            "driver_min_ns": round(min(r["real_ns"] for r in shim), 1),
            "overhead_min_ns": round(min(r["hook_ns"] for r in shim) - min(r["real_ns"] for r in shim), 1),
            "rounds": AB_ROUNDS,
            "pairs_per_round": AB_PAIRS[op],
            "processes": AB_PROCS,
        }

    def startup(self, shim: bool, check: bool = False) -> tuple[float, float, list[str]]:
        """Wall seconds for STARTUP_PROCS processes started at once to init, alloc,
        free and exit, the CPU seconds they used together, and (`check`) what each printed."""
        cpu0 = _children_cpu()
        t0 = time.monotonic()
        procs = [
            subprocess.Popen(
                [str(DRIVER), "start", *(["check"] if check else [])],
                env=self.env(shim, self.containers[i % len(self.containers)]),
                stdout=subprocess.PIPE if check else subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
            for i in range(STARTUP_PROCS)
        ]
        outs = [p.communicate(timeout=600) for p in procs]
        wall = time.monotonic() - t0
        errors = [err for p, (_, err) in zip(procs, outs, strict=True) if p.returncode != 0]
        if errors:
            raise RuntimeError(f"start-up processes failed: {errors[:3]}")
        return wall, _children_cpu() - cpu0, [out.decode() for out, _ in outs if out]

    def charges(self) -> dict[str, Any]:
        """STARTUP_PROCS started at once under the shim, each comparing what its slot counts
        for its context with NVML's figure for it: how many matched, byte for byte."""
        _, _, outs = self.startup(True, check=True)
        pairs = []
        for out in outs:
            kv = dict(p.split("=") for p in out.split()[1:])
            pairs.append((int(kv["counted"]), int(kv["nvml"])))
        exact = sum(1 for counted, nvml in pairs if counted == nvml > 0)
        return {
            "processes": len(pairs),
            "exact": exact,
            "mismatched": [list(p) for p in pairs if p[0] != p[1] or p[1] <= 0][:10],
        }

    def contention(self) -> dict[str, float]:
        # The pool path: with no syscall in the way, contention on the shared
        # usage counter would show.
        alone = min(self.loop("asyncfree", True, 4096)[1] for _ in range(3))
        cmd = [str(DRIVER), "asyncfree", str(ROUNDS), str(LOOP_N), "4096"]
        procs = [
            subprocess.Popen(cmd, env=self.env(True), stdout=subprocess.PIPE, text=True)
            for _ in range(CONTENTION_PROCS)
        ]
        cpus = [parse(p.communicate(timeout=600)[0])[1] for p in procs]
        together = statistics.median(cpus)
        return {
            "alone_cpu_ns": round(alone, 1),
            "together_cpu_ns": round(together, 1),
            "ratio": together / alone,
        }


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def parse(line: str) -> tuple[float, float]:
    kv = dict(p.split("=") for p in line.split()[1:])
    return float(kv["wall_ns"]), float(kv["cpu_ns"])


def main() -> int:
    build_driver()
    with tempfile.TemporaryDirectory(prefix="gpufrac-bench-shim-") as tmp:
        b = Bench(Path(tmp))
        pool = b.paired("abasync")
        mmap = b.paired("abfree")
        # The same pairs in separate plain and shim processes, interleaved.
        alloc = b.overhead("asyncfree", 4096)
        alloc_mmap = b.overhead("allocfree", 4096)
        gate = b.paired("abgate")
        launch = b.overhead("launch")
        getinfo = b.overhead("getinfo")
        runs = [(b.startup(False)[:2], b.startup(True)[:2]) for _ in range(STARTUP_RUNS)]  # interleaved
        plain_s = min(r[0][0] for r in runs)
        plain_cpu = min(r[0][1] for r in runs)
        shim_s = min(r[1][0] for r in runs)
        shim_cpu = min(r[1][1] for r in runs)
        charges = b.charges()
        cont = b.contention()
    result: dict[str, Any] = {
        # The shim's added cost per alloc+free pair (4 KiB), each path: see the module doc.
        "pool_pair_overhead_ns": pool["overhead_ns"],
        "mmap_pair_overhead_ns": mmap["overhead_ns"],
        "target_ns": TARGET_NS,
        # A quick run measures nothing: it claims nothing either.
        "target_met": None
        if quick()
        else {"pool": pool["overhead_ns"] < TARGET_NS, "mmap": mmap["overhead_ns"] < TARGET_NS},
        "quick": quick(),
        "alloc_free_overhead_ns": alloc["overhead_ns"],
        "alloc_free_ratio": round((alloc["plain_ns"] + alloc["overhead_ns"]) / alloc["plain_ns"], 3),
        # The swap-in gate's cost per call of a function the shim does not hook.
        "gate_call_overhead_ns": gate["overhead_ns"],
        "launch_overhead_ns": launch["overhead_ns"],
        "getinfo_overhead_ns": getinfo["overhead_ns"],
        # Extra wall time per process when STARTUP_PROCS start at once (shim vs none).
        "startup_ms_per_process": round((shim_s - plain_s) * 1000 / STARTUP_PROCS, 3),
        # STARTUP_PROCS processes at once, shim / no shim (target under 1.3 each), and whether
        # every one's context charge was NVML's figure for it.
        "startup_wall_ratio": round(shim_s / plain_s, 3),
        "startup_cpu_ratio": round(shim_cpu / plain_cpu, 3),
        "startup_charges_exact": charges["exact"] == charges["processes"] == STARTUP_PROCS,
        "contention_8proc_ratio": round(cont["ratio"], 3),
        "details": {
            "pool_pair": {
                **pool,
                "calls": "cuMemAllocAsync + cuMemFreeAsync, hooks vs driver in one process",
            },
            "mmap_pair": {**mmap, "calls": "cuMemAlloc_v2 + cuMemFree_v2, hooks vs driver in one process"},
            "gate_call": {**gate, "calls": "cuCtxGetDevice: the shim's gate trampoline vs the driver's own"},
            "alloc_free_pair": {**alloc, "calls": "cuMemAllocAsync + cuMemFreeAsync (pool: no syscall)"},
            "alloc_free_pair_mmap": {
                **alloc_mmap,
                "calls": "cuMemAlloc_v2 + cuMemFree_v2 (mmap/munmap in the fake: syscall noise dominates)",
            },
            "launch": launch,
            "getinfo": getinfo,
            "startup": {
                "processes": STARTUP_PROCS,
                "containers": STARTUP_CONTAINERS,
                "plain_wall_s": round(plain_s, 3),
                "shim_wall_s": round(shim_s, 3),
                "plain_ms_per_process": round(plain_s * 1000 / STARTUP_PROCS, 3),
                "shim_ms_per_process": round(shim_s * 1000 / STARTUP_PROCS, 3),
                "added_cpu_ms_per_process": round((shim_cpu - plain_cpu) * 1000 / STARTUP_PROCS, 3),
                "plain_cpu_s": round(plain_cpu, 3),
                "shim_cpu_s": round(shim_cpu, 3),
                "charges": charges,
            },
            "contention": {**cont, "processes": CONTENTION_PROCS},
            "method": (
                "pairs: median of per-round (hooks - driver) differences in one process, median over "
                "processes; others: min over rounds of a C loop, separate plain/shim processes "
                "interleaved; same run; fake libcuda (simgpu) as the driver"
            ),
            "cpus": os.cpu_count(),
            "cc": shutil.which(os.environ.get("CC", "cc")),
        },
    }
    out = results_dir()
    out.mkdir(parents=True, exist_ok=True)
    (out / "shim.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
