"""The real-GPU suite's body (bench/gpu_suite.sh runs it with the interpreter it picked).

1. Self-checks, no GPU needed (a few seconds): the packages the suite relies on; the
   carried shim build (x86-64, built from these sources) and generated protos; the
   carried wheels (they resolve offline for CPython 3.12, and here); the kube-free groups'
   tests collect, and the modules they and the benches use import, with the Kubernetes
   client and kmock made unimportable.
2. The GPU: nvidia-smi (or NVML) must list one. Without: the report says so, exit 2.
3. The groups, in order, each bounded by its own cap and by what is left of the suite's
   budget (SUITE_BUDGET_S in bench/gpu_call.py); one that runs out is interrupted
   (SIGINT: pytest writes its JUnit XML), then killed with its processes; the next one
   starts. A group that would start with less than its minimum left is "not reached".
   Kube-free groups run with kubernetes and kmock unimportable, so they prove it; the
   resolvers group first installs the carried wheels of what this Python lacks.
4. gpu_suite.json, gpu_suite.md and gpu_suite.log into the output directory
   (bench/gpu_report.py), the Markdown also to docs/gpu-results.md when tests ran.

Exit status: 0 every group passed; 1 a self-check or group failed; 2 no GPU (or bad usage).

No `main()`: `python -m bench` runs every bench module that has one. Over 500 lines: the
self-checks, the groups and their shared time budget are one runner; what it reports and the
call that starts it live apart (gpu_report.py, gpu_call.py).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if not __package__:  # run as a script (gpu_suite.sh): the checkout's bench package
    sys.path.insert(0, str(ROOT))

from bench import gpu_call, gpu_report  # noqa: E402

RESERVE_S = 20  # kept back from the budget for the report
GRACE_S = 20  # an interrupted group's time to write its results before it is killed
NOKUBE = ("kubernetes", "kmock")
REQUIRED = (
    "torch",
    "pynvml",
    "cuda.bindings",
    "grpc",
    "google.protobuf",
    "prometheus_client",
    "psutil",
    "yaml",
)
REQUIRED += ("pytest", "pytest_timeout")
OPTIONAL = ("transformers", "cupy", "uvloop")  # a test that needs one fails, naming it
# What the kube-free groups and the benches import, beyond what collecting the tests does.
KUBE_FREE_MODULES = (
    "gpufrac.agent.arbiter.service",
    "gpufrac.agent.kube.events",
    "gpufrac.agent.arbiter.swap.resolver",
    "gpufrac.agent.arbiter.resolvers",
    "gpufrac.agent.arbiter.swap.checkpoint",
    "gpufrac.agent.gpu.inventory",
    "gpufrac.agent.gpu.health",
    "gpufrac.agent.metrics.registry",
    "gpufrac.agent.processes.callers",
    "gpufrac.agent.booking.ledger",
    "gpufrac.agent.cli.commands",
    "gpufrac.deviceplugin.server",
    "gpufrac.simgpu.runtime",
    "gpufrac.simgpu.spec",
    "bench.gpu_report",
    "bench.shim",
    "bench.arbiter",
)
EM_X86_64 = 62
# Imports each module named on the command line; the first that fails is named.
IMPORT_EACH = """
import importlib, sys
for m in sys.argv[1:]:
    try:
        importlib.import_module(m)
    except Exception as e:
        sys.exit(f"{m}: {type(e).__name__}: {e}")
