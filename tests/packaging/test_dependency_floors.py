"""gpufrac at the lowest dependency versions pyproject.toml declares.

`make floors` (a prerequisite of `make test`) builds build/floors-venv with every runtime
dependency pinned to its declared floor (tests/fixtures/dependency_floors.py). Here that venv imports
every gpufrac module and runs the real agent on a simulated node: a floor that does not work
fails, instead of surfacing on a user's machine.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from gpufrac.core.native import REPO_ROOT
from tests.fixtures import dependency_floors

pytestmark = pytest.mark.tools

VENV = REPO_ROOT / "build" / "floors-venv"
PYTHON = VENV / "bin" / "python"


def _run(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    if not (VENV / ".installed").exists():
        pytest.fail(f"{VENV} is missing: run `make floors` (make test does)")
    # The checkout itself on the path, the floors venv's site-packages and nothing of .venv's.
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    env.pop("VIRTUAL_ENV", None)
    return subprocess.run(
        [str(PYTHON), str(REPO_ROOT / "tests" / "fixtures" / "dependency_floors.py"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO_ROOT,
        env=env,
    )


def _installed() -> dict[str, str]:
    out = subprocess.run(
        [str(PYTHON), "-m", "pip", "list", "--format=freeze", "--disable-pip-version-check"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    pairs = (ln.split("==") for ln in out.stdout.splitlines() if "==" in ln)
    return {name.lower().replace("_", "-"): version for name, version in pairs}


def _canon(version: str) -> tuple[int, ...]:
    parts = [int(p) for p in version.split(".")]
    while parts and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


def test_the_floors_venv_holds_exactly_the_declared_floors() -> None:
    # A stale venv (pyproject.toml changed since) would prove nothing; make rebuilds it, this checks it.
    if not (VENV / ".installed").exists():
        pytest.fail(f"{VENV} is missing: run `make floors` (make test does)")
    installed = _installed()
    for pin in dependency_floors.pins():
        name, version = pin.split(";")[0].split("==")
        assert _canon(installed[name.lower()]) == _canon(version), (
            f"{name}: {installed[name.lower()]} != {version}"
        )
    # The metapackage is not what gpufrac depends on: only cuda.bindings is used.
    assert "cuda-python" not in installed


def test_every_module_imports_at_the_floors() -> None:
    out = _run("import-all")
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.search(r"imported \d+ modules", out.stdout)


def test_the_agent_serves_a_simulated_node_at_the_floors() -> None:
    out = _run("smoke")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "a CUDA workload allocated" in out.stdout


def test_floors_cover_the_generated_protobuf_code() -> None:
    # The generated modules name the versions they need; the declared floors must reach them.
    floors = {p.split("==")[0]: p.split("==")[1].split(";")[0] for p in dependency_floors.pins()}
    proto = REPO_ROOT / "gpufrac" / "proto"
    for pb2 in proto.glob("*_pb2.py"):
        gencode = re.search(r"^# Protobuf Python Version: (\S+)$", pb2.read_text(), re.M).group(1)
        assert _canon(floors["protobuf"]) >= _canon(gencode), f"{pb2.name} needs protobuf>={gencode}"
    for grpc_py in proto.glob("*_pb2_grpc.py"):
        generated = re.search(r"^GRPC_GENERATED_VERSION = '(\S+)'$", grpc_py.read_text(), re.M).group(1)
        assert _canon(floors["grpcio"]) >= _canon(generated), f"{grpc_py.name} needs grpcio>={generated}"


def test_pins_refuse_a_dependency_without_a_floor(tmp_path: Path) -> None:
    bad = tmp_path / "pyproject.toml"
    bad.write_text('[project]\ndependencies = ["grpcio>=1.85.1", "psutil"]\n')
    with pytest.raises(SystemExit, match="psutil"):
        dependency_floors.pins(bad)
