"""`python -m bench`: run every benchmark in bench/ that has a main().

Each module bench/<name>.py (or package bench/<name>/) with a `main()` runs in its
own process (benchmarks start agents and simulated nodes; one must not disturb
the next) and leaves bench/results/<name>.json. A main() that returns a dict has
it written there for it. `python -m bench agent` runs only the named ones.
`--quick` runs each at tiny sizes (see bench/__init__.py); `--results DIR` writes
the JSON to DIR instead of bench/results/.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import pkgutil
import subprocess
import sys
import time
from pathlib import Path

from bench import QUICK_ENV, RESULTS_ENV, results_dir

BENCH = Path(__file__).resolve().parent


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
        out = results_dir()
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
        return 0
    return int(result or 0)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--one"]:
        return run_one(argv[1])
    argv = list(argv)
    env = dict(os.environ)
    if "--quick" in argv:
        argv.remove("--quick")
        env[QUICK_ENV] = "1"
    if "--results" in argv:
        i = argv.index("--results")
        if i + 1 >= len(argv):
            print("error: --results needs a directory", file=sys.stderr)
            return 2
        env[RESULTS_ENV] = str(Path(argv[i + 1]).resolve())
        del argv[i : i + 2]
    names = argv or discover()
    failed = []
    for name in names:
        if not hasattr(importlib.import_module(f"bench.{name}"), "main"):
            continue
        print(f"== bench {name}", flush=True)
        t0 = time.monotonic()
        rc = subprocess.run(
            [sys.executable, "-m", "bench", "--one", name], cwd=BENCH.parent, env=env
        ).returncode
        outcome = "ok" if rc == 0 else f"FAILED (exit {rc})"
        print(f"== bench {name}: {outcome} in {time.monotonic() - t0:.1f}s")
        if rc:
            failed.append(name)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
