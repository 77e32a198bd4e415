"""A process in a cgroup nested past PATH_MAX hides nothing.

With a writable cgroupfs a container can nest cgroups below its own until a process's path
passes PATH_MAX (4 KiB). Some kernels then cut the path short, and a cut path still names the
container (its first levels are the ones the runtime made: gpufrac.agent.processes.callers
.parse_cgroup_path). Others refuse /proc/<pid>/cgroup (ENAMETOOLONG): only someone nesting
cgroups on purpose gets there, and a search of cgroupfs for such a process is the tenant's to
make expensive or fail (decoy cgroups, the search's budget, fresh pids), so there is none. A
process whose cgroup file is refused is no container's: the arbiter refuses it as a caller,
and as a GPU process it is hidden, killed by the watchdog in enforce mode (only while its
cgroup file is still refused), reported in report mode (gpufrac.agent.processes.callers.cgroup_of,
gpufrac.agent.gpu.processes.observe, gpufrac.agent.watchdog.service, gpufrac.agent.processes.kill
.kill_if_hidden). What it holds is nobody's, and nobody is evicted or swapped to cover it: a
request that needs that memory waits for the kill (arbiter/context.py Resolution.coverable).

This machine's kernel cuts the path: the end-to-end test below runs the real kernel's answer
through the real agent. The kernels that refuse are stood in for by a /proc in which those
processes' cgroup files give ENAMETOOLONG when opened (a symlink to a name past NAME_MAX):
everything else there is the kernel's own.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpufrac.agent.gpu import truth
from gpufrac.agent.gpu.processes import observe
from gpufrac.agent.kube.events import REASON_EVICTED, REASON_LIMIT_ENFORCED
from gpufrac.agent.processes.kill import kill_if_hidden, kill_if_same
from gpufrac.agent.processes.proc import start_time
from gpufrac.agent.watchdog.service import Watchdog
from gpufrac.core import native
from gpufrac.core.config import WatchdogConfig
from gpufrac.simgpu.runtime import _ENTER, Container
from gpufrac.simgpu.workload import WorkloadProcess
from tests.fixtures.arbiter_harness import ArbiterNode, CudaApp, GiB, MiB
from tests.fixtures.e2e import E2ENode, PodRun
from tests.fixtures.hostile_tenant import agent_alive, agent_config, exec_in
from tests.fixtures.kube import KubeServer
from tests.fixtures.polling import until

pytestmark = pytest.mark.security

MakeNode = Callable[..., E2ENode]
LEVEL = "n" * 250  # a cgroup name of 250 bytes: 17 levels pass PATH_MAX
DEPTH = 18


class DeepCgroups:
    """A chain of DEPTH cgroups below `parent`, made and entered through directory
    descriptors (its full path is longer than any system call takes)."""

    def __init__(self, parent: Path) -> None:
        self.fds = [os.open(parent, os.O_RDONLY | os.O_DIRECTORY)]
        for _ in range(DEPTH):
            os.mkdir(LEVEL, dir_fd=self.fds[-1])
            self.fds.append(os.open(LEVEL, os.O_RDONLY | os.O_DIRECTORY, dir_fd=self.fds[-1]))
        assert len(str(parent)) + DEPTH * (len(LEVEL) + 1) > 4096

    def enter(self, pid: int) -> None:
        """Move `pid` into the deepest cgroup, as a process of the container may."""
        fd = os.open("cgroup.procs", os.O_WRONLY, dir_fd=self.fds[-1])
        try:
            os.write(fd, str(pid).encode())
        finally:
            os.close(fd)

    def pids(self) -> list[int]:
        fd = os.open("cgroup.procs", os.O_RDONLY, dir_fd=self.fds[-1])
        try:
            return [int(p) for p in os.read(fd, 1 << 16).split()]
        finally:
            os.close(fd)

    def close(self) -> None:
        deadline = time.monotonic() + 10
        while (pids := self.pids()) and time.monotonic() < deadline:
            for p in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, signal.SIGKILL)
            time.sleep(0.02)
        for i in range(len(self.fds) - 1, 0, -1):
            os.close(self.fds[i])
            os.rmdir(LEVEL, dir_fd=self.fds[i - 1])
        os.close(self.fds[0])


@contextlib.contextmanager
def deep_below(parent: Path) -> Iterator[DeepCgroups]:
    chain = DeepCgroups(parent)
    try:
        yield chain
    finally:
        chain.close()


def test_a_process_nested_past_path_max_is_killed_over_its_limit(e2e_node: MakeNode) -> None:
    node = e2e_node(**agent_config())
    a = node.run_pod("a", 4, "256Mi")  # request = limit = 256 MiB
    b = node.run_pod("b", 10, None, wait_timeout="30s")  # request 640 MiB
    with deep_below(a.container.cgroup_dir) as deep:
        hog = exec_in(a, shim=False, name="deep")
        deep.enter(hog.proc.pid)
        assert hog.do(f"alloc {500 * MiB} 1") in ("ok 1", "<exited>")  # past 256 MiB + allowance
        # b allocates inside its guarantee, which the hidden process holds.
        assert b.alloc(600 * MiB) == "ok 1"
        assert b.app.do("check 1") == "ok"
        until(lambda: hog.proc.poll() is not None, what="the nested process to be killed")
        until(lambda: killed_for_it(node, a), what="the Event on a")
    assert node.events(b, REASON_LIMIT_ENFORCED) == [] and node.events(b, REASON_EVICTED) == []
    assert agent_alive(node)


def killed_for_it(node: E2ENode, pod: PodRun) -> list[dict[str, object]]:
    return node.events(pod, REASON_LIMIT_ENFORCED) + node.events(pod, REASON_EVICTED)


def refusing_proc(where: Path, pids: list[int]) -> str:
    """A /proc that is the kernel's, except that opening `pids`' cgroup files fails with
    ENAMETOOLONG, as the kernels that refuse a path past PATH_MAX answer."""
    root = where / "proc"
    root.mkdir()
    for name in os.listdir("/proc"):
        if not (name.isdigit() and int(name) in pids):
            (root / name).symlink_to(f"/proc/{name}")
    for pid in pids:
        d = root / str(pid)
        d.mkdir()
        for name in ("stat", "status", "maps"):
            (d / name).symlink_to(f"/proc/{pid}/{name}")
        (d / "cgroup").symlink_to("x" * 300)  # a name past NAME_MAX: ENAMETOOLONG
    return str(root)


@contextlib.contextmanager
def stray_gpu_process(node: ArbiterNode) -> Iterator[WorkloadProcess]:
    """A GPU process in no container at all (a process on the host)."""
    env = dict(os.environ, SIMGPU_STATE=str(node.state_path), LD_LIBRARY_PATH=str(native.native_dir()))
    env.pop("LD_PRELOAD", None)
    stray = WorkloadProcess.spawn(env, "stray")
    try:
        yield stray
    finally:
        stray.close()


def watchdog(node: ArbiterNode, mode: str, proc: str) -> Watchdog:
    """The node's watchdog, scanning often, its readings and kills through `proc`."""
    cfg = WatchdogConfig(mode=mode, tolerance=256 * MiB, interval=0.05)
    return Watchdog(
        cfg,
        node.ledger,
        node.arbiter.peers,
        node.identity.events,
        metrics=node.metrics,
        observer=lambda: observe(proc),
        killer=lambda pid, ident: kill_if_same(pid, ident, proc),
        hidden_killer=lambda pid, started: kill_if_hidden(pid, started, proc),
    )


