"""What a hostile tenant does from inside its own container, for the tests of tests/security/.

A container controls its processes, its memory and its own usage file (mounted read-write
so that every process of it can charge it): the helpers here do exactly that and no more,
on nodes from tests/e2e_support.py (the real agent, real shim, real workload processes in
real cgroups on the simulated GPU).
"""

from __future__ import annotations

import os
import subprocess
import threading
from pathlib import Path
from typing import Any

from e2e_support import TIMEOUT, MiB, PodRun

from gpufrac.core.units import format_bytes
from gpufrac.memguard import abi
from gpufrac.simgpu.runtime import _ENTER
from gpufrac.simgpu.workload import WorkloadProcess

ALLOWANCE = 16 * MiB  # the watchdog's tolerance on these nodes: one context allowance per container


def agent_config(**extra: Any) -> dict[str, Any]:
    """Agent overrides for the attack tests: a small context allowance (the simulated driver
    charges no context), the watchdog scanning often."""
    wd = {"tolerance": format_bytes(ALLOWANCE), "interval": "200ms", **extra.pop("watchdog", {})}
    return {"watchdog": wd, **extra}


def exec_in(pod: PodRun, *, shim: bool = True, name: str = "extra") -> WorkloadProcess:
    """Another workload process in `pod`'s container (its cgroup, its environment), as
    `kubectl exec` or a fork would start one; without the shim when `shim` is False."""
    env = dict(pod.container.env)
    if not shim:
        env.pop("LD_PRELOAD", None)
    proc = subprocess.Popen(
        ["/bin/sh", "-c", _ENTER, "sh", *WorkloadProcess.argv()],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    # The container runtime reaps its processes: a killed one must not linger as a zombie here.
    threading.Thread(target=proc.wait, name=f"reap-{name}", daemon=True).start()
    return WorkloadProcess(proc, name, TIMEOUT)


def zero_usage(host_dir: Path) -> None:
    """Zero the container's usage counters, as any of its processes can."""
    u = abi.UsageFile(host_dir)
    try:
        u.usage.total_used = 0
        for i in range(abi.MAX_PROCS):
            u.usage.slots[i].used_bytes = 0
    finally:
        u.close()


def write_total(host_dir: Path, value: int) -> None:
    """Write any value into the container's usage total."""
    u = abi.UsageFile(host_dir)
    try:
        u.usage.total_used = value
    finally:
        u.close()


def break_magic(host_dir: Path) -> None:
    """Overwrite the usage file's magic, as any of the container's processes can: from then
    on the agent cannot read the file at all."""
    fd = os.open(os.path.join(host_dir, abi.USAGE_FILE), os.O_WRONLY)
    try:
        os.pwrite(fd, b"\0\0\0\0", 0)
    finally:
        os.close(fd)


def agent_alive(node: Any) -> bool:
    return node.sim.agent.proc.poll() is None
