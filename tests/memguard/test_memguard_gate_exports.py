"""memguard: a gate trampoline under every name the CUDA driver exports (mg_gate.c).

The list of names is generated from NVIDIA's headers (tools/driver_names.py); it must be what
the installed headers give, cover every function simgpu's driver exports, and the built shim
must export each name: its hook where it hooks it, else a trampoline, each in its own 32-byte
cell in the list's order (the trampolines find their slot by that layout).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from gpufrac.core import native
from gpufrac.memguard import build

ROOT = native.REPO_ROOT
HEADER = ROOT / "gpufrac" / "memguard" / "native" / "mg_driver_names.h"


def listed() -> list[str]:
    return re.findall(r"^\s*X\((cu\w+)\)", HEADER.read_text(), re.M)


def exports(lib: Path) -> dict[str, tuple[str, int]]:
    """A library's defined dynamic cu* symbols: name -> (nm type, address)."""
    out = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True, check=True)
    rows = [ln.split() for ln in out.stdout.splitlines()]
    return {r[2]: (r[1], int(r[0], 16)) for r in rows if len(r) == 3 and r[2].startswith("cu")}


def test_the_list_is_what_the_headers_give() -> None:
    p = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "driver_names.py"), "--check"], capture_output=True, text=True
    )
    if p.returncode == 2:
        pytest.skip(p.stderr.strip())
    assert p.returncode == 0, p.stderr


def test_every_function_of_the_simulated_driver_is_listed() -> None:
    names = set(listed())
    fake = exports(native.library(native.FAKE_CUDA))
    assert fake and not set(fake) - names, sorted(set(fake) - names)


@pytest.mark.parametrize("flavour", ["release", "asan"])
def test_the_shim_exports_a_gate_for_every_listed_name(flavour: str) -> None:
    names = listed()
    shim = exports(build.shim_path(flavour))
    missing = [n for n in names if n not in shim]
    assert not missing, missing[:10]
    hooks = [n for n in names if shim[n][0] == "T"]  # the hooks, defined strong
    assert len(hooks) > 100 and all(shim[n][0] in ("T", "W") for n in names)
    # Every trampoline sits at the start of the list's cell for its name, 32 bytes each.
    gates = [(i, shim[n][1]) for i, n in enumerate(names) if shim[n][0] == "W"]
    base = gates[0][1] - 32 * gates[0][0]
    assert all(addr == base + 32 * i for i, addr in gates)