def hidden_count(node: ArbiterNode, action: str) -> float:
    value = node.metrics.registry.get_sample_value("gpufrac_watchdog_actions_total", {"action": action})
    return value or 0.0


@pytest.mark.parametrize("mode", ["enforce", "report"])
def test_a_gpu_process_whose_cgroup_file_is_refused_is_killed_or_reported(
    make_node: Callable[..., ArbiterNode], tmp_path: Path, mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="gpufrac.agent.watchdog.service")
    node = make_node()
    a = node.add("a", 1, "1Gi", start=False)
    hog = node.start_cuda(a, shim=False)
    b = node.add("b", 1, "1Gi", start=False)
    neighbour = node.start_cuda(b, shim=False)  # its cgroup reads: judged as b's
    with stray_gpu_process(node) as stray, deep_below(hog.c.cgroup_dir) as deep:
        deep.enter(hog.pid)
        # Within a's limit: only hiding makes it a case (a search that found it let it be).
        assert hog.do(f"alloc {512 * MiB} 1") == "ok 1"
        assert neighbour.do(f"alloc {512 * MiB} 1") == "ok 1"
        assert stray.do(f"alloc {256 * MiB} 1") == "ok 1"
        proc = refusing_proc(tmp_path, [hog.pid, stray.proc.pid])
        with pytest.raises(OSError, match="File name too long"):
            open(f"{proc}/{hog.pid}/cgroup").close()
        # The driver's count: the hidden process is nobody's, not a's.
        seen = observe(proc)
        assert {o.proc.pid for o in seen if o.hidden} == {hog.pid, stray.proc.pid}, seen
        usage = node.on_loop(lambda: truth.attribute(seen, node.arbiter.peers))
        assert usage.bytes_of(a.alloc.key, node.gpu) < 512 * MiB
        wd = watchdog(node, mode, proc)
        node.on_loop(wd.start)
        try:
            if mode == "enforce":
                until(lambda: hog.proc.poll() is not None, timeout=30, what="the hidden process killed")
                until(lambda: stray.proc.poll() is not None, timeout=30, what="the stray one killed")
                assert hidden_count(node, "hidden_kill") == 2 and wd.kills == 2
            else:
                until(lambda: wd.scans >= 5, timeout=30, what="five scans")
                assert hog.proc.poll() is None and stray.proc.poll() is None
                assert set(wd.hidden) == {hog.pid, stray.proc.pid}
                assert hidden_count(node, "hidden_report") == 2  # once each, not once a scan
                said = [r.getMessage() for r in caplog.records if f"GPU process {hog.pid} " in r.getMessage()]
                assert len(said) == 1 and "hidden" in said[0] and "File name too long" in said[0], said
        finally:
            node.on_loop(wd.stop)
        assert neighbour.proc.poll() is None and neighbour.do("check 1") == "ok"


