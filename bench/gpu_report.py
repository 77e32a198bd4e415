"""The report of bench/gpu_suite.sh: one JSON and one Markdown summary of a real-GPU run.

Inputs (all written by gpu_suite.sh into one work directory):
  junit.xml      pytest's --junitxml of tests/gpu: every test's outcome
  measurements/  <name>.json per measurement test (tests/gpu/gpu_support.record), e.g. the
                 shim's overhead on a training loop, shim vs. none, same run
  gpus.csv       nvidia-smi --query-gpu=index,name,driver_version,memory.total,uuid
                 --format=csv,noheader,nounits
  env.json       versions (`python bench/gpu_report.py env`): PyTorch, cuda-python, driver API

    python bench/gpu_report.py env > WORK/env.json
    python bench/gpu_report.py render WORK --json bench/results/gpu_suite.json \\
        --markdown bench/results/gpu_suite.md [--copy docs/gpu-results.md] [--pytest-rc N]

`render` exits 0 when the suite passed (tests ran, none failed), 1 otherwise. The 2 %
training-loop overhead target is reported as PASS/FAIL in the summary; it
is a measurement, so it does not change the exit status.

No `main()`: `python -m bench` (make bench) runs every bench module with one, and this
one needs a GPU run's output.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import platform
import shutil
import statistics
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

TARGET_MEASUREMENT = "train"
TARGET_MAX_PCT = 2.0
# What each measurement is, in the report's words (tests/gpu/workloads/overhead.py modes).
TITLES = {
    "train": "training loop: tiny MLP, Adam, random data",
    "torch-alloc": "torch.empty/del of varied sizes, caching allocator off",
    "cuda-alloc": "cuMemAlloc/cuMemFree pairs of varied sizes (cuda-python)",
}


# -- measurements (the tests call summarize; the report reads what they recorded) -------------


def summarize(
    name: str, unit: str, none: Sequence[float], shim: Sequence[float], **extra: Any
) -> dict[str, Any]:
    """Shim vs. none for one loop: per-iteration times of interleaved runs of each. The
    median run is compared (robust to one disturbed run); the minimum is kept too."""
    if not none or not shim:
        raise ValueError(f"{name}: need runs with and without the shim (got {len(none)} and {len(shim)})")
    med_none, med_shim = statistics.median(none), statistics.median(shim)
    return {
        "name": name,
        "unit": unit,
        "runs": min(len(none), len(shim)),
        "none": {"median": med_none, "min": min(none), "samples": list(none)},
        "shim": {"median": med_shim, "min": min(shim), "samples": list(shim)},
        "overhead_abs": med_shim - med_none,
        "overhead_pct": (med_shim / med_none - 1.0) * 100.0 if med_none > 0 else None,
        **extra,
    }


def load_measurements(directory: Path) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    if directory.is_dir():
        for p in sorted(directory.glob("*.json")):
            data = json.loads(p.read_text())
            out[str(data.get("name", p.stem))] = data
    return out


# -- inputs ------------------------------------------------------------------------------------


def parse_junit(text: str) -> dict[str, Any]:
    """Outcome of every test case in pytest's JUnit XML."""
    root = ET.fromstring(text)
    cases = []
    for tc in root.iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = tc.find(tag)
            if el is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (el.get("message") or el.text or "").strip()
                break
        module = (tc.get("classname") or "").rsplit(".", 1)[-1]
        cases.append(
            {
                "name": f"{module}::{tc.get('name')}" if module else str(tc.get("name")),
                "outcome": outcome,
                "seconds": round(float(tc.get("time") or 0.0), 2),
                "message": message.splitlines()[0][:300] if message else "",
            }
        )
    counts = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "error", "skipped")}
    return {**counts, "cases": cases}


