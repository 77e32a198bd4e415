"""Compute shares on a real GPU (docs/compute.md): the scenarios of tests/agent/compute/
test_compute_shares.py and bench/compute.py with real kernels. PyTorch processes (workloads/
compute_spin.py: matmuls flat out, plain or as CUDA graphs) under the real shim in real cgroups,
the agent's compute loop in this process reading the real NVML's per-process utilisation
(bench/_compute_node.py, real_gpu=True).

A container's share is measured as users measure it: its throughput (matmuls a second) beside
its neighbours over its throughput alone. Margins are wide (6 points): this run is where the
simulator's guesses meet the hardware (NVML's sampling, the time slice), and its figures are
recorded for bench/gpu_suite.sh (compute_gpu.json) whatever the asserts say.
"""
# ruff: noqa: F811 - pytest fixtures imported from gpu_support are parameters here

from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from gpu_support import Gpu, assert_real_driver_in_process, gpu, record  # noqa: F401

from bench._compute_node import ComputeNode, Member

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.timeout(1800)]

SPIN = Path(__file__).resolve().parent / "workloads" / "compute_spin.py"
KERNEL_US, DEPTH = 2000, 4
SETTLE_S, WINDOW_S = 3.0, 5.0
MARGIN = 0.06
results: dict[str, Any] = {}


@pytest.fixture
def make_node(real_env: dict[str, str], gpu: Gpu) -> Iterator[Callable[..., ComputeNode]]:
    assert_real_driver_in_process()
    made: list[ComputeNode] = []

    def make(mode: str) -> ComputeNode:
        node = ComputeNode(mode, real_gpu=True, argv=[sys.executable, str(SPIN)], env=real_env)
        made.append(node)
        return node

    yield make
    for n in made:
        n.close()
    record("compute_gpu", results)


def rate(m: Member, seconds: float, kind: str = "launch", threads: int = 1) -> float:
    """Matmuls a second `m` runs over `seconds` (after SETTLE_S to settle)."""
    m.do(f"spin {KERNEL_US} {DEPTH} {threads} {kind}")
    time.sleep(SETTLE_S)
    m.do("stop")  # the settling part, dropped
    m.do(f"spin {KERNEL_US} {DEPTH} {threads} {kind}")
    time.sleep(seconds)
    done, took = _launches(m.do("stop"))
    return done / took


def rates_together(
    members: list[Member], kinds: dict[str, tuple[str, int]] | None = None
) -> dict[str, float]:
    kinds = kinds or {}
    for m in members:
        kind, threads = kinds.get(m.name, ("launch", 1))
        m.do(f"spin {KERNEL_US} {DEPTH} {threads} {kind}")
    time.sleep(SETTLE_S)
    for m in members:
        m.do("stop")
    for m in members:
        kind, threads = kinds.get(m.name, ("launch", 1))
        m.do(f"spin {KERNEL_US} {DEPTH} {threads} {kind}")
    time.sleep(WINDOW_S)
    out = {}
    for m in members:
        done, took = _launches(m.do("stop"))
        out[m.name] = done / took
    return out


def _launches(line: str) -> tuple[int, float]:
    m = re.search(r"launches=(\d+) seconds=([\d.]+)", line)
    assert m, line
    return int(m.group(1)), float(m.group(2))


@pytest.mark.parametrize("mode", ["strict", "fair"])
def test_shares_held_with_real_kernels(make_node: Callable[..., ComputeNode], mode: str) -> None:
    node = make_node("fair")  # the baselines: each alone, at full speed
    small, big = node.add("small", 30), node.add("big", 70)
    alone = {m.name: rate(m, WINDOW_S) for m in (small, big)}
    node.cfg.compute.mode = mode
    entry: dict[str, Any] = {"alone_per_s": alone}
    if mode == "strict":  # a cap, even alone
        entry["small_alone_capped"] = rate(small, WINDOW_S) / alone["small"]
    together = rates_together([small, big])
    share = {k: together[k] / alone[k] for k in together}
    entry.update(together_per_s=together, share=share)
    results[f"shares_{mode}_30_70"] = entry
    assert abs(share["small"] - 0.30) <= MARGIN and share["big"] >= 0.70 - MARGIN, share
    if mode == "strict":
        assert entry["small_alone_capped"] <= 0.30 + MARGIN, entry


def test_fair_idle_share_goes_to_the_busy(make_node: Callable[..., ComputeNode]) -> None:
    node = make_node("fair")
    busy, _idle = node.add("busy", 30), node.add("idle", 70)
    alone = rate(busy, WINDOW_S)
    results["fair_idle"] = {"alone_per_s": alone, "paced": node.figures(busy).pace_ns > 0}
    # its neighbour idle, the 30 % container is never held back
    assert node.figures(busy).pace_ns == 0


def test_every_launch_path_is_held(make_node: Callable[..., ComputeNode]) -> None:
    """Strict 30/70: six threads of plain kernels and CUDA graphs at once, held to 30 % together."""
    node = make_node("fair")
    small, big = node.add("small", 30), node.add("big", 70)
    alone = {"small": rate(small, WINDOW_S, "launch,graph", 6), "big": rate(big, WINDOW_S)}
    node.cfg.compute.mode = "strict"
    together = rates_together([small, big], {"small": ("launch,graph", 6)})
    share = {k: together[k] / alone[k] for k in together}
    results["paths_strict_30_70"] = {"alone_per_s": alone, "share": share}
    assert abs(share["small"] - 0.30) <= MARGIN, share


def test_a_container_of_three_processes_is_held_to_half(make_node: Callable[..., ComputeNode]) -> None:
    node = make_node("fair")
    one, many = node.add("one", 50), node.add("many", 50)
    alone = rate(one, WINDOW_S)
    many.do(f"procs 3 {KERNEL_US} {DEPTH}")
    beside = rate(one, WINDOW_S)
    many.do("stop")
    results["three_processes_50_50"] = {"one_alone_per_s": alone, "one_beside_per_s": beside}
    assert beside / alone >= 0.5 - MARGIN


def test_short_kernels_beside_a_flat_out_neighbour(make_node: Callable[..., ComputeNode]) -> None:
    """50/50: the p99 of a short kernel, alone and beside a neighbour of long kernels flat out
    (recorded: the driver's time slice sets it, docs/compute.md "Latency")."""
    node = make_node("fair")
    short, long_ = node.add("short", 50), node.add("long", 50)

    def p99(line: str) -> float:
        return float(re.search(r"p99=([\d.]+)", line).group(1))  # type: ignore[union-attr]

    alone = p99(short.do("lat 500 400 5", timeout=600))
    long_.do("spin 20000 2 1 launch")
    time.sleep(SETTLE_S)
    beside = p99(short.do("lat 500 400 5", timeout=600))
    long_.do("stop")
    results["latency"] = {"alone_p99_ms": alone, "beside_p99_ms": beside, "ratio": beside / alone}
    assert beside > 0
