"""`python -m bench`: run every benchmark in bench/ that has a main().

Each module bench/<name>.py (or package bench/<name>/) with a `main()` runs in its
own process (benchmarks start agents and simulated nodes; one must not disturb
the next) and leaves bench/results/<name>.json. A main() that returns a dict has
it written there for it. `python -m bench agent` runs only the named ones.
"""

from __future__ import annotations

import importlib
import inspect
import json
import pkgutil
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"


def discover() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules([str(BENCH)]) if not m.name.startswith("_"))


def run_one(name: str) -> int:
    mod = importlib.import_module(f"bench.{name}")
    main = getattr(mod, "main", None)
    if main is None:
        return 0
    # A main(argv) must not parse this process's own arguments.
    result = main([]) if inspect.signature(main).parameters else main()
    if isinstance(result, dict):
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
        return 0
    return int(result or 0)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--one"]:
        return run_one(argv[1])
    names = argv or discover()
    failed = []
    for name in names:
        if not hasattr(importlib.import_module(f"bench.{name}"), "main"):
            continue
        print(f"== bench {name}", flush=True)
        t0 = time.monotonic()
        rc = subprocess.run([sys.executable, "-m", "bench", "--one", name], cwd=BENCH.parent).returncode
        outcome = "ok" if rc == 0 else f"FAILED (exit {rc})"
        print(f"== bench {name}: {outcome} in {time.monotonic() - t0:.1f}s")
        if rc:
            failed.append(name)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
