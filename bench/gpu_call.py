"""The one call that runs the GPU suite on a lent GPU machine, in one place.

A lent machine (bench/README.md, "On a lent GPU machine") takes a working tree, up to
CARRY_LIMIT ignored paths carried with it (CARRY_BYTES in all, the tree included) and one
command of at most COMMAND_LIMIT characters; it has Python 3.12 and the packages
DEVICE_PACKAGES, and reaches no package registry. bench/gpu_prepare.sh builds what the
call carries, checks it against these limits (`python bench/gpu_call.py check`) and prints
the call (`python bench/gpu_call.py show`); bench/README.md and bench/gpu_suite.sh's header
quote it, and tests/bench/test_gpu_call.py keeps them equal.

No `main()`: `python -m bench` runs every bench module that has one.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

# The suite's own deadline (seconds): it stops starting work after it and writes its report.
SUITE_BUDGET_S = 450
# The device call's timeout: the suite's budget plus time for its report and the slowest
# group's interruption (bench/gpu_suite.py, GRACE_S), under the 8 minutes the issue allows.
TIMEOUT_S = 480
COMMAND = 'PYTHONUNBUFFERED=1 bash bench/gpu_suite.sh --out "$OUT"'
# The rerun a second call makes, for what the first one did not reach (see bench/README.md).
RERUN_COMMAND = 'PYTHONUNBUFFERED=1 bash bench/gpu_suite.sh --out "$OUT" --only GROUP[,GROUP...]'

COMMAND_LIMIT = 2000
CARRY_LIMIT = 8
CARRY_BYTES = 64 << 20

# Ignored paths the suite needs that the machine cannot build: the shim and simgpu's fake
# driver (make native, the Makefile's flags), the generated protos (grpcio-tools is not
# there) and the wheels of what the resolver tests need and the machine lacks.
NATIVE = "build/native"
WHEELS = ".whl"
PROTO_GLOBS = ("gpufrac/proto/*_pb2.py", "gpufrac/proto/*_pb2_grpc.py")
# The generated protos travel as one carried folder (the kubelet's APIs give a dozen files, and
# a call carries at most CARRY_LIMIT paths): gpu_prepare.sh copies them here, the suite puts
# them back into gpufrac/proto before its checks (restore_protos).
PROTO_CARRY = "build/proto"
# Pinned to what the project's own tests run with (kmock is the apiserver emulator).
KUBE_PINS = ("kubernetes==37.0.2", "kmock==0.8")
WHEEL_PYTHON = "3.12"
WHEEL_PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux_2_5_x86_64",
    "manylinux1_x86_64",
)
# What the machine has (the list; it has more, this is what the suite relies on).
DEVICE_PACKAGES = (
    "torch",
    "cupy-cuda13x",
    "transformers",
    "grpcio",
    "protobuf",
    "nvidia-ml-py",
    "cuda-bindings",
    "prometheus-client",
    "psutil",
    "pyyaml",
    "uvloop",
    "hypothesis",
    "pytest",
    "pytest-xdist",
    "pytest-timeout",
)


# The sources of build/native: what bench/gpu_prepare.sh records it was built from
# (STAMP), and what the suite checks on the machine before trusting the carried build.
NATIVE_SOURCES = ("Makefile", "gpufrac/memguard/native", "gpufrac/simgpu/native")
STAMP = "build/native/.gpufrac-sources"


def sources_digest(root: Path = ROOT) -> str:
    """sha256 over the native build's inputs (the Makefile, with its flags, and the C sources)."""
    h = hashlib.sha256()
    for entry in NATIVE_SOURCES:
        base = root / entry
        files = [base] if base.is_file() else sorted(p for p in base.rglob("*") if p.is_file())
        for f in files:
            if f.suffix in (".pyc",) or "__pycache__" in f.parts:
                continue
            h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def write_stamp(root: Path = ROOT) -> None:
    (root / STAMP).write_text(sources_digest(root) + "\n")


def stamp_matches(root: Path = ROOT) -> bool | None:
    """Was build/native built from the sources here? None when no stamp was written."""
    f = root / STAMP
    if not f.exists():
        return None
    return f.read_text().strip() == sources_digest(root)


def proto_files(root: Path = ROOT) -> list[str]:
    return sorted(str(p.relative_to(root)) for g in PROTO_GLOBS for p in root.glob(g))


def carry(root: Path = ROOT) -> list[str]:
    """The paths the call carries: the shim's build, the wheels, the generated protos."""
    return [NATIVE, WHEELS, PROTO_CARRY]


