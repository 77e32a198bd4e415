"""gpufrac benchmarks: `python -m bench` (make bench) writes bench/results/*.json.

Quick mode (`python -m bench --quick`, run by `make test`): every benchmark runs at
tiny sizes, only to prove it still produces its figures; its numbers mean nothing.
A benchmark reads the mode with `quick()` and writes where `results_dir()` says.
"""

from __future__ import annotations

import os
from pathlib import Path

QUICK_ENV = "GPUFRAC_BENCH_QUICK"
RESULTS_ENV = "GPUFRAC_BENCH_RESULTS"
DEFAULT_RESULTS = Path(__file__).resolve().parent / "results"


def quick() -> bool:
    """True when the benchmark should run at tiny sizes (a smoke run, not a measurement)."""
    return os.environ.get(QUICK_ENV) == "1"


def results_dir() -> Path:
    """Where this run's JSON goes: bench/results/, or the directory `--results` named."""
    return Path(os.environ.get(RESULTS_ENV) or DEFAULT_RESULTS)
