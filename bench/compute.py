"""Compute shares on the simulated node: `python -m bench compute` -> bench/results/compute.json.

Containers share one simulated GPU (bench/_compute_node.py: the agent's compute loop in this
process, the containers real processes in real cgroups under the real shim, the fake driver's
compute model time-slicing the GPU between them, docs/simgpu.md). Every container runs kernels
flat out (busy_us kernels of KERNEL_US, DEPTH in flight) unless said otherwise. What each got is
the compute model's own figure (its processes' busy time on the GPU), not the controller's.

* shares.<strict|fair>.<a/b/...>: shares 10/90, 30/70, 25/25/50, 10/20/30/40, every container
  busy: what each got over WINDOW_S once settled, and `max_error_pp`, the largest gap to its share
  in percentage points (target: 3). `max_error_pp_strict` / `_fair`: the worst over the sets.
  `gpu_busy`: what they got together; under 1 where the loaded host left the GPU idle (the
  processes could not launch fast enough), which no share can make up.
* idle.<a/b/...>: fair mode, the first container goes idle: what the others got, against their
  shares scaled up in proportion to fill the GPU (`idle_max_error_pp`).
* converge_s_<fair|strict>: from all containers starting together (fair 10/90, strict 30/70) to
  the moment every one stays within 3 points of its share (target: under 1 s; -1: not within
  CONVERGE_LIMIT_S).
* launch_added_ns_uncontended / _throttled: the shim's whole cost per cuLaunchKernel over the
  driver's own, within one process (bench/shim_bench.c ablaunchx), its pace 0 (what every launch
  pays, the compute share's one load among the rest: target under 20 ns) and 1 ns (the paced
  path's own work: the clock's slot taken, no wait).
* latency: with shares 50/50, a container of 2 ms kernels one at a time 10 ms apart (an inference
  server) while its neighbour runs 20 ms kernels flat out from one process, or from 3 (its
  processes are its own contexts, each with its own time slices): the p99 of its kernels' time on
  the GPU (events around each), alone, beside the neighbour without compute shares, and with them.
  `p99_ratio_*` is that over alone (target: within 2x).
* no_control.<a/b>: 30/70 without the compute loop: what time slicing alone gives (one each).
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import quick

SHARE_SETS: tuple[tuple[int, ...], ...] = ((10, 90), (30, 70), (25, 25, 50), (10, 20, 30, 40))
# 32 ms queued per container: a loaded host's gaps between launches rarely idle the GPU
KERNEL_US, DEPTH = 4000, 8
TARGET_PP = 3.0
if quick():  # a smoke run: every figure produced, none meaningful
    SHARE_SETS = ((30, 70),)
    SETTLE_S, WINDOW_S, CONVERGE_LIMIT_S, LAT_N = 0.5, 0.5, 3.0, 5
    AB_ROUNDS, AB_N, AB_PROCS = 20, 200, 1
else:
    SETTLE_S, WINDOW_S, CONVERGE_LIMIT_S, LAT_N = 2.0, 3.0, 10.0, 400
    AB_ROUNDS, AB_N, AB_PROCS = 400, 2000, 7


def _names(shares: tuple[int, ...]) -> list[str]:
    return [f"c{i}_{s}" for i, s in enumerate(shares)]


def _spin(members: list[Any], us: int = KERNEL_US, depth: int = DEPTH) -> None:
    for m in members:
        m.do(f"spin {us} {depth} 1 launch")


def _stop(members: list[Any]) -> None:
    for m in members:
        m.do("stop")


def _err_pp(got: dict[str, float], want: dict[str, float]) -> float:
    return round(max(abs(got[k] - want[k]) * 100 for k in want), 2)


def share_sets() -> dict[str, Any]:
    from bench._compute_node import ComputeNode

    out: dict[str, Any] = {"strict": {}, "fair": {}, "idle": {}}
    for shares in SHARE_SETS:
        label = "/".join(map(str, shares))
        node = ComputeNode(mode="strict")
        try:
            members = [node.add(n, s) for n, s in zip(_names(shares), shares, strict=True)]
            want = {m.name: s / 100 for m, s in zip(members, shares, strict=True)}
            for mode in ("strict", "fair"):
                node.cfg.compute.mode = mode
                _spin(members)
                time.sleep(SETTLE_S)
                got = node.shares(WINDOW_S)
                out[mode][label] = {
                    "got": {k: round(v, 4) for k, v in got.items()},
                    "gpu_busy": round(sum(got.values()), 4),  # under 1: the host left the GPU idle
                    "max_error_pp": _err_pp(got, want),
                }
                if mode == "fair":  # the first goes idle: its share to the others, in proportion
                    _stop(members[:1])
                    time.sleep(SETTLE_S)
                    busy = members[1:]
                    got = node.shares(WINDOW_S, busy)
                    total = sum(want[m.name] for m in busy)
                    scaled = {m.name: want[m.name] / total for m in busy}
                    out["idle"][label] = {
                        "idle": members[0].name,
                        "got": {k: round(v, 4) for k, v in got.items()},
                        "gpu_busy": round(sum(got.values()), 4),
                        "want": {k: round(v, 4) for k, v in scaled.items()},
                        "max_error_pp": _err_pp(got, scaled),
                    }
                    _stop(busy)
                else:
                    _stop(members)
                time.sleep(0.5)  # paces lift (the containers are idle)
        finally:
            node.close()
    return out


def converge(mode: str, shares: tuple[int, ...] = (10, 90)) -> float:
    """Seconds from every container starting together until each stays within TARGET_PP of its
    share (windows of 200 ms, read from the compute model, for 0.6 s in a row: a window holds a
    hundred kernels, so one more or less is a point)."""
    from bench._compute_node import ComputeNode

    node = ComputeNode(mode=mode)
    try:
        members = [node.add(n, s) for n, s in zip(_names(shares), shares, strict=True)]
        want = {m.name: s / 100 for m, s in zip(members, shares, strict=True)}
        for m in members:
            m.app.send(f"spin {KERNEL_US} {DEPTH} 1 launch")  # all at once; answers read below
        t0 = time.monotonic()
        for m in members:
            m.app.line(120)
        good_since: float | None = None
        prev, tp = node.busy(), time.monotonic()
        while time.monotonic() - t0 < CONVERGE_LIMIT_S:
            time.sleep(0.2)
            cur, tc = node.busy(), time.monotonic()
            got = {k: (cur[k] - prev[k]) / ((tc - tp) * 1e9) for k in cur}
            prev, tp = cur, tc
            if _err_pp(got, want) <= TARGET_PP:
                good_since = tp - 0.2 if good_since is None else good_since
                if tc - good_since >= 0.6:
                    _stop(members)
                    return round(good_since - t0, 3)
            else:
                good_since = None
        _stop(members)
        return -1.0  # not within CONVERGE_LIMIT_S
    finally:
        node.close()


def latency() -> dict[str, Any]:
    """The short-kernel container's p99 alone, beside a flat-out neighbour without compute shares,
    and with them (50/50), the neighbour as one process and as three."""
    from bench._compute_node import ComputeNode

    out: dict[str, Any] = {}

    def p99(m: Any, tag: str) -> float:
        line = m.do(f"lat 2000 {LAT_N} 10", timeout=600)
        out[f"p50_ms_{tag}"] = float(re.search(r"p50=([\d.]+)", line).group(1))  # type: ignore[union-attr]
        return float(re.search(r"p99=([\d.]+)", line).group(1))  # type: ignore[union-attr]

    for control in (False, True):
        node = ComputeNode(mode="fair", control=control)
        try:
            short, long_ = node.add("short", 50), node.add("long", 50)
            if control:
                out["alone_p99_ms"] = p99(short, "alone")
            tag = "with_shares" if control else "without_shares"
            for procs in (1, 3):
                if procs == 1:
                    long_.do("spin 20000 2 1 launch")
                else:
                    long_.do("procs 3 20000 2")
                time.sleep(1.0)
                out[f"p99_ms_{tag}_{procs}proc"] = p99(short, f"{tag}_{procs}proc")
                long_.do("stop")
                time.sleep(0.5)
        finally:
            node.close()
    for tag in ("with_shares", "without_shares"):
        for procs in (1, 3):
            out[f"p99_ratio_{tag}_{procs}proc"] = round(
                out[f"p99_ms_{tag}_{procs}proc"] / out["alone_p99_ms"], 2
            )
    return out


def no_control() -> dict[str, float]:
    from bench._compute_node import ComputeNode

    node = ComputeNode(control=False)
    try:
        members = [node.add(n, s) for n, s in zip(_names((30, 70)), (30, 70), strict=True)]
        _spin(members)
        time.sleep(SETTLE_S / 2)
        got = node.shares(WINDOW_S)
        _stop(members)
        return {k: round(v, 4) for k, v in got.items()}
    finally:
        node.close()


def launch_cost() -> dict[str, float]:
    """The shim's cost per launch over the driver's own, in one process (shim_bench ablaunchx: a
    launch the driver refuses at once, so its microsecond of simulated scheduling does not drown
    the hook's nanoseconds): the median over AB_PROCS processes, its pace 0 and 1 ns."""
    from bench.shim import build_driver
    from gpufrac.core import native
    from gpufrac.memguard import abi
    from gpufrac.memguard import build as mg_build
    from gpufrac.simgpu.spec import create_node, load_preset

    driver = build_driver()
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="gfcl", dir="/tmp") as tmp:
        work = Path(tmp)
        create_node(load_preset("dgx-h100"), work / "node.state")
        cdir = work / "ctr"
        cdir.mkdir()
        cfg = abi.ConfigFile(cdir)
        cfg.write(abi.ContainerConfig(gpu_uuid="", request_bytes=64 << 30, limit_bytes=64 << 30))
        abi.create_usage(cdir)
        abi.create_compute(cdir)
        base = {
            **os.environ,
            "SIMGPU_STATE": str(work / "node.state"),
            "LD_LIBRARY_PATH": str(native.native_dir()),
        }
        env = mg_build.shim_env(cdir, "release", base)
        diffs: dict[str, list[float]] = {"uncontended": [], "throttled": []}
        for _ in range(AB_PROCS):
            for label, pace in (("uncontended", 0), ("throttled", 1)):
                cfg.set_pace(pace)
                p = subprocess.run(
                    [str(driver), "ablaunchx", str(AB_ROUNDS), str(AB_N)],
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=600,
                    check=True,
                )
                m = re.search(r"diff_ns=(-?[\d.]+)", p.stdout)
                assert m, p.stdout + p.stderr
                diffs[label].append(float(m.group(1)))
        cfg.close()
        for label, values in diffs.items():
            out[f"launch_added_ns_{label}"] = round(statistics.median(values), 2)
    return out


def main() -> dict[str, Any]:
    t0 = time.monotonic()
    result: dict[str, Any] = {"target_error_pp": TARGET_PP}
    result.update(launch_cost())
    sets = share_sets()
    result["shares"] = {"strict": sets["strict"], "fair": sets["fair"]}
    result["idle"] = sets["idle"]
    for mode in ("strict", "fair"):
        result[f"max_error_pp_{mode}"] = max(v["max_error_pp"] for v in sets[mode].values())
    result["idle_max_error_pp"] = max(v["max_error_pp"] for v in sets["idle"].values())
    result["converge_s_fair"] = converge("fair")
    result["converge_s_strict"] = converge("strict", (30, 70))
    result["no_control"] = no_control()
    lat = result["latency"] = latency()
    result["p99_ratio_with_shares"] = lat.get("p99_ratio_with_shares_3proc", -1.0)
    result["p99_ratio_without_shares"] = lat.get("p99_ratio_without_shares_3proc", -1.0)
    result["notes"] = {
        "machine": f"{os.cpu_count()} CPUs, shared; simulated GPU: dgx-h100 GPU 0, 2 ms time slice",
        "took_s": round(time.monotonic() - t0, 1),
        "quick": quick(),
    }
    return result