def parse_gpus(text: str) -> list[dict[str, Any]]:
    """nvidia-smi --query-gpu=index,name,driver_version,memory.total,uuid --format=csv,noheader,nounits"""
    gpus = []
    for row in csv.reader(io.StringIO(text)):
        cells = [c.strip() for c in row]
        if len(cells) < 5 or not cells[0].isdigit():
            continue
        gpus.append(
            {
                "index": int(cells[0]),
                "name": cells[1],
                "driver": cells[2],
                "memory_total_mib": int(float(cells[3])) if cells[3].replace(".", "").isdigit() else None,
                "uuid": cells[4],
            }
        )
    return gpus


def collect_env() -> dict[str, Any]:
    """Versions of what the suite ran on (run with the suite's interpreter and environment)."""
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "host": platform.node(),
        "kernel": platform.release(),
    }
    try:
        import torch

        env["torch"] = torch.__version__
        env["torch_cuda"] = torch.version.cuda
    except ImportError:
        env["torch"] = None
    try:
        env["cuda_python"] = metadata.version("cuda-python")
    except metadata.PackageNotFoundError:
        env["cuda_python"] = None
    try:
        from cuda.bindings import driver

        driver.cuInit(0)
        err, version = driver.cuDriverGetVersion()
        env["cuda_driver_api"] = int(version) if int(err) == 0 else None
    except Exception as e:  # no driver: the report says so
        env["cuda_driver_api"] = None
        env["cuda_error"] = str(e)
    return env


# -- the report --------------------------------------------------------------------------------


def build(
    junit: Mapping[str, Any],
    measurements: Mapping[str, Mapping[str, Any]],
    gpus: Sequence[Mapping[str, Any]],
    env: Mapping[str, Any],
    pytest_rc: int | None = None,
    when: str | None = None,
) -> dict[str, Any]:
    t = measurements.get(TARGET_MEASUREMENT)
    measured = t.get("overhead_pct") if t else None
    target = {
        "what": f"shim overhead on the {TITLES[TARGET_MEASUREMENT].split(':')[0]}",
        "max_pct": TARGET_MAX_PCT,
        "measured_pct": measured,
        "pass": None if measured is None else measured < TARGET_MAX_PCT,
    }
    ran = junit["passed"] + junit["failed"] + junit["error"]
    ok = ran > 0 and junit["failed"] == 0 and junit["error"] == 0 and pytest_rc in (None, 0)
    return {
        "generated": when or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "ok": ok,
        "pytest_rc": pytest_rc,
        "gpus": list(gpus),
        "env": dict(env),
        "tests": dict(junit),
        "measurements": {k: dict(v) for k, v in measurements.items()},
        "target": target,
    }


def _us(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e6:,.2f}"


def _pct(p: float | None) -> str:
    return "-" if p is None else f"{p:+.2f} %"


