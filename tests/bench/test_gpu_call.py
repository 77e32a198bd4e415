"""bench/gpu_call.py: the one device call that runs the GPU suite, quoted where people read it,
within the lent machine's limits, and its carry weighed as the device tool weighs it."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from bench import gpu_call

REPO = Path(__file__).resolve().parents[2]


def test_the_call_is_quoted_exactly_where_people_read_it() -> None:
    readme = (REPO / "bench" / "README.md").read_text()
    assert f"command:   {gpu_call.COMMAND}\n" in readme
    assert f"carry:     {json.dumps(gpu_call.carry())}\n" in readme
    assert f"timeout_s: {gpu_call.TIMEOUT_S}\n" in readme
    header = (REPO / "bench" / "gpu_suite.sh").read_text().split("set -uo pipefail")[0]
    assert f"#   command:   {gpu_call.COMMAND}\n" in header
    assert f"#   timeout_s: {gpu_call.TIMEOUT_S}\n" in header
    assert gpu_call.show().startswith("device call")
    assert f"  command:   {gpu_call.COMMAND}\n" in gpu_call.show()


def test_the_call_fits_the_machine() -> None:
    assert len(gpu_call.COMMAND) <= gpu_call.COMMAND_LIMIT
    assert gpu_call.proto_files(), "no generated protos: make proto"
    assert len(gpu_call.carry()) <= gpu_call.CARRY_LIMIT
    # The suite stops in time to report before the call's timeout, inside the 8 minutes.
    assert gpu_call.SUITE_BUDGET_S + 20 <= gpu_call.TIMEOUT_S <= 8 * 60


def repo_with(tmp_path: Path) -> Path:
    """A git checkout: 1000 bytes tracked, the carried paths ignored, one untracked file."""
    root = tmp_path / "r"
    (root / "gpufrac" / "proto").mkdir(parents=True)
    (root / ".gitignore").write_text("build/\n/.whl/\ngpufrac/proto/*_pb2*.py\n")
    (root / "tracked.txt").write_bytes(b"x" * (1000 - len((root / ".gitignore").read_text())))
    (root / "notes.txt").write_bytes(b"y" * 500)  # untracked, not ignored: it travels too
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    subprocess.run(["git", "-C", str(root), "add", ".gitignore", "tracked.txt"], check=True)
    (root / "build" / "native").mkdir(parents=True)
    (root / "build" / "native" / "libmemguard.so").write_bytes(b"\0" * 3000)
    (root / "build" / "other").mkdir()
    (root / "build" / "other" / "big").write_bytes(b"\0" * 99999)  # ignored and not carried
    (root / ".whl").mkdir()
    (root / ".whl" / "a.whl").write_bytes(b"\0" * 2000)
    (root / "gpufrac" / "proto" / "x_pb2.py").write_bytes(b"\0" * 100)
    assert gpu_call.pack_protos(root) == 1  # what gpu_prepare.sh does
    for entry in gpu_call.NATIVE_SOURCES:
        src = REPO / entry
        dst = root / entry
        if src.is_file():
            shutil.copyfile(src, dst)
        else:
            shutil.copytree(src, dst)
    gpu_call.write_stamp(root)
    return root


def test_the_carry_is_weighed_with_the_tree_that_travels(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = repo_with(tmp_path)
    r = gpu_call.check(root)
    assert r["carry"] == ["build/native", ".whl", "build/proto"]
    assert r["carry_bytes"]["build/native"] == 3000 + len((root / gpu_call.STAMP).read_bytes())
    assert r["carry_bytes"][".whl"] == 2000
    assert r["carry_bytes"]["build/proto"] == 100
    entries = [root / e for e in gpu_call.NATIVE_SOURCES]
    sources = sum(p.stat().st_size for e in entries for p in [e, *e.rglob("*")] if p.is_file())
    assert r["tree_bytes"] == 1000 + 500 + sources  # the copied sources are untracked, not ignored
    assert r["total_bytes"] == r["tree_bytes"] + sum(r["carry_bytes"].values())
    assert r["ok"], r["problems"]
    monkeypatch.setattr(gpu_call, "CARRY_BYTES", r["total_bytes"] - 1)
    over = gpu_call.check(root)
    assert not over["ok"] and any("over the limit" in p for p in over["problems"])


def test_a_missing_carry_or_a_stale_build_is_refused(tmp_path: Path) -> None:
    root = repo_with(tmp_path)
    shutil.rmtree(root / ".whl")
    assert gpu_call.check(root)["problems"] == ["missing (run bench/gpu_prepare.sh): .whl"]
    (root / ".whl").mkdir()
    assert gpu_call.stamp_matches(root) is True
    c_file = next((root / "gpufrac" / "memguard" / "native").glob("mg_alloc.c"))
    c_file.write_text(c_file.read_text() + "\n/* changed */\n")
    assert gpu_call.stamp_matches(root) is False
    problems = gpu_call.check(root)["problems"]
    assert problems == ["build/native was not built from these sources (bench/gpu_prepare.sh rebuilds it)"]


def test_the_carried_protos_are_put_back_where_the_suite_imports_them(tmp_path: Path) -> None:
    """The device's copy of the tree has no generated protos (git ignores them): the suite puts
    the carried ones back, leaving any that are there alone."""
    root = repo_with(tmp_path)
    (root / "gpufrac" / "proto" / "x_pb2.py").unlink()
    assert gpu_call.restore_protos(root) == 1
    assert (root / "gpufrac" / "proto" / "x_pb2.py").read_bytes() == b"\0" * 100
    assert gpu_call.restore_protos(root) == 0
