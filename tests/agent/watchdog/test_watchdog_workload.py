"""The watchdog against a real CUDA program that bypasses the shim, end to end.

Each pod's container is gpufrac.simgpu.workload (cuda-python over the fake libcuda) in a
real cgroup, started from the kubelet emulator's Allocate response (tests.fixtures.e2e) but
WITHOUT the LD_PRELOAD that response asks for: the memguard shim never loads, so the
driver hands out whatever the GPU has, past the container's limit. Only NVML sees it;
the real agent (a subprocess) with its watchdog in enforce or report mode must act.

One 1 GiB GPU (960 MiB allocatable, 64 MiB units). Every workload holds an 8-byte result
buffer (RESULT_BYTES), so NVML shows a process's buffers + 8 bytes.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import pytest

from gpufrac.agent.kube.events import REASON_LIMIT_ENFORCED, REASON_OVER_LIMIT
from gpufrac.core import native
from gpufrac.core.units import format_bytes
from gpufrac.simgpu.runtime import Container
from gpufrac.simgpu.workload import RESULT_BYTES
from tests.fixtures.e2e import E2ENode, MiB, PodRun
from tests.fixtures.polling import until

MakeNode = Callable[..., E2ENode]
LIMIT = 256 * MiB
TOLERANCE = 64 * MiB  # small, so that a few hundred MiB past the limit is a breach


def watchdog(mode: str) -> dict[str, Any]:
    """Agent config: the watchdog in `mode`, scanning often (a short interval, not a sync)."""
    return {"watchdog": {"mode": mode, "interval": "100ms", "tolerance": format_bytes(TOLERANCE)}}


def mapped_libraries(pid: int) -> set[str]:
    """File names of the shared objects process `pid` has mapped."""
    with open(f"/proc/{pid}/maps") as f:
        return {line.split()[-1].rsplit("/", 1)[-1] for line in f if "/" in line}


def run_shimless_pod(node: E2ENode, monkeypatch: pytest.MonkeyPatch, name: str, units: int) -> PodRun:
    """node.run_pod (limit LIMIT), but the container starts without the LD_PRELOAD its
    Allocate response gives: a program that bypasses the shim (as a static binary would)."""
    start = node.runtime.start

    def start_without_shim(*args: Any, envs: Mapping[str, str] | None = None, **kw: Any) -> Container:
        return start(*args, envs={k: v for k, v in (envs or {}).items() if k != "LD_PRELOAD"}, **kw)

    with monkeypatch.context() as m:
        m.setattr(node.runtime, "start", start_without_shim)
        pod = node.run_pod(name, units, format_bytes(LIMIT))
    # A real CUDA process (the fake driver is loaded), and the shim is not.
    libs = mapped_libraries(pod.container.proc.pid)
    assert native.FAKE_CUDA in libs and native.SHIM not in libs, sorted(libs)
    return pod


def usage_in(message: str) -> str:
    """The usage an Event message names ("... uses 500.0Mi of GPU memory ...")."""
    m = re.search(r" uses (\S+) of GPU memory", message)
    assert m, message
    return m.group(1)


def test_enforce_kills_a_shimless_cuda_process_over_its_limit(
    e2e_node: MakeNode, monkeypatch: pytest.MonkeyPatch
) -> None:
    node = e2e_node(**watchdog("enforce"))
    # "ok": over its 256 MiB limit, but within limit + tolerance (320 MiB): left alone.
    near = run_shimless_pod(node, monkeypatch, "near", 2)
    assert near.alloc(300 * MiB) == "ok 1"  # no shim: nothing refused it
    hog = run_shimless_pod(node, monkeypatch, "hog", 2)
    pid = hog.container.proc.pid
    # 500 MiB past a 256 MiB limit. The watchdog may kill it before it answers; a shim would say "oom".
    assert hog.alloc(500 * MiB) in ("ok 1", "<exited>")

    until(lambda: not hog.alive(), what="the watchdog to kill the shim-less process")
    until(lambda: node.events(hog, REASON_LIMIT_ENFORCED), what="the GpuMemoryLimitEnforced Event")
    (ev,) = node.events(hog, REASON_LIMIT_ENFORCED)
    assert ev["type"] == "Warning"
    msg = ev["message"]
    assert usage_in(msg) == format_bytes(500 * MiB + RESULT_BYTES), msg
    assert f"over its limit {format_bytes(LIMIT)}" in msg and f"killed process {pid}" in msg, msg
    # The scan that killed the hog saw "near" too, above its limit but within the tolerance.
    assert near.alive() and near.app.do("check 1") == "ok"
    assert node.events(near, REASON_LIMIT_ENFORCED) == [] and node.events(near, REASON_OVER_LIMIT) == []


def test_report_mode_reports_a_shimless_cuda_process_and_lets_it_run(
    e2e_node: MakeNode, monkeypatch: pytest.MonkeyPatch
) -> None:
    node = e2e_node(**watchdog("report"))
    hog = run_shimless_pod(node, monkeypatch, "hog", 2)
    pid = hog.container.proc.pid
    assert hog.alloc(500 * MiB, 5) == "ok 1"  # no shim: nothing refused it

    until(lambda: node.events(hog, REASON_OVER_LIMIT), what="the GpuMemoryOverLimit Event")
    (ev,) = node.events(hog, REASON_OVER_LIMIT)
    assert ev["type"] == "Warning"
    msg = ev["message"]
    assert usage_in(msg) == format_bytes(500 * MiB + RESULT_BYTES), msg
    assert f"over its limit {format_bytes(LIMIT)}" in msg and f"{pid} (" in msg, msg
    assert "report mode, nothing killed" in msg, msg

    # A second offender, over only after the first was reported: the scan that reports it
    # came after, and found the first still over. Nobody is killed, nobody reported twice.
    late = run_shimless_pod(node, monkeypatch, "late", 2)
    assert late.alloc(400 * MiB) == "ok 1"
    until(lambda: node.events(late, REASON_OVER_LIMIT), what="the second GpuMemoryOverLimit Event")
    assert hog.alive() and late.alive()
    assert hog.app.do("check 1") == "ok"  # and its memory is intact
    assert node.events(hog, REASON_LIMIT_ENFORCED) == [] and node.events(late, REASON_LIMIT_ENFORCED) == []
    (again,) = node.events(hog, REASON_OVER_LIMIT)
    assert again["count"] == 1, again  # one Event per episode, not one per scan
