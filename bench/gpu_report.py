"""The report of bench/gpu_suite.sh: one JSON and one Markdown summary of a real-GPU run.

bench/gpu_suite.py runs the suite in groups (pytest modules of tests/gpu, then the simgpu
benches on the GPU machine's cores) and calls `write()` with what it saw:
  self-checks    what the machine must have before a GPU is touched (packages, the
                 carried shim and protos, the wheels, imports without Kubernetes)
  groups         per group: status (passed, failed, error, timeout, not reached, not
                 run), seconds, the JUnit XML's cases, why it stopped
  measurements/  <name>.json per measurement test (tests/gpu/gpu_support.record)
  benches        the JSON of `python -m bench shim` and `python -m bench arbiter`
  gpus, env      nvidia-smi's GPUs and the versions (`collect_env`)

`targets()` sets each goal beside its measurement: PASS, FAIL, or NOT MEASURED (with why).
A goal missed is a measurement, not a test failure: it does not change the exit status.
The Markdown is what docs/gpu-results.md records.

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

# What each measurement is, in the report's words (tests/gpu/workloads/overhead.py modes).
TITLES = {
    "train": "training loop: tiny MLP, Adam, random data",
    "torch-alloc": "torch.empty/del of varied sizes, caching allocator off",
    "cuda-alloc": "cuMemAlloc/cuMemFree pairs of varied sizes (cuda-python)",
    "startup": "process start until CUDA context and first tensor (PyTorch)",
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
    for dist in ("cuda-bindings", "nvidia-ml-py", "transformers", "cupy-cuda13x", "cupy-cuda12x"):
        try:
            env[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            env[dist] = None
    try:
        from cuda.bindings import driver

        driver.cuInit(0)
        err, version = driver.cuDriverGetVersion()
        env["cuda_driver_api"] = int(version) if int(err) == 0 else None
    except Exception as e:  # no driver: the report says so
        env["cuda_driver_api"] = None
        env["cuda_error"] = str(e)
    return env


# -- goals -------------------------------------------------------------------------------------

PASS, FAIL, NOT_MEASURED = "PASS", "FAIL", "NOT MEASURED"


def _get(d: Mapping[str, Any] | None, *keys: str) -> Any:
    for k in keys:
        if not isinstance(d, Mapping):
            return None
        d = d.get(k)
    return d


def _goal(
    id_: str, what: str, goal: str, measured: Any, ok: bool | None, shown: str = "", why: str = ""
) -> dict[str, Any]:
    verdict = NOT_MEASURED if ok is None else PASS if ok else FAIL
    return {
        "id": id_,
        "what": what,
        "goal": goal,
        "measured": measured,
        "shown": shown if ok is not None else why or "not recorded (its test skipped, failed or did not run)",
        "verdict": verdict,
    }


def _le(value: Any, limit: float) -> bool | None:
    return None if not isinstance(value, (int, float)) else value <= limit


def targets(
    measurements: Mapping[str, Mapping[str, Any]], benches: Mapping[str, Any]
) -> list[dict[str, Any]]:
    """Every goal of the real-GPU issues beside what was measured for it."""
    m = measurements
    train = _get(m, "train", "overhead_pct")
    ctx = m.get("context-cost", {})
    worst, tol = ctx.get("max_abs_nvml_minus_shim_mib"), ctx.get("tolerance_mib")
    swap = m.get("swap-checkpoint", {})
    out_share, in_share, share = (
        swap.get("out_share_of_d2h"),
        swap.get("in_share_of_h2d"),
        swap.get("target_share", 0.7),
    )
    wait_ms = _get(m, "resolver-wait", "granted_after_free_ms")
    evict_s = _get(m, "resolver-evict", "burst_granted_after_s")
    shim_met = _get(benches, "shim", "target_met")
    flood = _get(benches, "arbiter", "flood_p99_ratio")
    shares = m.get("compute-shares")
    return [
        _goal(
            "train-overhead", "shim overhead on a small training loop", "< 2 %", train,
            None if train is None else train < 2.0, f"{train:+.2f} %" if train is not None else "",
        ),
        _goal(
            "context-count", "NVML's per-process memory against the shim's count, after every step",
            f"within the watchdog's allowance ({tol} MiB)" if tol else "within the watchdog's allowance",
            worst, None if worst is None or tol is None else worst <= tol,
            f"worst {worst} MiB apart" if worst is not None else "",
        ),
        _goal(
            "swap-out", "swap-out through the checkpoint API against pinned device-to-host copies",
            f">= {share:.0%}", out_share, None if out_share is None else out_share >= share,
            f"{out_share:.0%} ({swap.get('out_gbps')} of {swap.get('pinned_d2h_gbps')} GB/s)"
            if out_share is not None else "",
        ),
        _goal(
            "swap-in", "swap-in through the checkpoint API against pinned host-to-device copies",
            f">= {share:.0%}", in_share, None if in_share is None else in_share >= share,
            f"{in_share:.0%} ({swap.get('in_gbps')} of {swap.get('pinned_h2d_gbps')} GB/s)"
            if in_share is not None else "",
        ),
        _goal(
            "wait-wakeup", "a waiting burst granted after the other container's free (ours: milliseconds)",
            "<= 50 ms", wait_ms, _le(wait_ms, 50.0), f"{wait_ms} ms" if wait_ms is not None else "",
        ),
        _goal(
            "evict-grant", "a higher-priority burst granted, the lower-priority borrower killed (ours)",
            "<= 5 s", evict_s, _le(evict_s, 5.0), f"{evict_s} s" if evict_s is not None else "",
        ),
        _goal(
            "bench-shim", "`python -m bench shim`: the shim's added cost per alloc+free pair, each path",
            "< 100 ns", shim_met, None if not isinstance(shim_met, Mapping) else all(shim_met.values()),
            ", ".join(
                f"{k} {_get(benches, 'shim', f'{k}_pair_overhead_ns')} ns" for k in (shim_met or {})
            ),
        ),
        _goal(
            "bench-arbiter-flood", "`python -m bench arbiter`: burst grant p99 under a flood against at rest",
            "<= 2x", flood, _le(flood, 2.0), f"{flood}x" if flood is not None else "",
        ),
        _goal(
            "compute-shares", "compute shares with real kernels (10/90, 30/70, 25/25/50; fair, strict)",
            "as the compute-share issue states", shares, None if not shares else bool(shares.get("pass")),
            why="not measured: compute shares have not landed (tests/gpu/test_compute_shares_gpu.py)",
        ),
    ]  # fmt: skip


# -- the report --------------------------------------------------------------------------------


def first_failure(
    selfchecks: Sequence[Mapping[str, Any]], groups: Sequence[Mapping[str, Any]]
) -> dict[str, str] | None:
    """What failed first, in the order the suite ran, and why."""
    for c in selfchecks:
        if not c["ok"]:
            return {"where": f"self-check {c['name']}", "why": str(c["detail"])}
    for g in groups:
        for case in g.get("cases", []):
            if case["outcome"] in ("failed", "error"):
                return {"where": f"{g['name']}: {case['name']}", "why": case["message"]}
        if g["status"] in ("error", "timeout", "failed"):
            return {"where": f"group {g['name']}", "why": str(g.get("error") or g["status"])}
    return None


def build(
    *,
    selfchecks: Sequence[Mapping[str, Any]],
    groups: Sequence[Mapping[str, Any]],
    measurements: Mapping[str, Mapping[str, Any]],
    benches: Mapping[str, Any],
    gpus: Sequence[Mapping[str, Any]],
    env: Mapping[str, Any],
    no_gpu: str | None = None,
    budget_s: float | None = None,
    elapsed_s: float | None = None,
    when: str | None = None,
) -> dict[str, Any]:
    counts = {
        k: sum(g.get("counts", {}).get(k, 0) for g in groups)
        for k in ("passed", "failed", "error", "skipped")
    }
    ran = counts["passed"] + counts["failed"] + counts["error"]
    bad_groups = [g["name"] for g in groups if g["status"] not in ("passed", "skipped", "not run")]
    checks_ok = all(c["ok"] for c in selfchecks)
    ok = no_gpu is None and checks_ok and ran > 0 and not bad_groups
    verdict = "NO GPU" if no_gpu else "PASS" if ok else "FAIL"
    return {
        "generated": when or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "verdict": verdict,
        "ok": ok,
        "no_gpu": no_gpu,
        "budget_s": budget_s,
        "elapsed_s": elapsed_s,
        "gpus": list(gpus),
        "env": dict(env),
        "tests": counts,
        "selfchecks": [dict(c) for c in selfchecks],
        "groups": [dict(g) for g in groups],
        "rerun": [g["name"] for g in groups if g["status"] not in ("passed", "skipped", "not run")],
        "first_failure": first_failure(selfchecks, groups),
        "measurements": {k: dict(v) for k, v in measurements.items()},
        "benches": dict(benches),
        "targets": targets(measurements, benches),
    }


def _us(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e6:,.2f}"


def _pct(p: float | None) -> str:
    return "-" if p is None else f"{p:+.2f} %"


def _cell(s: Any) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def _versions(env: Mapping[str, Any]) -> str:
    api = env.get("cuda_driver_api")
    parts = [f"CUDA driver API {api // 1000}.{api % 1000 // 10}" if api else "CUDA driver API: unknown"]
    if "torch" in env:  # not read where no GPU was found
        parts.append(
            f"PyTorch {env['torch'] or 'not installed'}"
            + (f" (CUDA {env['torch_cuda']})" if env.get("torch_cuda") else "")
        )
    for dist in ("cuda-bindings", "nvidia-ml-py", "transformers", "cupy-cuda13x", "cupy-cuda12x"):
        if env.get(dist):
            parts.append(f"{dist} {env[dist]}")
    parts.append(f"Python {env.get('python', '-')}")
    return " · ".join(parts) + "."


def markdown(report: Mapping[str, Any]) -> str:
    env, tests = report["env"], report["tests"]
    took = (
        f" It took {report['elapsed_s']:.0f} s of its {report['budget_s']:.0f} s budget."
        if report.get("elapsed_s") is not None and report.get("budget_s")
        else ""
    )
    lines = [
        "# gpufrac on a real GPU",
        "",
        f"Generated by `bench/gpu_suite.sh` on {report['generated']}"
        + (f" (host `{env['host']}`)." if env.get("host") else ".")
        + took,
        "",
        "| GPU | model | driver | memory |",
        "|---|---|---|---|",
    ]
    for g in report["gpus"]:
        mem = f"{g['memory_total_mib']:,} MiB" if g.get("memory_total_mib") else "-"
        lines.append(f"| {g['index']} | {_cell(g['name'])} | {g['driver']} | {mem} |")
    if not report["gpus"]:
        lines.append("| - | (nvidia-smi reported no GPU) | - | - |")
    lines += ["", _versions(env), "", f"## Result: {report['verdict']}", ""]
    if report["no_gpu"]:
        lines += [f"No GPU: {_cell(report['no_gpu'])}. Only the self-checks ran.", ""]
    lines += [
        f"{tests['passed']} passed, {tests['failed']} failed, {tests['error']} errors, "
        f"{tests['skipped']} skipped.",
        "",
    ]
    ff = report["first_failure"]
    if ff:
        lines += [f"First failure: **{_cell(ff['where'])}**: {_cell(ff['why'])}", ""]
    if report["rerun"]:
        lines += [
            "To rerun what did not pass or was not reached: "
            f"`bash bench/gpu_suite.sh --only {','.join(report['rerun'])}`.",
            "",
        ]
    lines += ["## Targets", "", "| target | goal | measured | verdict |", "|---|---|---|---|"]
    for t in report["targets"]:
        lines.append(
            f"| {_cell(t['what'])} | {_cell(t['goal'])} | {_cell(t['shown'])} | **{t['verdict']}** |"
        )
    lines += [
        "",
        "## Groups",
        "",
        "| group | what | status | passed / failed / errors / skipped | seconds | note |",
    ]
    lines.append("|---|---|---|---|---|---|")
    for g in report["groups"]:
        c = g.get("counts", {})
        n = "/".join(str(c.get(k, 0)) for k in ("passed", "failed", "error", "skipped")) if c else "-"
        secs = f"{g['seconds']:.0f}" if g.get("seconds") is not None else "-"
        lines.append(
            f"| {g['name']} | {_cell(g.get('what', ''))} | {g['status']} | {n} | {secs} | "
            f"{_cell(g.get('error', ''))} |"
        )
    pairs = {k: v for k, v in report["measurements"].items() if "none" in v and "shim" in v}
    if pairs:
        lines += [
            "",
            "## Shim overhead (same run, interleaved; median per iteration)",
            "",
            "| loop | samples each | without shim (µs) | with shim (µs) | overhead |",
            "|---|---|---|---|---|",
        ]
        for name, m in pairs.items():
            lines.append(
                f"| {_cell(TITLES.get(name, name))} (per {str(m.get('unit', 's/it')).split('/')[-1]}) | "
                f"{m.get('runs', '-')} | "
                f"{_us(m['none']['median'])} | {_us(m['shim']['median'])} | {_pct(m.get('overhead_pct'))} |"
            )
    ctx = report["measurements"].get("context-cost")
    if ctx:
        lines += [
            "",
            f"## What a process costs (MiB; a context alone: {ctx.get('context_mib')} MiB)",
            "",
            "| step | NVML, under the shim | shim counted | NVML - shim | NVML, no shim "
            "| beyond PyTorch's reservations |",
            "|---|---|---|---|---|---|",
        ]
        plain = {r["step"]: r for r in ctx.get("steps_plain", [])}
        for r in ctx.get("steps_under_shim", []):
            p = plain.get(r["step"], {})
            note = f" ({_cell(r['error'])})" if r.get("error") else ""
            lines.append(
                f"| {r['step']}{note} | {r.get('nvml_process')} | {r.get('shim_counted')} | "
                f"{r.get('nvml_minus_shim')} | {p.get('nvml_process')} | {p.get('beyond_allocator')} |"
            )
    shown = {"context-cost", *pairs}
    other = {k: v for k, v in report["measurements"].items() if k not in shown}
    if other:
        lines += ["", "## Other measurements", ""]
        for name, m in other.items():
            fields = ", ".join(f"{k} = {v}" for k, v in m.items() if k != "name")
            lines.append(f"- **{_cell(name)}**: {_cell(fields)}")
    if report["benches"]:
        lines += ["", "## simgpu benches on this machine's cores", ""]
        for name, b in report["benches"].items():
            figures = ", ".join(f"{k} = {v}" for k, v in b.items() if isinstance(v, (int, float, str)))
            lines.append(f"- **{_cell(name)}**: {_cell(figures)}")
    lines += ["", "## Self-checks", "", "| check | result | detail |", "|---|---|---|"]
    for c in report["selfchecks"]:
        lines.append(f"| {c['name']} | {'ok' if c['ok'] else '**FAILED**'} | {_cell(c['detail'])} |")
    cases = [(g["name"], c) for g in report["groups"] for c in g.get("cases", [])]
    if cases:
        lines += ["", "## Tests", "", "| group | test | outcome | seconds | note |", "|---|---|---|---|---|"]
        for group, c in cases:
            lines.append(
                f"| {group} | `{c['name']}` | {c['outcome']} | {c['seconds']} | {_cell(c['message'])} |"
            )
    return "\n".join(lines) + "\n"


def write(report: Mapping[str, Any], out: Path, copy_to: Sequence[Path] = ()) -> str:
    """gpu_suite.json and gpu_suite.md into `out`; the Markdown also to `copy_to`, but only
    from a run that tested something (a run that ran no test must not replace a record)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_suite.json").write_text(json.dumps(report, indent=2) + "\n")
    md = markdown(report)
    (out / "gpu_suite.md").write_text(md)
    t = report["tests"]
    if t["passed"] + t["failed"] + t["error"]:
        for dest in copy_to:
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(out / "gpu_suite.md", dest)
    return md


def cli(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(prog="bench/gpu_report.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("env", help="print the versions of what the suite runs on, as JSON")
    r = sub.add_parser("markdown", help="print the Markdown summary of a gpu_suite.json")
    r.add_argument("json", help="a gpu_suite.json")
    args = ap.parse_args(argv)
    if args.cmd == "env":
        print(json.dumps(collect_env(), indent=2))
        return 0
    sys.stdout.write(markdown(json.loads(Path(args.json).read_text())))
    return 0


if __name__ == "__main__":
    raise SystemExit(cli(sys.argv[1:]))
