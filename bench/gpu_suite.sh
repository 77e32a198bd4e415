#!/usr/bin/env bash
# The real-GPU suite in one command (bench/README.md): self-checks, then tests/gpu and the
# simgpu benches in groups, each bounded by its own timeouts, writing into --out ($OUT, else
# bench/results/): gpu_suite.json, gpu_suite.md (also copied to docs/gpu-results.md when tests
# ran) and gpu_suite.log. The work is bench/gpu_suite.py; this picks the interpreter.
#
# On a lent GPU machine (Python 3.12 with PyTorch and friends, no package registry), after
# bench/gpu_prepare.sh here, the device call is:
#   command:   PYTHONUNBUFFERED=1 bash bench/gpu_suite.sh --out "$OUT"
#   carry:     build/native, .whl and build/proto (the generated protos; gpu_prepare.sh prints the list)
#   timeout_s: 480
# It uses python3 as it is: no venv, no pip from a registry.
#
# On an ordinary GPU node with a registry: bash bench/gpu_suite.sh --setup (make setup: the
# venv, the native build, the protos; PyTorch, transformers and CuPy into the venv if missing).
#
# Interpreter: $GPUFRAC_PYTHON, else .venv/bin/python if there is one (--setup makes it),
# else python3. Other arguments go to bench/gpu_suite.py (--help lists them).
# Exit status: 0 every group passed; 1 a self-check or group failed; 2 no GPU.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

die() {
  printf 'gpu_suite: error: %s\n' "$*" >&2
  exit 2
}

args=()
setup=0
for a in "$@"; do
  if [ "$a" = --setup ]; then setup=1; else args+=("$a"); fi
done

if [ "$setup" = 1 ]; then
  make -s setup || die "make setup failed (it needs a package registry; on a lent machine leave --setup out)"
  if ! .venv/bin/python -c 'import torch' >/dev/null 2>&1; then
    printf '== gpu_suite: installing PyTorch into the venv\n' >&2
    .venv/bin/python -m pip install -q torch || die "PyTorch is missing and pip could not install it"
  fi
  # transformers (the frameworks group) and CuPy for PyTorch's CUDA major version (context).
  major=$(.venv/bin/python -c 'import torch; print((torch.version.cuda or "").split(".")[0])')
  for pkg in transformers "cupy-cuda${major}x"; do
    mod=${pkg%%-*}
    if [ -n "$major" ] && ! .venv/bin/python -c "import $mod" >/dev/null 2>&1; then
      printf '== gpu_suite: installing %s into the venv\n' "$pkg" >&2
      .venv/bin/python -m pip install -q "$pkg" || die "pip could not install $pkg"
    fi
  done
fi

if [ -n "${GPUFRAC_PYTHON:-}" ]; then
  PY=$GPUFRAC_PYTHON
elif [ -x .venv/bin/python ]; then
  PY=.venv/bin/python
else
  PY=python3
fi
command -v "$PY" >/dev/null 2>&1 || die "no Python interpreter ($PY); set GPUFRAC_PYTHON"
exec "$PY" bench/gpu_suite.py "${args[@]+"${args[@]}"}"