def _cell(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def markdown(report: Mapping[str, Any]) -> str:
    tests, env, target = report["tests"], report["env"], report["target"]
    verdict = "PASS" if report["ok"] else "FAIL"
    lines = [
        "# gpufrac on a real GPU",
        "",
        f"Generated by `bench/gpu_suite.sh` on {report['generated']}"
        + (f" (host `{env['host']}`)." if env.get("host") else "."),
        "",
        "| GPU | model | driver | memory |",
        "|---|---|---|---|",
    ]
    for g in report["gpus"]:
        mem = f"{g['memory_total_mib']:,} MiB" if g.get("memory_total_mib") else "-"
        lines.append(f"| {g['index']} | {_cell(g['name'])} | {g['driver']} | {mem} |")
    if not report["gpus"]:
        lines.append("| - | (nvidia-smi reported no GPU) | - | - |")
    api = env.get("cuda_driver_api")
    lines += [
        "",
        f"CUDA driver API {api // 1000}.{api % 1000 // 10}" if api else "CUDA driver API: unknown",
        f"· PyTorch {env.get('torch') or 'not installed'}"
        + (f" (CUDA {env['torch_cuda']})" if env.get("torch_cuda") else "")
        + f" · cuda-python {env.get('cuda_python') or '-'} · Python {env.get('python', '-')}.",
        "",
        f"## Result: {verdict}",
        "",
        f"{tests['passed']} passed, {tests['failed']} failed, {tests['error']} errors, "
        f"{tests['skipped']} skipped.",
        "",
        f"Target — {target['what']} under {target['max_pct']:g} %: "
        + (
            "**not measured** (the training-loop test did not record a result)."
            if target["pass"] is None
            else f"**{'PASS' if target['pass'] else 'FAIL'}** ({_pct(target['measured_pct'])})."
        ),
        "",
        "## Shim overhead (same run, interleaved; median per iteration)",
        "",
        "| loop | runs each | without shim (µs) | with shim (µs) | overhead |",
        "|---|---|---|---|---|",
    ]
    for name, m in report["measurements"].items():
        if "none" not in m or "shim" not in m:
            continue
        lines.append(
            f"| {_cell(TITLES.get(name, name))} (per {str(m.get('unit', 's/iteration')).split('/')[-1]}) | "
            f"{m.get('runs', '-')} | "
            f"{_us(m['none']['median'])} | {_us(m['shim']['median'])} | {_pct(m.get('overhead_pct'))} |"
        )
    if not any("none" in m and "shim" in m for m in report["measurements"].values()):
        lines.append("| (no measurement recorded) | - | - | - | - |")
    other = {k: v for k, v in report["measurements"].items() if "none" not in v or "shim" not in v}
    if other:
        lines += ["", "## Other measurements", ""]
        for name, m in other.items():
            fields = ", ".join(f"{k} = {v}" for k, v in m.items() if k != "name")
            lines.append(f"- **{_cell(name)}**: {_cell(fields)}")
    lines += ["", "## Tests", "", "| test | outcome | seconds | note |", "|---|---|---|---|"]
    for c in tests["cases"]:
        lines.append(f"| `{c['name']}` | {c['outcome']} | {c['seconds']} | {_cell(c['message'])} |")
    return "\n".join(lines) + "\n"


def render(args: argparse.Namespace) -> int:
    work = Path(args.work)
    junit_path = work / "junit.xml"
    junit = (
        parse_junit(junit_path.read_text())
        if junit_path.exists()
        else {"passed": 0, "failed": 0, "error": 1, "skipped": 0, "cases": []}
    )
    gpus = parse_gpus((work / "gpus.csv").read_text()) if (work / "gpus.csv").exists() else []
    env = json.loads((work / "env.json").read_text()) if (work / "env.json").exists() else {}
    report = build(junit, load_measurements(work / "measurements"), gpus, env, args.pytest_rc)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    md = markdown(report)
    Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
    Path(args.markdown).write_text(md)
    ran = report["tests"]["passed"] + report["tests"]["failed"] + report["tests"]["error"]
    for dest in args.copy:
        if not ran:  # a run that tested nothing must not replace the recorded results
            print(f"no test ran: {dest} left as it was", file=sys.stderr)
            continue
        Path(dest).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(args.markdown, dest)
    sys.stdout.write(md)
    return 0 if report["ok"] else 1


def cli(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(prog="bench/gpu_report.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("env", help="print the versions of what the suite runs on, as JSON")
    r = sub.add_parser("render", help="write the suite's JSON and Markdown summary")
    r.add_argument("work", help="the suite's work directory (junit.xml, measurements/, gpus.csv, env.json)")
    r.add_argument("--json", required=True)
    r.add_argument("--markdown", required=True)
    r.add_argument("--copy", action="append", default=[], help="also copy the Markdown here (if tests ran)")
    r.add_argument("--pytest-rc", type=int, default=None)
    args = ap.parse_args(argv)
    if args.cmd == "env":
        print(json.dumps(collect_env(), indent=2))
        return 0
    return render(args)


if __name__ == "__main__":
    raise SystemExit(cli(sys.argv[1:]))
