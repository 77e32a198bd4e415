"""Locating the memguard shim and putting a process under it.

The library itself is built by the Makefile (gpufrac/core/native.py finds it); this
module says how a workload process must be started so the shim holds it to its
container's limits: LD_PRELOAD and GPUFRAC_CONTAINER_DIR.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from gpufrac.core import native

CONTAINER_DIR_ENV = "GPUFRAC_CONTAINER_DIR"


def shim_path(flavour: str = "release") -> Path:
    return native.library(native.SHIM, flavour)


def ctest_path(flavour: str = "release") -> Path:
    """mg_ctest: the small program linked against libcuda that tests drive."""
    return native.library("mg_ctest", flavour)


def preload(flavour: str = "release") -> str:
    """LD_PRELOAD value: the sanitizer runtimes must come first when the ASan
    build is loaded into an uninstrumented program."""
    libs = (
        [*native.asan_runtime(), str(shim_path(flavour))] if flavour == "asan" else [str(shim_path(flavour))]
    )
    return " ".join(libs)


def shim_env(
    container_dir: str | os.PathLike[str], flavour: str = "release", base: Mapping[str, str] | None = None
) -> dict[str, str]:
    """Environment for a process that runs under the shim in `container_dir`."""
    env = dict(os.environ if base is None else base)
    env["LD_PRELOAD"] = preload(flavour)
    env[CONTAINER_DIR_ENV] = str(container_dir)
    if flavour == "asan":
        # Python and friends leak on purpose at exit; the shim's own errors still abort.
        env.setdefault("ASAN_OPTIONS", "detect_leaks=0:abort_on_error=1")
        env.setdefault("UBSAN_OPTIONS", "print_stacktrace=1:halt_on_error=1")
    return env