def pack_protos(root: Path = ROOT) -> int:
    """Copy the generated protos into PROTO_CARRY (afresh); how many."""
    dest = root / PROTO_CARRY
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    files = proto_files(root)
    for f in files:
        shutil.copy2(root / f, dest / Path(f).name)
    return len(files)


def restore_protos(root: Path = ROOT) -> int:
    """Put the carried protos back into gpufrac/proto where they are missing; how many."""
    src = root / PROTO_CARRY
    n = 0
    for f in sorted(src.glob("*_pb2*.py")) if src.is_dir() else []:
        target = root / "gpufrac" / "proto" / f.name
        if not target.exists():
            shutil.copy2(f, target)
            n += 1
    return n


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def tree_bytes(root: Path = ROOT) -> int:
    """What travels besides the carry: tracked files and untracked ones git does not ignore."""
    r = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        capture_output=True,
        check=True,
    )
    files = {f for f in r.stdout.decode().split("\0") if f and not f.startswith("shared/")}
    shared = root / "shared"  # travels whole, whether git ignores it or not
    return sum((root / f).stat().st_size for f in files if (root / f).is_file()) + (
        _size(shared) if shared.is_dir() else 0
    )


def check(root: Path = ROOT) -> dict[str, Any]:
    """The call against the machine's limits: what is missing, what it weighs, what is over."""
    paths = carry(root)
    missing = [p for p in paths if not (root / p).exists()]
    sizes = {p: _size(root / p) for p in paths if p not in missing}
    tree = tree_bytes(root)
    total = tree + sum(sizes.values())
    problems = []
    if missing:
        problems.append(f"missing (run bench/gpu_prepare.sh): {', '.join(missing)}")
    if not proto_files(root):
        problems.append("no generated protos in gpufrac/proto (make proto)")
    if not missing and not stamp_matches(root):
        problems.append(f"{NATIVE} was not built from these sources (bench/gpu_prepare.sh rebuilds it)")
    if len(paths) > CARRY_LIMIT:
        problems.append(f"{len(paths)} carry paths, over the limit of {CARRY_LIMIT}")
    if total > CARRY_BYTES:
        problems.append(f"{total} bytes travel, over the limit of {CARRY_BYTES}")
    if len(COMMAND) > COMMAND_LIMIT:
        problems.append(f"the command has {len(COMMAND)} characters, over {COMMAND_LIMIT}")
    return {
        "ok": not problems,
        "problems": problems,
        "carry": paths,
        "carry_bytes": sizes,
        "tree_bytes": tree,
        "total_bytes": total,
        "limit_bytes": CARRY_BYTES,
        "command": COMMAND,
        "timeout_s": TIMEOUT_S,
    }


def show(root: Path = ROOT) -> str:
    """The device call, as the device tool takes it."""
    return (
        "device call (the run tool; kind left out, or nvidia-h100-x1):\n"
        f"  command:   {COMMAND}\n"
        f"  carry:     {json.dumps(carry(root))}\n"
        f"  timeout_s: {TIMEOUT_S}\n"
        "a rerun of groups it did not reach or that failed (their names are in gpu_suite.md):\n"
        f"  command:   {RERUN_COMMAND}\n"
    )


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def cli(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(prog="bench/gpu_call.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("show", help="print the device call")
    sub.add_parser("check", help="check the carry against the machine's limits; exit 1 if over or missing")
    sub.add_parser("json", help="print the check as JSON")
    sub.add_parser("stamp", help=f"record in {STAMP} the sources build/native was built from")
    sub.add_parser("pack-protos", help=f"copy the generated protos into {PROTO_CARRY} (carried)")
    args = ap.parse_args(argv)
    if args.cmd == "stamp":
        write_stamp()
        return 0
    if args.cmd == "pack-protos":
        print(f"{pack_protos()} generated protos in {PROTO_CARRY}")
        return 0
    if args.cmd == "show":
        sys.stdout.write(show())
        return 0
    result = check()
    if args.cmd == "json":
        print(json.dumps(result, indent=2))
        return 0 if result["ok"] else 1
    for p, n in result["carry_bytes"].items():
        print(f"  carry {p}: {_mib(n)}")
    print(
        f"  working tree {_mib(result['tree_bytes'])}; in all {_mib(result['total_bytes'])} of "
        f"{_mib(result['limit_bytes'])}; {len(result['carry'])} of {CARRY_LIMIT} carry paths; "
        f"command {len(COMMAND)} of {COMMAND_LIMIT} characters"
    )
    for problem in result["problems"]:
        print(f"error: {problem}", file=sys.stderr)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(cli(sys.argv[1:]))
