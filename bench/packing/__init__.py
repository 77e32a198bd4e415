"""Capacity study: one synthetic day on an 8-GPU node, replayed against whole GPUs,
time-slicing, static fractions and gpufrac (docs/capacity-study.md).

`python -m bench.packing` (or `python -m bench`, which calls main()) writes
bench/results/packing.json; `--docs` also regenerates the table and plot in docs/.
In quick mode (bench/__init__.py) the day is a small one: 2 GPUs, 4 hours, 2 seeds.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from bench import quick, results_dir

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "capacity-study.md"
PLOT = ROOT / "docs" / "capacity-study.png"


def main(argv: list[str] | None = None) -> int:
    from bench.packing import report

    ap = argparse.ArgumentParser(prog="python -m bench.packing", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=7, help="trace seed (default 7)")
    ap.add_argument("--sensitivity-seeds", type=int, default=5, help="seeds for the spread table (1 = off)")
    ap.add_argument("--out", type=Path, default=results_dir() / "packing.json", help="JSON result path")
    ap.add_argument("--docs", action="store_true", help=f"also rewrite the table in {DOC.name} and the plot")
    # None means defaults (not sys.argv): `python -m bench` calls main() with its own argv.
    args = ap.parse_args([] if argv is None else argv)
    if args.sensitivity_seeds < 1:
        ap.error(f"--sensitivity-seeds: {args.sensitivity_seeds} must be at least 1")

    if quick():
        if args.docs:
            ap.error("--docs: a quick run is no study; run without --quick")
        data = report.run_study(args.seed, min(args.sensitivity_seeds, 2), trace_kwargs=_quick_day())
    else:
        data = report.run_study(args.seed, args.sensitivity_seeds)
    report.write_json(data, args.out)
    print(report.markdown_table(data))
    print(f"\nwrote {args.out}")
    if args.docs:
        report.update_doc(DOC, data)
        report.plot(data, PLOT)
        print(f"wrote {DOC} and {PLOT}")
    return 0


def _quick_day() -> dict[str, Any]:
    """A small, contended day for quick mode: the study's mix on 2 GPUs over 4 hours."""
    from bench.packing.trace import HOUR_S, Node

    return {
        "horizon_s": 4 * HOUR_S,
        "node": Node(gpus=2),
        "always_on_inference": 3,
        "daytime_inference": 5,
        "notebooks": 14,
        "batch_jobs": 10,
    }
