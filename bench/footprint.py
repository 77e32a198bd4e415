"""The agent's CPU on an idle node full of containers: what compute shares add to it.

Writes bench/results/footprint.json (quick mode: tiny counts, a smoke run; see bench/__init__.py).
Two simulated dgx-h100 nodes side by side, each with its own kubelet emulator and its own agent
(the default config, but for `compute.enabled`), each holding CONTAINERS containers admitted
through the device plugin (3 % of a GPU each, gpu-fraction, spread over the 8 GPUs); no
container runs anything. Both agents are measured over the same IDLE_SECONDS, so whatever else
the shared box runs weighs on both alike:

  agent_cpu_per_s_compute_on / _off   each agent's CPU time (user + system, all its threads) per
                                      second of the window: a fraction of one core
  idle_cpu_ratio_on_off               the first over the second: what compute shares cost an idle
                                      node, as a ratio within one run
  compute_added_cpu_per_s             the difference (a fraction of one core)
  load_average                        the box's 1-minute load average when the window ended
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import quick
from gpufrac.core.slices import FRACTION, MEMORY
from gpufrac.simgpu.kubelet import AgentProcess, Container, KubeletEmulator, Pod
from gpufrac.simgpu.spec import create_node, load_preset

CONTAINERS = 200
SETTLE_S = 5.0  # after the last admission, before the window: start-up work done
IDLE_SECONDS = 20.0
if quick():
    CONTAINERS, SETTLE_S, IDLE_SECONDS = 4, 0.2, 0.5


def _cpu_seconds(pid: int) -> float:
    """A process's user + system CPU time so far (/proc/<pid>/stat, fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class _Node:
    """One simulated node: its kubelet emulator and its agent."""

    def __init__(self, root: Path, compute: bool) -> None:
        root.mkdir()
        state = root / "node.state"
        create_node(load_preset("dgx-h100"), state)
        self.kubelet = KubeletEmulator(root / "kubelet").start()
        # The default config (AgentProcess's 50 ms health poll for tests put back to the default).
        self.agent = AgentProcess(
            root / "agent",
            state,
            root / "kubelet",
            {"health": {"pollInterval": "1s"}, "compute": {"enabled": compute}},
            reconcile_interval=5.0,
        ).start()

    def fill(self, n: int) -> None:
        k = self.kubelet
        k.wait_for(lambda: k.connected(FRACTION) and k.connected(MEMORY), 120)
        for i in range(n):
            # 3 % of a GPU each: 200 share the eight GPUs with room to spare
            k.admit(Pod("bench", f"idle-{i}", [Container("main", {FRACTION: 3})]))

    def close(self) -> None:
        self.agent.stop()
        self.kubelet.stop()


def main() -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="gfbf", dir="/tmp"))  # unix socket paths stay short
    nodes: dict[str, _Node] = {}
    try:
        for label, compute in (("on", True), ("off", False)):
            nodes[label] = _Node(root / label, compute)
        for node in nodes.values():
            node.fill(CONTAINERS)
        held = {label: len(n.agent.container_dirs()) for label, n in nodes.items()}
        time.sleep(SETTLE_S)
        t0 = time.monotonic()
        cpu0 = {label: _cpu_seconds(n.agent.pid) for label, n in nodes.items()}
        time.sleep(IDLE_SECONDS)
        cpu1 = {label: _cpu_seconds(n.agent.pid) for label, n in nodes.items()}
        window = time.monotonic() - t0
        load = os.getloadavg()[0]
    finally:
        for node in nodes.values():
            node.close()
        shutil.rmtree(root, ignore_errors=True)
    per_s = {label: (cpu1[label] - cpu0[label]) / window for label in cpu0}
    result: dict[str, Any] = {
        "containers": CONTAINERS,
        "containers_held": held,
        "idle_seconds": round(window, 2),
        "agent_cpu_per_s_compute_on": round(per_s["on"], 4),
        "agent_cpu_per_s_compute_off": round(per_s["off"], 4),
        # The CPU clock ticks at 100 Hz: an agent nearly idle over a short window may read 0.
        "idle_cpu_ratio_on_off": round(per_s["on"] / max(per_s["off"], 0.01 / window), 2),
        "compute_added_cpu_per_s": round(per_s["on"] - per_s["off"], 4),
        "load_average": round(load, 2),
        "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} CPUs",
        "quick": quick(),
    }
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
