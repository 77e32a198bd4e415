"""Where the compiled native parts live: the memguard shim and simgpu's fake
driver libraries.

A source checkout builds them with `make native` into build/native (and
`make native-asan` into build/asan, with AddressSanitizer and UBSan). An image
installs them elsewhere and says so with $GPUFRAC_NATIVE_DIR.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

# The checkout holding the gpufrac package (whichever of its modules this file is).
REPO_ROOT = next(p for p in Path(__file__).resolve().parents if p.name == "gpufrac").parent
FLAVOURS = {"release": "build/native", "asan": "build/asan"}

SHIM = "libmemguard.so"
FAKE_NVML = "libnvidia-ml.so.1"
FAKE_CUDA = "libcuda.so.1"


class NativeMissing(FileNotFoundError):
    """A native library has not been built or installed."""


def native_dir(flavour: str = "release") -> Path:
    if flavour == "release" and os.environ.get("GPUFRAC_NATIVE_DIR"):
        return Path(os.environ["GPUFRAC_NATIVE_DIR"])
    return REPO_ROOT / FLAVOURS[flavour]


def library(name: str, flavour: str = "release") -> Path:
    """Absolute path of a built native library, building it in a checkout if needed."""
    path = native_dir(flavour) / name
    if path.exists():
        return path
    if (REPO_ROOT / "Makefile").exists() and "GPUFRAC_NATIVE_DIR" not in os.environ:
        target = "native" if flavour == "release" else "native-asan"
        subprocess.run(["make", "-s", "-C", str(REPO_ROOT), target], check=True)
        if path.exists():
            return path
    raise NativeMissing(f"{name} not found in {path.parent}: run `make native` (or set GPUFRAC_NATIVE_DIR)")


def asan_runtime() -> list[str]:
    """Sanitizer runtimes that must come first in LD_PRELOAD when an ASan build is
    loaded into an uninstrumented program (python, a plain C binary)."""
    out = []
    for lib in ("libasan.so", "libubsan.so"):
        r = subprocess.run(["cc", f"-print-file-name={lib}"], capture_output=True, text=True, check=False)
        p = r.stdout.strip()
        if r.returncode == 0 and os.path.isabs(p) and os.path.exists(p):
            out.append(os.path.realpath(p))
    return out
