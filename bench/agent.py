"""Agent benchmark on a simulated dgx-h100: the kubelet-facing latencies and footprint.

Writes bench/results/agent.json (quick mode: tiny counts, a smoke run; see bench/__init__.py):
  allocate_p50_ms / allocate_p99_ms   GetPreferredAllocation + Allocate + PreStartContainer, per
                                      container and resource, as the kubelet emulator waits for them
                                      (the first WARMUP admissions left out: imports, first connections);
                                      admissions back to back, so agent, emulator and the agent's
                                      file thread keep this box's cores busy
  allocate_p50_ms_paced / _p99_ms_paced  the same, PACED more admit + delete cycles PACE_S apart
                                      (a busy node's rate, below what saturates the box): latency
                                      without the queueing of a saturated CPU
  floor_p50_ms / floor_p99_ms (+ _paced)  the same calls and cycles against a device plugin that
                                      does nothing (bench/_floor_plugin.py: grpc.aio on the agent's
                                      loop, as many devices as gpu-fraction's, IDs of the same shape),
                                      through the same emulator: gRPC, the Python emulator and the
                                      box, without the agent; the difference is the agent's
  agent_handler_p50_ms / _p99_ms      the same three calls, time spent inside the agent's handlers
                                      (the summary it logs when it stops; warm-up included; the worse
                                      of the two resources): the rest is gRPC, the Python kubelet
                                      emulator and whatever else the box runs
  health_propagation_ms               XID injected in the node state -> the GPU's slices Unhealthy
                                      in the kubelet's ListAndWatch view (median of several)
  reregistration_ms                   kubelet restart -> both resources registered and listed again
  agent_rss_mib, agent_cpu_percent_idle  with 64 containers allocated, steady state (psutil,
                                      IDLE_SECONDS of agent CPU time)
The agent runs its default config, except XIDs heal after 1 s (several can be measured).
Targets: p99 < 10 ms, propagation < 200 ms, RSS < 100 MiB, idle CPU < 2 %.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from bench import quick
from bench._floor_plugin import FLOOR_RESOURCE
from gpufrac.core.slices import FRACTION, MEMORY
from gpufrac.simgpu import faults
from gpufrac.simgpu.kubelet import AgentProcess, Container, KubeletEmulator, Pod
from gpufrac.simgpu.nodestate import NodeState
from gpufrac.simgpu.spec import create_node, load_preset

CONTAINERS = 64
WARMUP = 8  # first admissions, not counted: imports, first gRPC connections
CHURN = 400  # admit + delete cycles after the 64, for enough samples behind a p99
PACED = 200  # then admit + delete cycles PACE_S apart
PACE_S = 0.05
XID_SAMPLES = 5
IDLE_SETTLE_S = 5.0  # after the churn, before the idle CPU is measured
IDLE_SECONDS = 20.0
if quick():
    CONTAINERS, WARMUP, CHURN, PACED, XID_SAMPLES = 4, 1, 4, 2, 1
    IDLE_SETTLE_S, IDLE_SECONDS = 0.1, 0.5
_SUMMARY = re.compile(r"resource=(\S+) admissions=(\d+) handler_p50_ms=([0-9.]+) handler_p99_ms=([0-9.]+)")


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def _p50_p99(name: str, ms: list[float], suffix: str = "") -> dict[str, float]:
    return {
        f"{name}_p50_ms{suffix}": round(statistics.median(ms), 3),
        f"{name}_p99_ms{suffix}": round(_pct(ms, 0.99), 3),
    }


def _healthy_on(k: KubeletEmulator, uuid: str) -> int:
    return sum(1 for d in k.healthy(MEMORY) if d.startswith(uuid + "::"))


def _handler_times(log: str) -> dict[str, Any]:
    """The agent's own summary (logged as it stops) of the time inside its handlers per
    container admitted, per resource."""
    per = {
        m.group(1): (int(m.group(2)), float(m.group(3)), float(m.group(4))) for m in _SUMMARY.finditer(log)
    }
    if not per:
        return {"agent_handler_p50_ms": None, "agent_handler_p99_ms": None}
    return {
        "agent_handler_samples": sum(v[0] for v in per.values()),
        # Each the worse of the two resources (both see the same kinds of calls).
        "agent_handler_p50_ms": max(v[1] for v in per.values()),
        "agent_handler_p99_ms": max(v[2] for v in per.values()),
    }


def _cycles(
    k: KubeletEmulator, name: str, count: int, pace: float, requests: list[tuple[str, int]]
) -> list[float]:
    """Admit and delete `count` one-container pods, `pace` seconds apart, taking turns at
    `requests` (resource, amount); their admission latencies in ms."""
    before = len(k.rpc_times())
    for i in range(count):
        time.sleep(pace)
        res, n = requests[i % len(requests)]
        pod = Pod("bench", f"{name}-{i}", [Container("main", {res: n})])
        k.admit(pod)
        k.delete(pod)
    return [t * 1000 for t in k.rpc_times()[before:]]


def _floor(root: Path, k: KubeletEmulator) -> tuple[list[float], list[float]]:
    """The same cycles against bench/_floor_plugin.py: back to back, then paced."""
    log = open(root / "floor.log", "wb")  # noqa: SIM115 - the child keeps it
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench._floor_plugin", str(k.device_plugin_dir)],
        cwd=Path(__file__).resolve().parent.parent,
        stdout=log,
        stderr=log,
    )
    log.close()
    try:
        k.wait_for(lambda: k.connected(FLOOR_RESOURCE), 60)
        req = [(FLOOR_RESOURCE, 2)]
        back_to_back = _cycles(k, "floor", WARMUP + CHURN, 0.0, req)[WARMUP:]
        return back_to_back, _cycles(k, "floor-paced", PACED, PACE_S, req)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run(root: Path) -> dict[str, Any]:
    load_before = os.getloadavg()[0]  # a shared box: how busy it was before the bench began
    node_state = root / "node.state"
    create_node(load_preset("dgx-h100"), node_state)
    with NodeState(node_state) as st:
        uuids = [g.uuid.decode() for g in st.gpus]
    k = KubeletEmulator(root / "kubelet").start()
    # Default agent config (AgentProcess's 50 ms health poll for tests put back to the
    # default), except XIDs heal after 1 s so several can be measured.
    agent = AgentProcess(
        root / "agent",
        node_state,
        root / "kubelet",
        {"health": {"xidRecovery": "1s", "pollInterval": "1s"}},
        reconcile_interval=3.0,
    )
    try:
        agent.start()
        k.wait_for(lambda: k.connected(FRACTION) and k.connected(MEMORY), 120)
        for i in range(CONTAINERS):
            res, n = (FRACTION, 10) if i % 2 else (MEMORY, 4)
            k.admit(Pod("bench", f"steady-{i}", [Container("main", {res: n})]))
        fresh = [t * 1000 for t in k.rpc_times()][WARMUP:]
        both = [(MEMORY, 2), (FRACTION, 5)]
        churn = _cycles(k, "churn", CHURN, 0.0, both)
        lat = fresh + churn
        paced = _cycles(k, "paced", PACED, PACE_S, both)
        floor, floor_paced = _floor(root, k)

        # Idle footprint: 64 containers allocated, churn gone, steady state.
        proc = psutil.Process(agent.pid)
        time.sleep(IDLE_SETTLE_S)
        proc.cpu_percent(None)
        time.sleep(IDLE_SECONDS)
        cpu_idle = proc.cpu_percent(None)
        rss_mib = proc.memory_info().rss / (1 << 20)

        # XID -> ListAndWatch: the first snapshot with the GPU's slices Unhealthy.
        prop = []
        for s in range(XID_SAMPLES):
            g = 7 - (s % 4)
            k.wait_for(lambda g=g: _healthy_on(k, uuids[g]) > 0, 30, interval=0.01)
            t0 = time.perf_counter()
            faults.inject_xid(node_state, g, 79)
            k.wait_for(lambda g=g: _healthy_on(k, uuids[g]) == 0, 30, interval=0.001)
            prop.append((time.perf_counter() - t0) * 1000)

        # Kubelet restart -> registered and listing again.
        before = {r: len(k.registrations(r)) for r in (FRACTION, MEMORY)}
        t0 = time.perf_counter()
        k.restart()
        k.wait_for(
            lambda: all(len(k.registrations(r)) > before[r] and k.connected(r) for r in (FRACTION, MEMORY)),
            60,
            interval=0.005,
        )
        rereg_ms = (time.perf_counter() - t0) * 1000
    finally:
        agent.stop()
        k.stop()
    return {
        "preset": "dgx-h100",
        "containers_allocated": CONTAINERS,
        "allocate_samples": len(lat),
        **_p50_p99("allocate", lat),
        "allocate_max_ms": round(max(lat), 3),
        # The first 64 onto a fresh node vs admit/delete churn, where the kubelet hands out
        # slices of deleted pods the agent may not have released yet.
        **_p50_p99("allocate", fresh, "_fresh"),
        **_p50_p99("allocate", churn, "_churn"),
        "allocate_paced_interval_ms": PACE_S * 1000,
        **_p50_p99("allocate", paced, "_paced"),
        **_p50_p99("floor", floor),
        **_p50_p99("floor", floor_paced, "_paced"),
        **_handler_times(agent.log()),
        "health_propagation_ms": round(statistics.median(prop), 1),
        "health_propagation_max_ms": round(max(prop), 1),
        "reregistration_ms": round(rereg_ms, 1),
        "agent_rss_mib": round(rss_mib, 1),
        "agent_cpu_percent_idle": round(cpu_idle, 2),
        "host": {
            "cpus": psutil.cpu_count(),
            "python": platform.python_version(),
            "load_avg_1m_before": round(load_before, 2),
        },
    }


def main() -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="gfb", dir="/tmp"))
    try:
        result = run(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(result, indent=2))
    return result
