"""Every benchmark still runs: `python -m bench --quick` (tiny sizes, each bench in its own
process) must leave each bench's JSON with the figures it publishes. Only that the figures
are there is checked, never their values: speed targets live in the benchmarks themselves."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from numbers import Real
from pathlib import Path
from typing import Any

import pytest

from bench.packing.report import TABLE_COLUMNS
from bench.packing.strategies import default_strategies

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]

# The figures each benchmark publishes (top-level JSON keys, each a number). A new bench
# with a main() is run by `python -m bench` and must be listed here.
FIGURES: dict[str, tuple[str, ...]] = {
    "agent": (
        "allocate_p50_ms",
        "allocate_p99_ms",
        "allocate_p50_ms_paced",
        "allocate_p99_ms_paced",
        "floor_p50_ms",
        "floor_p99_ms",
        "agent_handler_p50_ms",
        "agent_handler_p99_ms",
        "health_propagation_ms",
        "reregistration_ms",
        "agent_rss_mib",
        "agent_cpu_percent_idle",
    ),
    "arbiter": (
        "burst_grant_p50_us",
        "burst_grant_p99_us",
        "burst_grant_shim_p50_us",
        "burst_grant_shim_p99_us",
        "wait_handoff_p50_ms",
        "wait_handoff_p99_ms",
        "grant_p99_us_under_flood",
        "flood_p99_ratio",
    ),
    "compute": (
        "launch_added_ns_uncontended",
        "launch_added_ns_throttled",
        "max_error_pp_strict",
        "max_error_pp_fair",
        "idle_max_error_pp",
        "converge_s_fair",
        "converge_s_strict",
        "p99_ratio_with_shares",
        "p99_ratio_without_shares",
    ),
    "dra": (
        "prepare_p50_ms",
        "prepare_p99_ms",
        "agent_handler_p50_ms",
        "agent_handler_p99_ms",
        "claim_read_p50_ms",
        "claim_read_p99_ms",
        "agent_own_p50_ms",
        "agent_own_p99_ms",
        "floor_p50_ms",
        "floor_p99_ms",
        "unprepare_p50_ms",
        "unprepare_p99_ms",
        "agent_cpu_per_prepare_ms",
    ),
    "footprint": (
        "agent_cpu_per_s_compute_on",
        "agent_cpu_per_s_compute_off",
        "idle_cpu_ratio_on_off",
        "compute_added_cpu_per_s",
    ),
    "packing": ("seed",),
    "shim": (
        "alloc_free_overhead_ns",
        "alloc_free_ratio",
        "launch_overhead_ns",
        "getinfo_overhead_ns",
        "startup_ms_per_process",
        "contention_8proc_ratio",
    ),
    "swap": ("swap_roundtrip_ms_per_gib_sim",),
}


def _results_snapshot() -> dict[str, tuple[int, int]]:
    d = REPO / "bench" / "results"
    return {p.name: (p.stat().st_mtime_ns, p.stat().st_size) for p in d.iterdir()} if d.is_dir() else {}


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """`python -m bench --quick --results DIR`, as CI runs it: all benches, one process each."""
    out = tmp_path_factory.mktemp("bench-quick")
    before = _results_snapshot()
    env = {k: v for k, v in os.environ.items() if k not in ("SIMGPU_STATE", "LD_PRELOAD")}
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--results", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    outcomes = dict(re.findall(r"^== bench (\S+): (ok|FAILED \(exit -?\d+\))", proc.stdout, re.M))
    return {
        "dir": out,
        "rc": proc.returncode,
        "outcomes": outcomes,
        "log": (proc.stdout + proc.stderr)[-6000:],
        "results_before": before,
        "results_after": _results_snapshot(),
    }


def _json(run: dict[str, Any], name: str) -> dict[str, Any]:
    assert run["outcomes"].get(name) == "ok", f"bench {name}: {run['outcomes'].get(name)}\n{run['log']}"
    path = run["dir"] / f"{name}.json"
    assert path.is_file(), f"bench {name} wrote no {path.name}\n{run['log']}"
    return json.loads(path.read_text())


def test_quick_mode_runs_every_benchmark(quick_run: dict[str, Any]) -> None:
    assert quick_run["rc"] == 0, quick_run["log"]
    assert set(quick_run["outcomes"]) == set(FIGURES), (
        "python -m bench ran other benchmarks than this test knows: list the new one's figures in FIGURES"
    )


def test_quick_mode_leaves_bench_results_alone(quick_run: dict[str, Any]) -> None:
    assert quick_run["results_after"] == quick_run["results_before"]
    assert sorted(p.name for p in quick_run["dir"].iterdir()) == sorted(f"{n}.json" for n in FIGURES)


@pytest.mark.parametrize("name", sorted(FIGURES))
def test_benchmark_publishes_its_figures(quick_run: dict[str, Any], name: str) -> None:
    data = _json(quick_run, name)
    missing = [k for k in FIGURES[name] if k not in data]
    assert not missing, f"bench {name}: no {missing} in {sorted(data)}"
    not_numbers = {
        k: data[k] for k in FIGURES[name] if not isinstance(data[k], Real) or isinstance(data[k], bool)
    }
    assert not not_numbers, f"bench {name}: figures that are not numbers: {not_numbers}"


def test_arbiter_bursts_reach_the_arbiter(quick_run: dict[str, Any]) -> None:
    """The burst figures are the arbiter's only if its bursts were granted by it rather than
    served on the shim's fast path (a grant not yet released). The shim's driver pauses past
    the grant's settle time; one burst on a stalled loop may still find its grant there."""
    samples = _json(quick_run, "arbiter")["samples"]
    assert samples["bursts"] > 0 and samples["handoffs"] > 0
    assert 2 * samples["shim_bursts_granted_by_arbiter"] > samples["shim_bursts"] > 0


def test_packing_reports_every_strategy(quick_run: dict[str, Any]) -> None:
    data = _json(quick_run, "packing")
    names = {s.name for s in default_strategies()}
    assert set(data["strategies"]) == names
    for name, result in data["strategies"].items():
        missing = [k for k, _ in TABLE_COLUMNS if k not in result]
        assert not missing, f"packing: strategy {name} lacks {missing}"
    assert set(data["sensitivity"]["strategies"]) == names
