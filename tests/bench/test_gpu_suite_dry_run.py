"""bench/gpu_suite.sh on a machine without a GPU and without a package registry: it runs its
self-checks, says there is no GPU and exits 2, within seconds, and leaves a report that
says so. This is the dry run of the lent GPU machine's call (bench/README.md): the same
command, offline, so a lucky draw of a GPU is not lost to a setup step.

What the self-checks prove runs for real: the carried shim build and protos, the imports
and the collection of the kube-free groups with kubernetes and kmock unimportable, the
wheels (or kubernetes and kmock installed). Only "packages" depends on this interpreter
(the dev venv has no PyTorch): it must pass exactly when the packages are there."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench import gpu_suite

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
CHECKS = [
    "python",
    "packages",
    "native build",
    "protos",
    "imports without kubernetes",
    "tests collect without kubernetes",
    "wheels for the resolvers group",
    "C compiler",
]


def offline_env(out: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k != "OUT"}
    env.update(
        GPUFRAC_PYTHON=sys.executable,
        PIP_NO_INDEX="1",
        PIP_CONFIG_FILE=os.devnull,
        # Anything that still tried the network would meet a closed port at once.
        http_proxy="http://127.0.0.1:9",
        https_proxy="http://127.0.0.1:9",
        OUT=str(out),
    )
    return env


def test_no_gpu_no_registry_self_checks_then_exit_2(tmp_path: Path) -> None:
    if shutil.which("nvidia-smi"):
        pytest.skip("a GPU node: the suite would run for real (bench/gpu_suite.sh)")
    docs = REPO / "docs" / "gpu-results.md"
    recorded = docs.read_text() if docs.exists() else None
    out = tmp_path / "out"
    r = subprocess.run(
        ["bash", str(REPO / "bench" / "gpu_suite.sh")],
        cwd=tmp_path,  # the script finds the checkout itself
        env=offline_env(out),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert r.returncode == 2, r.stdout + r.stderr
    assert "gpu_suite: no NVIDIA GPU here (nvidia-smi is not installed" in r.stderr, r.stderr
    report = json.loads((out / "gpu_suite.json").read_text())
    assert report["verdict"] == "NO GPU" and report["groups"] == [] and report["tests"]["passed"] == 0
    checks = {c["name"]: c for c in report["selfchecks"]}
    assert list(checks) == CHECKS
    have = all(importlib.util.find_spec(m) is not None for m in gpu_suite.REQUIRED)
    assert checks["packages"]["ok"] is have, checks["packages"]
    failed = {n: c["detail"] for n, c in checks.items() if not c["ok"] and n != "packages"}
    assert not failed, failed
    assert (
        "tests of 7 modules collect with kubernetes and kmock unimportable"
        in checks["tests collect without kubernetes"]["detail"]
    )
    assert "## Result: NO GPU" in (out / "gpu_suite.md").read_text()
    assert "self-check native build: ok" in (out / "gpu_suite.log").read_text()
    # A run that measured nothing leaves the recorded results alone.
    assert (docs.read_text() if docs.exists() else None) == recorded