def test_a_hidden_process_is_killed_only_while_its_cgroup_file_is_refused(
    make_node: Callable[..., ArbiterNode], tmp_path: Path
) -> None:
    node = make_node()
    a = node.add("a", 1, "1Gi", start=False)
    app: CudaApp = node.start_cuda(a, shim=False)
    started = start_time(app.pid)
    proc = refusing_proc(tmp_path, [app.pid])
    # Its cgroup reads (the kernel's /proc): it is a's, never killed as hidden.
    assert not kill_if_hidden(app.pid, started, "/proc")
    # Refused, but not the process seen (its pid given to another since): left alone.
    assert not kill_if_hidden(app.pid, started + 1, proc)
    assert app.proc.poll() is None and app.do("sync") == "ok"
    assert kill_if_hidden(app.pid, started, proc)
    assert app.proc.wait(10) == -9


def test_an_arbiter_caller_whose_cgroup_file_is_refused_is_refused_and_a_neighbour_is_granted(
    make_node: Callable[..., ArbiterNode],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="gpufrac.agent.arbiter.server")
    node = make_node()
    a = node.add("a", 1, "4Gi")
    b = node.add("b", 1, "4Gi")
    assert a.workload is not None and b.workload is not None and a.container is not None
    with deep_below(a.container.cgroup_dir) as deep:
        pid = a.container.proc.pid
        deep.enter(pid)
        proc = refusing_proc(tmp_path, [pid])
        # The arbiter's identification (per request, and per connection for its limits)
        # reads cgroups through that /proc.
        monkeypatch.setattr(node.arbiter.peers, "proc", proc)
        monkeypatch.setattr(node.arbiter.fairness.known, "proc", proc)
        assert a.workload.do(f"burst {GiB} {2 * GiB}") == "refused"
        assert b.workload.do(f"alloc {2 * GiB}") == "granted"
        assert a.workload.do(f"burst {GiB} {2 * GiB}") == "refused"
        assert a.config().grant_bytes == 0 and b.config().grant_bytes > 0
    said = [r.getMessage() for r in caplog.records if "refused a request" in r.getMessage()]
    assert any(f"process {pid} lives" in m and "PATH_MAX" in m for m in said), said