"""


@dataclass(frozen=True)
class Group:
    name: str
    what: str
    cap_s: int  # at most this long
    min_s: int  # not started with less left
    files: tuple[str, ...] = ()  # a pytest group: these modules of tests/gpu
    bench: str = ""  # or `python -m bench <bench>`
    kube: bool = False  # needs the Kubernetes client and kmock
    test_timeout_s: int = 180  # each test (pytest-timeout)


GROUPS = (
    Group("inventory", "inventory, topology, health, CLI against nvidia-smi", 60, 20,
          ("test_inventory_gpu.py",)),
    Group("shim", "PyTorch held to a limit: views, OOM and recovery, expandable, graphs, 2 processes",
          150, 40, ("test_shim_gpu.py",), test_timeout_s=120),
    Group("frameworks", "transformers generate() and NCCL init under the shim", 120, 40,
          ("test_frameworks_gpu.py",), test_timeout_s=240),
    Group("context", "what a context, cuBLAS, cuDNN, NCCL, CuPy cost; NVML against the shim", 120, 40,
          ("test_context_gpu.py",), test_timeout_s=300),
    Group("overhead", "shim against none: training loop, allocation loops, start-up", 150, 60,
          ("test_overhead_gpu.py",), test_timeout_s=150),
    Group("swap", "checkpoint swap: bytes intact, GB/s against pinned copies, mid-kernel, 2 streams",
          150, 40, ("test_swap_gpu.py",), test_timeout_s=150),
    Group("resolvers", "the arbiter's wait, evict and swap, pod identity (kubernetes, kmock)", 180, 60,
          ("test_resolvers_gpu.py",), kube=True, test_timeout_s=170),
    Group("compute-shares", "compute shares with real kernels (not landed yet)", 30, 5,
          ("test_compute_shares_gpu.py",)),
    Group("bench-shim", "`python -m bench shim` (simgpu) on this machine's cores", 150, 60,
          bench="shim"),
    Group("bench-arbiter", "`python -m bench arbiter` (simgpu) on this machine's cores", 300, 90,
          bench="arbiter"),
)  # fmt: skip
BY_NAME = {g.name: g for g in GROUPS}


@dataclass
class Run:
    """One run of the suite: where things go and what has been seen."""

    out: Path
    work: Path
    budget_s: float
    python: str = sys.executable
    started: float = field(default_factory=time.monotonic)
    log_path: Path = field(init=False)

    def __post_init__(self) -> None:
        self.log_path = self.out / "gpu_suite.log"
        self.out.mkdir(parents=True, exist_ok=True)
        self.log_path.write_text("")

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.started)

    def say(self, msg: str) -> None:
        line = f"== gpu_suite [{time.monotonic() - self.started:5.0f}s]: {msg}"
        print(line, file=sys.stderr, flush=True)
        with self.log_path.open("a") as f:
            f.write(line + "\n")


# -- environments ----------------------------------------------------------------------------


def real_driver_env() -> dict[str, str]:
    """This environment without anything that would load simgpu's fake driver or the shim."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("SIMGPU_STATE", "LD_PRELOAD", "GPUFRAC_CONTAINER_DIR")
    }
    sim = {os.path.realpath(ROOT / d) for d in ("build/native", "build/asan")}
    paths = [p for p in env.get("LD_LIBRARY_PATH", "").split(":") if p and os.path.realpath(p) not in sim]
    if paths:
        env["LD_LIBRARY_PATH"] = ":".join(paths)
    else:
        env.pop("LD_LIBRARY_PATH", None)
    return env


def nokube_dir(work: Path) -> Path:
    """A directory that, first on PYTHONPATH, makes `import kubernetes` and `import kmock` fail."""
    d = work / "nokube"
    for name in NOKUBE:
        (d / name).mkdir(parents=True, exist_ok=True)
        (d / name / "__init__.py").write_text(
            f"raise ImportError('{name} is kept out of this group by bench/gpu_suite.py: the shim, the "
            "resolvers\\' driver calls and the benches must not need the Kubernetes client')\n"
        )
    return d


