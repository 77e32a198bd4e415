"""bench/gpu_report.py: what bench/gpu_suite.sh's summary says, from a sample run.

The sample is real where it can be here: the JUnit XML comes from an actual pytest run
of a small module (pass, fail, skip); the measurements are the dicts the GPU tests
record through `summarize`; the GPU rows are nvidia-smi's CSV format."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from bench import gpu_report
from bench.gpu_report import build, cli, markdown, parse_gpus, parse_junit, summarize

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
    }


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


def test_summary_tables_and_the_target_met(tmp_path: Path) -> None:
    report = build(parse_junit(junit_of(tmp_path, PASSING)), measurements(1.2), parse_gpus(GPUS_CSV), ENV, 0)
    assert report["ok"] is True
    assert report["target"] == {
        "what": "shim overhead on the training loop",
        "max_pct": 2.0,
        "measured_pct": pytest.approx(1.2),
        "pass": True,
    }
    md = markdown(report)
    assert "## Result: PASS" in md
    assert "2 passed, 0 failed, 0 errors, 0 skipped." in md
    assert "| 0 | NVIDIA H100 80GB HBM3 | 570.86.15 | 81,559 MiB |" in md
    assert "CUDA driver API 12.8" in md and "PyTorch 2.7.1+cu126 (CUDA 12.6)" in md
    assert "training loop under 2 %: **PASS** (+1.20 %)." in md
    # Median per iteration in µs, without and with the shim, and the overhead.
    assert "| training loop: tiny MLP, Adam, random data (per step) | 3 | 300.00 | 303.60 | +1.20 % |" in md
    alloc_row = "| cuMemAlloc/cuMemFree pairs of varied sizes (cuda-python) (per pair) | 3 | 11.00 | 11.05 |"
    assert f"{alloc_row} +0.45 % |" in md
    assert "- **swap**: bytes = 3221225472, requester_alloc_s = 4.2" in md
    assert "| `test_sample::test_a` | passed |" in md


def test_target_missed_or_not_measured_and_failed_tests_fail_the_suite(tmp_path: Path) -> None:
    passing = parse_junit(junit_of(tmp_path, PASSING))
    missed = build(passing, measurements(2.5), [], ENV, 0)
    assert missed["ok"] is True and missed["target"]["pass"] is False  # a measurement, not a test failure
    assert "training loop under 2 %: **FAIL** (+2.50 %)." in markdown(missed)
    none = build(passing, {}, [], ENV, 0)
    assert none["target"]["pass"] is None and "**not measured**" in markdown(none)
    failed = build(parse_junit(junit_of(tmp_path, MIXED)), measurements(0.5), [], ENV, 1)
    assert failed["ok"] is False and "## Result: FAIL" in markdown(failed)
    assert "| `test_sample::test_bad` | failed |" in markdown(failed)
    # A run where everything skipped (no GPU found) tested nothing: not a pass.
    skipped = parse_junit(junit_of(tmp_path, "import pytest\ndef test_x(): pytest.skip('no GPU')\n"))
    assert build(skipped, {}, [], ENV, 0)["ok"] is False


def test_render_writes_json_markdown_and_the_docs_copy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    work = tmp_path / "work"
    (work / "measurements").mkdir(parents=True)
    (work / "junit.xml").write_text(junit_of(tmp_path, PASSING))
    (work / "gpus.csv").write_text(GPUS_CSV)
    (work / "env.json").write_text(json.dumps(ENV))
    for name, m in measurements(0.8).items():
        (work / "measurements" / f"{name}.json").write_text(json.dumps(m))
    out_json, out_md, doc = (
        tmp_path / "r" / "gpu_suite.json",
        tmp_path / "r" / "gpu_suite.md",
        tmp_path / "d" / "g.md",
    )
    args = ["render", str(work), "--json", str(out_json), "--markdown", str(out_md), "--copy", str(doc)]
    assert cli([*args, "--pytest-rc", "0"]) == 0
    report = json.loads(out_json.read_text())
    assert report["ok"] and report["target"]["pass"] is True
    assert set(report["measurements"]) == {"train", "cuda-alloc", "swap"}
    assert report["gpus"][1]["uuid"] == "GPU-2222" and report["env"]["cuda_driver_api"] == 12080
    assert doc.read_text() == out_md.read_text() == capsys.readouterr().out
    # pytest's own failure status fails the suite even if the XML were incomplete.
    assert cli([*args, "--pytest-rc", "1"]) == 1
    # Nothing ran: the recorded docs are not replaced.
    doc.write_text("recorded results\n")
    (work / "junit.xml").write_text(
        junit_of(tmp_path, "import pytest\ndef test_x(): pytest.skip('no GPU')\n")
    )
    assert cli([*args, "--pytest-rc", "0"]) == 1
    assert doc.read_text() == "recorded results\n"


def test_no_main_so_make_bench_does_not_run_it() -> None:
    # `python -m bench` runs every bench module that has a main(); this one needs a GPU run.
    assert not hasattr(gpu_report, "main")
