#!/usr/bin/env bash
# The real-GPU suite in one command, on a node with an NVIDIA GPU:
#   sets up (venv, native build, protos; PyTorch if missing), runs tests/gpu (PyTorch and
#   cuda-python under the real memguard shim, the resolvers, the shim's overhead), records
#   the GPU model and driver version, and writes
#     bench/results/gpu_suite.json   everything: tests, measurements, GPU, versions
#     bench/results/gpu_suite.md     the summary (copied to docs/gpu-results.md)
# Extra arguments go to pytest (e.g. -k overhead). GPUFRAC_BENCH_REPEATS and
# GPUFRAC_BENCH_STEPS size the overhead runs (defaults in tests/gpu).
# Exit status: 0 when the tests ran and none failed; 1 when one failed or none ran;
# 2 when the node cannot run the suite. The 2 % training-loop overhead target is
# reported PASS/FAIL in the summary.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
ROOT=$PWD
PY=$ROOT/.venv/bin/python
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_suite.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

log() { printf '== gpu_suite: %s\n' "$*" >&2; }
die() {
  printf 'gpu_suite: error: %s\n' "$*" >&2
  exit 2
}

# A real node: nothing of simgpu's fake driver in the environment (a library path
# to the real driver, as NVIDIA's container images set, is kept).
unset SIMGPU_STATE LD_PRELOAD GPUFRAC_CONTAINER_DIR
if [ -n "${LD_LIBRARY_PATH:-}" ]; then
  LD_LIBRARY_PATH=$(printf '%s\n' "$LD_LIBRARY_PATH" | tr ':' '\n' |
    grep -v -x -e "$ROOT/build/native/*" -e "$ROOT/build/asan/*" -e 'build/native/*' -e 'build/asan/*' |
    paste -sd: -)
  export LD_LIBRARY_PATH
fi
command -v nvidia-smi >/dev/null 2>&1 || die "nvidia-smi not found: this suite runs on a node with an NVIDIA GPU"
nvidia-smi --query-gpu=index,name,driver_version,memory.total,uuid --format=csv,noheader,nounits \
  >"$WORK/gpus.csv" || die "nvidia-smi cannot read the GPUs (driver not loaded?)"
[ -s "$WORK/gpus.csv" ] || die "nvidia-smi lists no GPU"
log "GPU: $(head -n1 "$WORK/gpus.csv")"

log "setup: venv, native build, protos"
make -s setup || die "make setup failed"
if ! "$PY" -c 'import torch' >/dev/null 2>&1; then
  log "installing PyTorch into the venv"
  "$PY" -m pip install -q torch ||
    die "PyTorch is missing and pip could not install it (offline?): pre-install it with $PY -m pip install torch"
fi
make -s native || die "building the shim failed"
"$PY" bench/gpu_report.py env >"$WORK/env.json" || die "collecting versions failed"

log "tests/gpu"
mkdir -p "$WORK/measurements"
GPUFRAC_GPU_RESULTS="$WORK/measurements" "$PY" -m pytest -q -p no:cacheprovider -rs \
  --junitxml="$WORK/junit.xml" tests/gpu "$@"
rc=$?

"$PY" bench/gpu_report.py render "$WORK" --pytest-rc "$rc" \
  --json bench/results/gpu_suite.json --markdown bench/results/gpu_suite.md --copy docs/gpu-results.md
report=$?
log "wrote bench/results/gpu_suite.json and bench/results/gpu_suite.md (pytest exit $rc)"
if [ "$rc" -ne 0 ]; then
  exit 1
fi
exit "$report"
