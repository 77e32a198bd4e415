"""bench/gpu_report.py: what bench/gpu_suite.sh's summary says, from a sample run.

The sample is real where it can be here: the JUnit XML comes from an actual pytest run
of a small module (pass, fail, skip); the measurements are the dicts the GPU tests
record (`summarize` for the overhead pairs); the GPU rows are nvidia-smi's CSV format."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from bench import gpu_report
from bench.gpu_report import build, markdown, parse_gpus, parse_junit, summarize, targets, write

pytestmark = pytest.mark.unit

# nvidia-smi --query-gpu=index,name,driver_version,memory.total,uuid --format=csv,noheader,nounits
GPUS_CSV = (
    "0, NVIDIA H100 80GB HBM3, 570.86.15, 81559, GPU-1111\n"
    "1, NVIDIA H100 80GB HBM3, 570.86.15, 81559, GPU-2222\n"
)
ENV = {
    "host": "gpu-node-1",
    "python": "3.11.9",
    "torch": "2.7.1+cu126",
    "torch_cuda": "12.6",
    "cuda_driver_api": 12080,
}


def junit_of(tmp_path: Path, body: str) -> str:
    """JUnit XML of a real pytest run of `body`."""
    mod = tmp_path / "test_sample.py"
    mod.write_text(textwrap.dedent(body))
    out = tmp_path / "junit.xml"
    # Outside the repo pyproject's "-p no:kmock" does not apply (kmock's plugin needs pytest-asyncio).
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:kmock",
            f"--junitxml={out}",
            str(mod),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.exists(), r.stdout + r.stderr
    return out.read_text()


# The sample run the report tool reads: one pass, one failure (a limit breached), one skip.
MIXED = """
import pytest
USED, LIMIT = 3 << 30, 2 << 30
def test_ok(): pass
def test_bad(): assert USED <= LIMIT, "limit not held"
def test_skipped(): pytest.skip("driver capability: no cuCheckpointProcess*")
"""
PASSING = """
def test_a(): pass
def test_b(): pass
"""


def measurements(train_pct: float) -> dict[str, dict]:
    """As the overhead tests record them: per-iteration seconds of interleaved runs."""
    base = 300e-6
    return {
        "train": summarize(
            "train", "s/step", [base, base * 1.01, base * 0.99], [base * (1 + train_pct / 100)] * 3
        ),
        "cuda-alloc": summarize(
            "cuda-alloc", "s/pair", [10e-6, 11e-6, 12e-6], [10.05e-6, 11.05e-6, 12.05e-6]
        ),
        "swap": {"name": "swap", "bytes": 3 << 30, "requester_alloc_s": 4.2},
        "context-cost": {
            "name": "context-cost",
            "context_mib": 498.0,
            "tolerance_mib": 256.0,
            "max_abs_nvml_minus_shim_mib": 40.0,
            "steps_under_shim": [
                {"step": "context", "nvml_process": 500.0, "shim_counted": 500.0, "nvml_minus_shim": 0.0},
                {"step": "cupy", "nvml_process": 560.0, "shim_counted": 520.0, "nvml_minus_shim": 40.0},
            ],
            "steps_plain": [{"step": "context", "nvml_process": 500.0, "beyond_allocator": 498.0}],
        },
        "swap-checkpoint": {
            "name": "swap-checkpoint",
            "out_share_of_d2h": 0.81,
            "in_share_of_h2d": 0.42,
            "target_share": 0.7,
            "out_gbps": 40.5,
            "in_gbps": 21.0,
            "pinned_d2h_gbps": 50.0,
            "pinned_h2d_gbps": 50.0,
        },
    }


def group(name: str, junit: dict | None = None, status: str = "", **kw: object) -> dict:
    """A group's record as bench/gpu_suite.py makes it."""
    g: dict = {"name": name, "what": f"the {name} group", "seconds": 12.0, **kw}
    if junit is not None:
        g["counts"] = {k: junit[k] for k in ("passed", "failed", "error", "skipped")}
        g["cases"] = junit["cases"]
        g["status"] = status or ("failed" if junit["failed"] or junit["error"] else "passed")
    else:
        g["status"] = status
    return g


CHECKS = [
    {"name": "python", "ok": True, "detail": "3.12.3"},
    {"name": "protos", "ok": True, "detail": "4 import"},
]