def shimless_in(c: Container) -> WorkloadProcess:
    """Another GPU process in container `c` (its cgroup, its environment), without the shim,
    as the container may start one (tests/fixtures/hostile_tenant.exec_in on these nodes)."""
    env = {k: v for k, v in c.env.items() if k != "LD_PRELOAD"}
    proc = subprocess.Popen(
        ["/bin/sh", "-c", _ENTER, "sh", *WorkloadProcess.argv()],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    threading.Thread(target=proc.wait, name="reap-hidden", daemon=True).start()
    return WorkloadProcess(proc, "hidden", 120.0)


@pytest.mark.parametrize("mode", ["enforce", "report"])
def test_memory_a_hidden_process_holds_gets_no_neighbour_evicted_by_a_reclaim(
    make_node: Callable[..., ArbiterNode],
    kube_server: KubeServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    mode: str,
) -> None:
    """A's own hidden process takes the unused part of a's guarantee, then a allocates inside
    its request: the driver refuses, a's shim sends RECLAIM. The driver's count of a leaves the
    hidden process out, so the shortfall looked as large as what it holds, and b's burst (from
    memory nobody requested, none of a's guarantee) was evicted for it. Memory hidden processes
    hold is never covered by evicting or swapping anyone: a waits, and in enforce mode gets its
    allocation once the watchdog has killed the hidden process; in report mode it is denied."""
    # resolvers: [wait]; a guarantee's chain adds evict. The shim as the node installs it.
    node = make_node(paths={"shimHostPath": str(native.library(native.SHIM))})
    a = node.add("a", 8, None, wait_timeout="60s" if mode == "enforce" else "3s", start=False)
    app_a = node.start_cuda(a)
    b = node.add("b", 1, "78Gi", wait_timeout="10s", start=False)  # preemptible
    app_b = node.start_cuda(b)
    # b fills its request and bursts into all the GPU's unrequested memory the grant model gives.
    room = b.alloc.request_bytes - b.used()
    free = node.on_loop(lambda: node.arbiter.grantable(b.alloc))
    assert app_b.do(f"alloc {room + free - 64 * MiB} 7") == "ok 1"
    assert b.config().grant_bytes > 0
    assert a.container is not None
    with deep_below(a.container.cgroup_dir) as deep:
        hog = shimless_in(a.container)
        deep.enter(hog.proc.pid)
        proc = refusing_proc(tmp_path, [hog.proc.pid])
        monkeypatch.setattr(node.arbiter.readings, "read_processes", lambda: observe(proc))
        node.on_loop(node.arbiter.resolution.refresh_memory)
        left = node.arbiter.readings.free(node.gpu)
        assert left is not None and left > 3 * GiB
        # The hidden process takes all but 1 GiB of the GPU's free memory: a's unused guarantee.
        assert hog.do(f"alloc {left - GiB} 1") == "ok 1"
        # a allocates 2 GiB inside its request: the driver refuses, its shim sends RECLAIM.
        app_a.send(f"alloc {2 * GiB} 3")

        def waiting() -> bool:
            queued = node.arbiter.queue.waiters.get(node.gpu, [])
            return app_b.proc.poll() is not None or any(w.need.kind == "reclaim" for w in queued)

        node.until(waiting, timeout=60, what="a's reclaim waiting (or b evicted)")
        assert app_b.proc.poll() is None, "b was evicted for memory a hidden process holds"
        wd = watchdog(node, mode, proc)
        node.on_loop(wd.start)
        try:
            if mode == "enforce":
                assert app_a.line(90) == "ok 1"  # once the hidden process is killed and its memory free
                until(lambda: hog.proc.poll() is not None, what="the hidden process reaped")
                assert wd.kills == 1
                assert app_a.do("check 1") == "ok"
            else:
                assert app_a.line(90) == "oom"  # denied at its wait timeout: nobody pays for it
                assert hog.proc.poll() is None and set(wd.hidden) == {hog.proc.pid}
        finally:
            node.on_loop(wd.stop)
    assert app_b.proc.poll() is None and app_b.do("check 1") == "ok"
    assert b.config().grant_bytes > 0
    node.on_loop(lambda: node.identity.events.flush(30))  # type: ignore[union-attr]
    evicted = [e for e in kube_server.events("default") if e.get("reason") == REASON_EVICTED]
    assert evicted == [], evicted
