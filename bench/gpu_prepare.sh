#!/usr/bin/env bash
# Prepares, on this (x86-64) machine, everything the GPU suite's device call carries, checks
# it against the lent machine's limits, and prints the call to make (bench/README.md):
#   build/native             the shim and simgpu's fake driver (make native: the Makefile's flags),
#                            with the digest of the sources it was built from (.gpufrac-sources)
#   build/proto              the generated protos (make proto, only when missing or stale),
#                            copied into one folder: the suite puts them back in gpufrac/proto
#   .whl/                    wheels (CPython 3.12, manylinux x86-64) of kubernetes and kmock
#                            and what they need, for the resolver tests; fetched only when the
#                            pinned set does not resolve from .whl already
# A second run with nothing changed needs no registry (PIP_NO_INDEX=1 works), nor the venv.
# Exit status 0 when the call is ready; 1 with the reason otherwise.
# PYTHON names the interpreter for the steps in Python (default python3; stdlib and pip only).
set -euo pipefail
cd "$(dirname "$0")/.." || exit 1
PY=${PYTHON:-python3}
say() { printf '== gpu_prepare: %s\n' "$*"; }
die() {
  printf 'gpu_prepare: error: %s\n' "$*" >&2
  exit 1
}

[ "$(uname -m)" = x86_64 ] || die "this machine is $(uname -m): the lent GPU machine is x86-64; prepare on x86-64"
command -v "$PY" >/dev/null || die "no $PY (set PYTHON=/path/to/python3)"

say "native build (make native)"
make -s native || die "make native failed"
"$PY" bench/gpu_call.py stamp

# The protos: make proto needs the venv (grpcio-tools); skip it when they are up to date.
stale=0
for p in gpufrac/proto/*.proto; do
  b=${p%.proto}
  for g in "${b}_pb2.py" "${b}_pb2_grpc.py"; do
    [ -f "$g" ] && [ "$g" -nt "$p" ] || stale=1
  done
done
if [ "$stale" = 1 ]; then
  say "protos (make proto)"
  make -s proto || die "make proto failed (it needs the venv: make setup)"
else
  say "protos up to date"
fi
say "$("$PY" bench/gpu_call.py pack-protos)"

pins=$("$PY" -c 'import sys; sys.path.insert(0, "bench"); import gpu_call; print(" ".join(gpu_call.KUBE_PINS))')
wheel_args=$("$PY" -c 'import sys; sys.path.insert(0, "bench"); import gpu_call as g
print(" ".join(["--only-binary=:all:", "--python-version", g.WHEEL_PYTHON, "--implementation", "cp"]
               + [a for p in g.WHEEL_PLATFORMS for a in ("--platform", p)]))')
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# shellcheck disable=SC2086 # word splitting of the argument lists is meant
if [ -d .whl ] && "$PY" -m pip download -q --no-index --find-links .whl $wheel_args -d "$tmp/check" $pins \
  >/dev/null 2>&1; then
  say "wheels in .whl resolve offline: $pins"
else
  say "fetching wheels into .whl: $pins and what they need"
  # shellcheck disable=SC2086
  "$PY" -m pip download -q $wheel_args -d "$tmp/whl" $pins ||
    die "pip could not fetch the wheels (no registry?): run this once where pip reaches one"
  rm -rf .whl && mv "$tmp/whl" .whl
fi

say "the call against the machine's limits"
"$PY" bench/gpu_call.py check || die "the call is not ready (above)"
echo
"$PY" bench/gpu_call.py show