def test_summarize_compares_the_median_runs() -> None:
    s = summarize("train", "s/step", [1.0, 1.2, 0.9], [1.05, 9.0, 1.02])  # one disturbed shim run
    assert s["none"]["median"] == 1.0 and s["shim"]["median"] == 1.05
    assert s["overhead_pct"] == pytest.approx(5.0)
    assert s["overhead_abs"] == pytest.approx(0.05)
    assert (s["none"]["min"], s["shim"]["min"], s["runs"]) == (0.9, 1.02, 3)
    with pytest.raises(ValueError, match="train: need runs with and without the shim"):
        summarize("train", "s/step", [1.0], [])


def test_junit_outcomes_of_a_real_pytest_run(tmp_path: Path) -> None:
    j = parse_junit(junit_of(tmp_path, MIXED))
    assert (j["passed"], j["failed"], j["error"], j["skipped"]) == (1, 1, 0, 1)
    by_name = {c["name"]: c for c in j["cases"]}
    assert by_name["test_sample::test_bad"]["outcome"] == "failed"
    assert "limit not held" in by_name["test_sample::test_bad"]["message"]
    assert by_name["test_sample::test_skipped"]["message"].endswith(
        "driver capability: no cuCheckpointProcess*"
    )


def test_gpu_rows_from_nvidia_smi_csv() -> None:
    gpus = parse_gpus(GPUS_CSV + "garbage line\n")
    assert gpus == [
        {
            "index": 0,
            "name": "NVIDIA H100 80GB HBM3",
            "driver": "570.86.15",
            "memory_total_mib": 81559,
            "uuid": "GPU-1111",
        },
        {
            "index": 1,
            "name": "NVIDIA H100 80GB HBM3",
            "driver": "570.86.15",
            "memory_total_mib": 81559,
            "uuid": "GPU-2222",
        },
    ]


def report_of(tmp_path: Path, body: str, train_pct: float = 1.2, **kw: object) -> dict:
    j = parse_junit(junit_of(tmp_path, body))
    return build(
        selfchecks=kw.pop("selfchecks", CHECKS),  # type: ignore[arg-type]
        groups=[group("shim", j), *kw.pop("groups", [])],  # type: ignore[list-item]
        measurements=measurements(train_pct),
        benches=kw.pop("benches", {}),  # type: ignore[arg-type]
        gpus=parse_gpus(GPUS_CSV),
        env=ENV,
        budget_s=450,
        elapsed_s=300.0,
        **kw,  # type: ignore[arg-type]
    )


def nothing_run(no_gpu: str) -> dict:
    return build(selfchecks=CHECKS, groups=[], measurements={}, benches={}, gpus=[], env=ENV, no_gpu=no_gpu)


def test_every_goal_beside_its_measurement() -> None:
    by_id = {t["id"]: t for t in targets(measurements(1.2), {"arbiter": {"flood_p99_ratio": 2.13}})}
    assert by_id["train-overhead"]["verdict"] == "PASS" and by_id["train-overhead"]["shown"] == "+1.20 %"
    assert by_id["context-count"]["verdict"] == "PASS"  # 40 MiB apart, within 256
    assert by_id["swap-out"]["verdict"] == "PASS" and by_id["swap-in"]["verdict"] == "FAIL"  # 42 % < 70 %
    assert by_id["bench-arbiter-flood"]["verdict"] == "FAIL"
    # Not recorded: said so, never a pass.
    assert by_id["wait-wakeup"]["verdict"] == "NOT MEASURED"
    assert by_id["bench-shim"]["verdict"] == "NOT MEASURED"
    assert by_id["compute-shares"]["verdict"] == "NOT MEASURED"
    assert "have not landed" in by_id["compute-shares"]["shown"]
    missed = {t["id"]: t for t in targets(measurements(2.5), {})}
    assert missed["train-overhead"]["verdict"] == "FAIL"