def group_env(run: Run, *front: Path) -> dict[str, str]:
    env = real_driver_env()
    env["PYTHONPATH"] = os.pathsep.join([*map(str, front), str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env["PYTHONUNBUFFERED"] = "1"
    env["GPUFRAC_GPU_RESULTS"] = str(run.work / "measurements")
    return env


def sh(argv: Sequence[str], env: dict[str, str] | None = None, timeout: float = 120) -> tuple[int, str]:
    try:
        r = subprocess.run(
            list(argv), cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        return 124, f"timed out after {timeout:.0f}s"
    except OSError as e:
        return 127, str(e)
    return r.returncode, (r.stdout + r.stderr).strip()


def tail(text: str, lines: int = 3) -> str:
    return " / ".join(line.strip() for line in text.strip().splitlines()[-lines:])


# -- self-checks -------------------------------------------------------------------------------

Check = dict[str, Any]


def check(run: Run, name: str, fn: Callable[[], tuple[bool, str]]) -> Check:
    t0 = time.monotonic()
    try:
        ok, detail = fn()
    except Exception as e:  # a check that breaks is a failed check, with its reason
        ok, detail = False, f"{type(e).__name__}: {e}"
    run.say(f"self-check {name}: {'ok' if ok else 'FAILED'}: {detail}")
    return {"name": name, "ok": ok, "detail": detail, "seconds": round(time.monotonic() - t0, 2)}


def c_python() -> tuple[bool, str]:
    v = sys.version_info
    return v >= (3, 10), f"{platform.python_version()} at {sys.executable}"


def c_packages() -> tuple[bool, str]:
    missing = [m for m in REQUIRED if importlib.util.find_spec(m) is None]
    absent = [m for m in OPTIONAL if importlib.util.find_spec(m) is None]
    note = f"; without {', '.join(absent)} (the tests needing them fail)" if absent else ""
    if missing:
        return False, f"missing: {', '.join(missing)}{note}"
    return True, f"{len(REQUIRED)} required present{note}"


def elf_machine(path: Path) -> int:
    head = path.read_bytes()[:20]
    if head[:4] != b"\x7fELF":
        raise ValueError(f"{path} is not an ELF file")
    return int.from_bytes(head[18:20], "little")


def c_native(run: Run) -> tuple[bool, str]:
    d = ROOT / gpu_call.NATIVE
    names = ("libmemguard.so", "libcuda.so.1", "libnvidia-ml.so.1", "mg_ctest")
    built = gpu_call.stamp_matches() is True and all((d / n).exists() for n in names)
    if not built and shutil.which("make") and shutil.which("cc"):
        run.say("build/native missing or without a record of these sources: make native")
        rc, out = sh(["make", "-s", "native"], timeout=300)
        if rc != 0:
            return False, f"make native failed: {tail(out)}"
        gpu_call.write_stamp()
    missing = [n for n in names if not (d / n).exists()]
    if missing:
        return (
            False,
            f"{', '.join(missing)} missing in {gpu_call.NATIVE} and no cc here: run bench/gpu_prepare.sh",
        )
    wrong = [n for n in names if elf_machine(d / n) != EM_X86_64]
    if wrong:
        return False, f"not x86-64: {', '.join(wrong)} (built on another machine: rebuild on x86-64)"
    match = gpu_call.stamp_matches()
    if match is not True:
        why = "no record of its sources" if match is None else "built from other sources"
        return False, f"{gpu_call.NATIVE}: {why} (run bench/gpu_prepare.sh)"
    env = real_driver_env()
    rc, out = sh([run.python, "-c", f"import ctypes; ctypes.CDLL({str(d / 'libmemguard.so')!r})"], env, 60)
    if rc != 0:
        return False, f"libmemguard.so does not load: {tail(out)}"
    return True, f"{', '.join(names)}: x86-64, built from these sources, the shim loads"


def c_protos(run: Run) -> tuple[bool, str]:
    gpu_call.restore_protos()  # carried in build/proto (gpu_prepare.sh)
    files = gpu_call.proto_files()
    if not files:
        return False, "no gpufrac/proto/*_pb2*.py: run bench/gpu_prepare.sh (make proto) and carry them"
    mods = [f[:-3].replace("/", ".") for f in files]
    rc, out = sh([run.python, "-c", IMPORT_EACH, *mods], group_env(run), 60)
    return rc == 0, f"{len(mods)} import" if rc == 0 else f"import failed: {tail(out, 1)}"


def c_kube_free_imports(run: Run) -> tuple[bool, str]:
    env = group_env(run, nokube_dir(run.work))
    rc, out = sh([run.python, "-c", IMPORT_EACH, *KUBE_FREE_MODULES], env, 120)
    if rc != 0:
        return False, f"a module needs kubernetes or kmock: {tail(out, 1)}"
    return True, f"{len(KUBE_FREE_MODULES)} modules import with kubernetes and kmock unimportable"


def c_collect(run: Run) -> tuple[bool, str]:
    files = [f"tests/gpu/{f}" for g in GROUPS if g.files and not g.kube for f in g.files]
    argv = [run.python, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
    argv += ["--confcutdir", "tests/gpu", *files]
    rc, out = sh(argv, group_env(run, nokube_dir(run.work)), 180)
    m = re.search(r"(\d+) tests? collected", out)
    if rc != 0 or not m:
        return False, f"collecting the kube-free groups failed ({rc}): {tail(out, 6)}"
    return True, f"{m.group(1)} tests of {len(files)} modules collect with kubernetes and kmock unimportable"


def kube_present(run: Run) -> bool:
    code = "import kubernetes, kmock"
    return sh([run.python, "-c", code], group_env(run), 60)[0] == 0


def pip_wheel_args() -> list[str]:
    args = ["--only-binary=:all:", "--python-version", gpu_call.WHEEL_PYTHON, "--implementation", "cp"]
    return args + [a for p in gpu_call.WHEEL_PLATFORMS for a in ("--platform", p)]


def c_wheels(run: Run) -> tuple[bool, str]:
    wheels = ROOT / gpu_call.WHEELS
    if kube_present(run):
        return True, "kubernetes and kmock are installed: no wheels needed"
    if not wheels.is_dir() or not any(wheels.glob("*.whl")):
        return (
            False,
            "no kubernetes or kmock here and no wheels in .whl: run bench/gpu_prepare.sh and carry .whl",
        )
    with tempfile.TemporaryDirectory() as t:
        # The carried set is whole for CPython 3.12 with nothing installed: the worst case.
        argv = [
            run.python,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "-q",
            "--no-index",
            "--find-links",
            str(wheels),
        ]
        argv += ["--target", t, *pip_wheel_args(), *gpu_call.KUBE_PINS]
        rc, out = sh(argv, offline_env(), 120)
    if rc != 0:
        return (
            False,
            f"the wheels in .whl do not resolve offline for CPython {gpu_call.WHEEL_PYTHON}: {tail(out)}",
        )
    here = "{}.{}".format(*sys.version_info[:2])
    if here != gpu_call.WHEEL_PYTHON:
        return (
            True,
            f"resolve offline for CPython {gpu_call.WHEEL_PYTHON} (this is {here}: not installable here)",
        )
    report, err = missing_wheels(run)
    if report is None:
        return False, f"they do not resolve offline beside what is installed: {err}"
    return True, f"resolve offline; {len(report)} to install beside what is installed"


def c_cc() -> tuple[bool, str]:
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc):
        return True, f"{cc}: bench shim compiles its driver (build/bench/shim_bench)"
    return False, f"no C compiler ({cc}): the bench-shim group cannot build its driver"


def selfchecks(run: Run) -> list[Check]:
    return [
        check(run, "python", c_python),
        check(run, "packages", c_packages),
        check(run, "native build", lambda: c_native(run)),
        check(run, "protos", lambda: c_protos(run)),
        check(run, "imports without kubernetes", lambda: c_kube_free_imports(run)),
        check(run, "tests collect without kubernetes", lambda: c_collect(run)),
        check(run, "wheels for the resolvers group", lambda: c_wheels(run)),
        check(run, "C compiler", c_cc),
    ]


# -- the GPU -----------------------------------------------------------------------------------

_NVML_PROBE = """
import json, pynvml
pynvml.nvmlInit()
print(json.dumps(pynvml.nvmlDeviceGetCount()))
"""


def find_gpus(run: Run) -> tuple[str, str | None]:
    """nvidia-smi's CSV of the GPUs, or why there is none."""
    smi = shutil.which("nvidia-smi")
    if smi:
        rc, out = sh(
            [smi, "--query-gpu=index,name,driver_version,memory.total,uuid", "--format=csv,noheader,nounits"],
            real_driver_env(),
            60,
        )
        if rc == 0 and gpu_report.parse_gpus(out):
            return out, None
        why = f"nvidia-smi lists no GPU ({tail(out, 1) or rc})"
    else:
        why = "nvidia-smi is not installed"
    rc, out = sh([run.python, "-c", _NVML_PROBE], real_driver_env(), 60)
    if rc == 0 and out.strip().splitlines()[-1:] != ["0"]:
        return "", None  # NVML sees one though nvidia-smi is missing
    return "", f"{why}, and NVML: {tail(out, 1) if rc else 'no device'}"


# -- groups ------------------------------------------------------------------------------------


def offline_env() -> dict[str, str]:
    env = dict(os.environ, PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    env.pop("PIP_FIND_LINKS", None)
    return env


def missing_wheels(run: Run) -> tuple[list[str] | None, str]:
    """The carried wheels pip would install beside what this Python has (its resolver decides)."""
    wheels = ROOT / gpu_call.WHEELS
    report = run.work / "pip-report.json"
    argv = [run.python, "-m", "pip", "install", "--dry-run", "-q", "--no-index", "--find-links", str(wheels)]
    argv += ["--report", str(report), *gpu_call.KUBE_PINS]
    rc, out = sh(argv, offline_env(), 120)
    if rc != 0:
        return None, tail(out)
    items = json.loads(report.read_text()).get("install", [])
    return [i["download_info"]["url"].removeprefix("file://") for i in items], ""


def install_kube(run: Run) -> tuple[Path | None, str]:
    """kubernetes and kmock for the resolvers group: what is missing, from the carried wheels,
    into a directory put first on that group's PYTHONPATH (the system's packages untouched)."""
    if kube_present(run):
        return None, ""
    files, err = missing_wheels(run)
    if files is None:
        return None, f"the carried wheels do not resolve here: {err}"
    site = run.work / "kube-site"
    argv = [run.python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
    argv += ["--target", str(site), *files]
    rc, out = sh(argv, offline_env(), 180)
    if rc != 0:
        return None, f"installing the carried wheels failed: {tail(out)}"
    run.say(f"installed {len(files)} carried wheels for the resolvers group into {site}")
    return site, ""


def stop(p: subprocess.Popen[bytes]) -> None:
    """SIGINT to the group's leader (pytest writes its results), then its whole session killed."""
    try:
        p.send_signal(signal.SIGINT)
        p.wait(GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, signal.SIGKILL)
    p.wait()


def run_group(run: Run, g: Group, extra: Sequence[str]) -> dict[str, Any]:
    rec: dict[str, Any] = {"name": g.name, "what": g.what, "status": "not reached", "seconds": None}
    left = run.left() - RESERVE_S - GRACE_S
    if left < g.min_s:
        rec["error"] = f"not started: {left:.0f}s of the budget left, it needs {g.min_s}s"
        run.say(f"{g.name}: {rec['error']}")
        return rec
    front = [nokube_dir(run.work)]
    if g.kube:
        site, err = install_kube(run)
        if err:
            rec.update(status="error", error=err)
            run.say(f"{g.name}: {err}")
            return rec
        front = [site] if site else []
    env = group_env(run, *front)
    junit = run.work / f"junit-{g.name}.xml"
    if g.bench:
        argv = [run.python, "-m", "bench", "--results", str(run.work / "bench"), g.bench]
    else:
        argv = [
            run.python,
            "-m",
            "pytest",
            "-q",
            "-rA",
            "-p",
            "no:cacheprovider",
            f"--timeout={g.test_timeout_s}",
        ]
        argv += [f"--junitxml={junit}"]
        if not g.kube:
            argv += ["--confcutdir", "tests/gpu"]  # tests/conftest.py's plugins import kubernetes
        argv += [f"tests/gpu/{f}" for f in g.files] + list(extra)
    budget = min(g.cap_s, left)
    run.say(f"{g.name}: starting ({budget:.0f}s at most): {g.what}")
    t0 = time.monotonic()
    with run.log_path.open("ab") as log:
        log.write(f"\n===== group {g.name}: {' '.join(argv)}\n".encode())
        log.flush()
        p = subprocess.Popen(
            argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            rc = p.wait(budget)
            timed_out = False
        except subprocess.TimeoutExpired:
            stop(p)
            rc, timed_out = p.returncode, True
    rec["seconds"] = round(time.monotonic() - t0, 1)
    rec["rc"] = rc
    if junit.exists():
        try:
            j = gpu_report.parse_junit(junit.read_text())
            rec["counts"] = {k: j[k] for k in ("passed", "failed", "error", "skipped")}
            rec["cases"] = j["cases"]
        except Exception as e:  # a half-written file: said, not fatal
            rec["error"] = f"unreadable JUnit XML: {e}"
    log_tail = tail(run.log_path.read_text(errors="replace"), 4)
    if timed_out:
        rec["status"] = "timeout"
        rec["error"] = f"stopped after {budget:.0f}s (its cap or the suite's budget); last output: {log_tail}"
    elif g.bench:
        result = run.work / "bench" / f"{g.bench}.json"
        rec["status"] = "passed" if rc == 0 and result.exists() else "failed"
        if rec["status"] == "failed":
            rec["error"] = f"exit {rc}: {log_tail}"
    else:
        c = rec.get("counts", {})
        if not c or rc not in (0, 1):
            rec["status"] = "error"
            rec.setdefault("error", f"pytest exit {rc} without results: {log_tail}")
        elif c["failed"] or c["error"]:
            rec["status"] = "failed"
        elif c["passed"] == 0:
            rec["status"] = "skipped"  # every test said why (the report lists them)
        else:
            rec["status"] = "passed"
    run.say(
        f"{g.name}: {rec['status']} in {rec['seconds']}s" + (f": {rec['error']}" if rec.get("error") else "")
    )
    return rec


# -- the whole -------------------------------------------------------------------------------


def collect_env(run: Run) -> dict[str, Any]:
    rc, out = sh([run.python, str(ROOT / "bench" / "gpu_report.py"), "env"], group_env(run), 120)
    if rc != 0:
        return {"python": platform.python_version(), "error": tail(out)}
    env: dict[str, Any] = json.loads(out[out.index("{") :])
    return env


def benches(run: Run) -> dict[str, Any]:
    out = {}
    for p in sorted((run.work / "bench").glob("*.json")):
        out[p.stem] = json.loads(p.read_text())
    return out


def finish(
    run: Run,
    checks: list[Check],
    groups: list[dict[str, Any]],
    gpus_csv: str,
    env: dict[str, Any],
    no_gpu: str | None,
    copy_docs: bool,
) -> dict[str, Any]:
    report = gpu_report.build(
        selfchecks=checks,
        groups=groups,
        measurements=gpu_report.load_measurements(run.work / "measurements"),
        benches=benches(run),
        gpus=gpu_report.parse_gpus(gpus_csv),
        env=env,
        no_gpu=no_gpu,
        budget_s=run.budget_s,
        elapsed_s=round(time.monotonic() - run.started, 1),
    )
    gpu_report.write(report, run.out, [ROOT / "docs" / "gpu-results.md"] if copy_docs else [])
    return report


def names(arg: str) -> list[str]:
    got = [n.strip() for n in arg.split(",") if n.strip()]
    unknown = [n for n in got if n not in BY_NAME]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown group(s) {', '.join(unknown)}; groups: {', '.join(BY_NAME)}"
        )
    return got


def parse(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    ap = argparse.ArgumentParser(
        prog="bench/gpu_suite.sh",
        description="The real-GPU suite: self-checks, then tests/gpu and the benches in groups "
        "(bench/README.md).",
        epilog="Arguments after -- go to every pytest group (e.g. -- -k overhead). Groups: "
        + ", ".join(BY_NAME),
    )
    ap.add_argument(
        "--out",
        default=os.environ.get("OUT") or str(ROOT / "bench" / "results"),
        help="where gpu_suite.json, .md and .log go (default: $OUT, else bench/results)",
    )
    ap.add_argument(
        "--budget",
        type=float,
        default=float(os.environ.get("GPUFRAC_GPU_SUITE_BUDGET", gpu_call.SUITE_BUDGET_S)),
        help="seconds for the whole run (default %(default)s)",
    )
    ap.add_argument("--only", type=names, default=None, help="run only these groups (comma-separated)")
    ap.add_argument("--skip", type=names, default=[], help="leave these groups out")
    ap.add_argument("--check", action="store_true", help="the self-checks alone: exit 0 when they pass")
    ap.add_argument("--no-docs", action="store_true", help="do not copy the summary to docs/gpu-results.md")
    ap.add_argument("--list", action="store_true", help="list the groups and exit")
    args, extra = ap.parse_known_args(argv)
    if extra and extra[0] == "--":
        extra = extra[1:]
    elif extra:
        ap.error(f"unknown arguments {extra} (pytest's go after --)")
    return args, extra  # fmt: skip


def run_suite(argv: Sequence[str]) -> int:
    args, extra = parse(argv)
    if args.list:
        for g in GROUPS:
            print(f"{g.name:15} {g.cap_s:4}s  {g.what}")
        return 0
    work = Path(tempfile.mkdtemp(prefix="gpu_suite."))
    try:
        run = Run(Path(args.out).resolve(), work, args.budget)
        run.say(f"Python {platform.python_version()} ({run.python}); output in {run.out}")
        run.say(f"budget {args.budget:.0f}s")
        checks = selfchecks(run)
        if args.check:
            ok = all(c["ok"] for c in checks)
            run.say("self-checks " + ("passed" if ok else "FAILED"))
            return 0 if ok else 1
        gpus_csv, no_gpu = find_gpus(run)
        if no_gpu:
            finish(run, checks, [], "", {"python": platform.python_version()}, no_gpu, False)
            ok = all(c["ok"] for c in checks)
            print(
                f"gpu_suite: no NVIDIA GPU here ({no_gpu}): nothing measured. The self-checks "
                + ("passed" if ok else "FAILED (above)")
                + f"; report in {run.out}/gpu_suite.md",
                file=sys.stderr,
            )
            return 2
        run.say(f"GPU: {gpus_csv.strip().splitlines()[0] if gpus_csv.strip() else '(NVML only)'}")
        env = collect_env(run)
        chosen = [g for g in GROUPS if (args.only is None or g.name in args.only) and g.name not in args.skip]
        groups = []
        for g in GROUPS:
            if g in chosen:
                groups.append(run_group(run, g, extra))
            else:
                groups.append({"name": g.name, "what": g.what, "status": "not run", "seconds": None})
        report = finish(run, checks, groups, gpus_csv, env, None, not args.no_docs)
        for t in report["targets"]:
            run.say(f"target {t['id']}: {t['verdict']} ({t['shown']})")
        ff = report["first_failure"]
        run.say(
            f"{report['verdict']}: {report['tests']['passed']} passed, {report['tests']['failed']} failed, "
            f"{report['tests']['error']} errors, {report['tests']['skipped']} skipped"
            + (f"; first failure: {ff['where']}: {ff['why']}" if ff else "")
            + f"; report in {run.out}/gpu_suite.md"
        )
        return 0 if report["ok"] else 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(run_suite(sys.argv[1:]))
