"""A container that can write its cgroupfs cannot pass as another pod's container.

With a writable cgroupfs (privileged, or delegated cgroup v2) a container can make cgroups
below its own, named as it likes: "pod<another pod's UID>/<its container ID>". The kubelet's
runtime makes only the outermost pod level and the container level right below it, so the
outermost pod component of the path names the caller (gpufrac.agent.processes.callers.parse_cgroup_path),
for the arbiter and the watchdog alike.

One 1 GiB GPU (64 MiB units); the real agent, real shim, real workload processes in real
cgroups (tests/fixtures/e2e.py).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpufrac.agent.kube.events import REASON_LIMIT_ENFORCED
from gpufrac.agent.processes.callers import parse_cgroup_path
from gpufrac.simgpu.runtime import cgroup_relpath
from gpufrac.simgpu.workload import WorkloadProcess
from tests.fixtures.e2e import E2ENode, MiB, PodRun
from tests.fixtures.hostile_tenant import agent_alive, agent_config, exec_in
from tests.fixtures.polling import until

pytestmark = pytest.mark.security

MakeNode = Callable[..., E2ENode]
UID_A, UID_B = "0f1e2d3c-4b5a-6978-8877-665544332211", "aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"
CID_A, CID_B = "4f" * 32, "b7" * 32


@pytest.mark.parametrize("driver", ["cgroupfs", "systemd"])
@pytest.mark.parametrize("qos", ["besteffort", "guaranteed"])
def test_a_nested_cgroup_named_after_another_pod_is_the_outer_container(driver: str, qos: str) -> None:
    outer = cgroup_relpath(UID_A, CID_A, qos, driver)
    for inner in (cgroup_relpath(UID_B, CID_B, qos, driver), f"pod{UID_B}/{CID_B}", f"x/pod{UID_B}/{CID_B}"):
        ident = parse_cgroup_path(f"/{outer}/{inner}")
        assert ident is not None and (ident.pod_uid, ident.container_id) == (UID_A, CID_A), inner


@contextlib.contextmanager
def nested_as(pod: PodRun, other: PodRun) -> Iterator[Path]:
    """A cgroup below `pod`'s container, named as `other`'s container is named (the runtime's
    cgroupfs layout); removed afterwards (its processes killed first)."""
    inner = pod.container.cgroup_dir / f"pod{other.pod.uid}" / other.container.container_id
    inner.mkdir(parents=True)
    try:
        yield inner
    finally:
        deadline = time.monotonic() + 10
        while (pids := (inner / "cgroup.procs").read_text().split()) and time.monotonic() < deadline:
            for p in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(p), signal.SIGKILL)
            time.sleep(0.02)
        inner.rmdir()
        inner.parent.rmdir()


def exec_nested(pod: PodRun, cgroup: Path, *, shim: bool, name: str) -> WorkloadProcess:
    """exec_in, but the process enters the nested cgroup instead of the container's own."""
    env = pod.container.env
    saved = env["GPUFRAC_RUNTIME_CGROUP_PROCS"]
    env["GPUFRAC_RUNTIME_CGROUP_PROCS"] = str(cgroup / "cgroup.procs")
    try:
        return exec_in(pod, shim=shim, name=name)
    finally:
        env["GPUFRAC_RUNTIME_CGROUP_PROCS"] = saved


def test_a_process_in_a_nested_cgroup_named_after_a_neighbour_is_its_own_containers(
    e2e_node: MakeNode,
) -> None:
    node = e2e_node(**agent_config())
    a = node.run_pod("a", 2, "256Mi", wait_timeout="5s")  # request 128 MiB, limit 256 MiB
    b = node.run_pod("b", 2, "640Mi")  # the neighbour it tries to pass as
    assert b.alloc(64 * MiB) == "ok 1"
    with nested_as(a, b) as cgroup:
        # The arbiter: a burst from the nested process is a's (granted within a's limit), and
        # nothing is granted to, or charged against, b.
        inner = exec_nested(a, cgroup, shim=True, name="nested")
        assert inner.do(f"alloc {200 * MiB} 1") == "ok 1"
        assert a.grant() > 0 and b.grant() == 0
        # The watchdog: memory used outside the shim from the nested cgroup is a's, over a's
        # limit (200 + 300 MiB > 256 MiB + allowance): a's newest process is killed, the
        # Event is on a, and b (whose limit it would have fitted in) is not touched.
        hog = exec_nested(a, cgroup, shim=False, name="nested-hog")
        assert hog.do(f"alloc {300 * MiB} 2") in ("ok 1", "<exited>")
        until(lambda: hog.proc.poll() is not None, what="the watchdog to kill the nested process")
        (ev,) = until(lambda: node.events(a, REASON_LIMIT_ENFORCED), what="the Event on a")
        assert f"killed process {hog.proc.pid}" in ev["message"], ev
        assert node.events(b, REASON_LIMIT_ENFORCED) == []
        assert inner.proc.poll() is None and inner.do("check 1") == "ok"
    assert b.alive() and b.app.do("check 1") == "ok" and b.grant() == 0
    assert agent_alive(node)