def test_a_passing_run_and_its_tables(tmp_path: Path) -> None:
    report = report_of(tmp_path, PASSING)
    assert report["verdict"] == "PASS" and report["ok"] is True and report["first_failure"] is None
    md = markdown(report)
    assert "## Result: PASS" in md and "It took 300 s of its 450 s budget." in md
    assert "2 passed, 0 failed, 0 errors, 0 skipped." in md
    assert "| 0 | NVIDIA H100 80GB HBM3 | 570.86.15 | 81,559 MiB |" in md
    assert "CUDA driver API 12.8 · PyTorch 2.7.1+cu126 (CUDA 12.6)" in md
    assert "| shim overhead on a small training loop | < 2 % | +1.20 % | **PASS** |" in md
    assert "| training loop: tiny MLP, Adam, random data (per step) | 3 | 300.00 | 303.60 | +1.20 % |" in md
    alloc_row = "| cuMemAlloc/cuMemFree pairs of varied sizes (cuda-python) (per pair) | 3 | 11.00 | 11.05 |"
    assert f"{alloc_row} +0.45 % |" in md
    assert "| cupy | 560.0 | 520.0 | 40.0 |" in md  # the context-cost table
    assert "- **swap**: bytes = 3221225472, requester_alloc_s = 4.2" in md
    assert "| shim | `test_sample::test_a` | passed |" in md
    assert "| python | ok | 3.12.3 |" in md


def test_what_failed_first_and_what_to_rerun(tmp_path: Path) -> None:
    late = group("resolvers", status="timeout", error="stopped after 180s")
    unreached = group("bench-arbiter", status="not reached", error="not started: 12s left")
    report = report_of(tmp_path, MIXED, groups=[late, unreached])
    assert report["verdict"] == "FAIL" and report["ok"] is False
    assert report["first_failure"] == {
        "where": "shim: test_sample::test_bad",
        "why": "AssertionError: limit not held",
    }
    assert report["rerun"] == ["shim", "resolvers", "bench-arbiter"]
    md = markdown(report)
    assert "First failure: **shim: test_sample::test_bad**: AssertionError: limit not held" in md
    assert "`bash bench/gpu_suite.sh --only shim,resolvers,bench-arbiter`" in md
    assert "| resolvers | the resolvers group | timeout | - | 12 | stopped after 180s |" in md
    # A failed self-check comes first, before any test.
    bad = [{"name": "native build", "ok": False, "detail": "not x86-64: libmemguard.so"}, *CHECKS]
    first = report_of(tmp_path, PASSING, selfchecks=bad)
    assert first["ok"] is False
    assert first["first_failure"] == {"where": "self-check native build", "why": "not x86-64: libmemguard.so"}


def test_no_gpu_and_nothing_run_are_no_pass(tmp_path: Path) -> None:
    no_gpu = build(
        selfchecks=CHECKS,
        groups=[],
        measurements={},
        benches={},
        gpus=[],
        env=ENV,
        no_gpu="nvidia-smi is missing",
    )
    assert no_gpu["verdict"] == "NO GPU" and no_gpu["ok"] is False
    md = markdown(no_gpu)
    assert "No GPU: nvidia-smi is missing. Only the self-checks ran." in md
    bare = build(selfchecks=CHECKS, groups=[], measurements={}, benches={}, gpus=[], env={"python": "3.12"})
    assert "PyTorch" not in markdown(bare)  # not read, so not said to be missing
    assert "| - | (nvidia-smi reported no GPU) | - | - |" in md
    # Every test skipped (no GPU found by pytest): nothing was tested.
    skipped = report_of(tmp_path, "import pytest\ndef test_x(): pytest.skip('no GPU')\n")
    assert skipped["ok"] is False and skipped["verdict"] == "FAIL"


def test_write_copies_the_docs_only_from_a_run_that_tested(tmp_path: Path) -> None:
    out, doc = tmp_path / "out", tmp_path / "docs" / "gpu-results.md"
    md = write(report_of(tmp_path, PASSING), out, [doc])
    assert json.loads((out / "gpu_suite.json").read_text())["verdict"] == "PASS"
    assert (out / "gpu_suite.md").read_text() == md == doc.read_text()
    doc.write_text("recorded results\n")
    nothing = build(
        selfchecks=CHECKS, groups=[], measurements={}, benches={}, gpus=[], env=ENV, no_gpu="none"
    )
    write(nothing, out, [doc])
    assert doc.read_text() == "recorded results\n"
    assert "NO GPU" in (out / "gpu_suite.md").read_text()


def test_no_main_so_make_bench_does_not_run_it() -> None:
    # `python -m bench` runs every bench module that has a main(); these need a GPU run.
    from bench import gpu_call, gpu_suite

    assert not any(hasattr(m, "main") for m in (gpu_report, gpu_call, gpu_suite))
