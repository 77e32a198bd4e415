"""A process in a cgroup nested past PATH_MAX is still its container's.

With a writable cgroupfs a container can nest cgroups below its own until a process's path
passes PATH_MAX (4 KiB). Some kernels then refuse /proc/<pid>/cgroup (ENAMETOOLONG), others
cut the path short. A cut path still names the container (its first levels are the ones the
runtime made); a refused one names nothing, and a process the agent took for "gone" there
would hold GPU memory unseen by the watchdog and by the driver's count. The agent tells a
process that is gone (no /proc entry) from one that lives unreadable, finds the latter's
container by walking cgroupfs with directory descriptors (gpufrac.agent.cgroup_walk), and
reports one it cannot place, never dropping it (gpufrac.agent.callers.cgroup_of,
gpufrac.agent.gpu_processes.observe).

This machine's kernel cuts the path: the end-to-end test below runs the real kernel's answer
through the real agent. The kernels that refuse are stood in for by a /proc in which that one
process's cgroup file gives ENAMETOOLONG when opened (a symlink to a name past NAME_MAX):
everything else there is the kernel's own.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpufrac.agent import truth
from gpufrac.agent.events import REASON_EVICTED, REASON_LIMIT_ENFORCED
from gpufrac.agent.gpu_processes import observe
from gpufrac.agent.kill import kill_if_same
from gpufrac.agent.watchdog import Watchdog
from gpufrac.core import native
from gpufrac.core.config import WatchdogConfig
from gpufrac.simgpu.workload import WorkloadProcess
from tests.fixtures.arbiter_harness import ArbiterNode, GiB, MiB
from tests.fixtures.e2e import E2ENode, PodRun
from tests.fixtures.hostile_tenant import agent_alive, agent_config, exec_in
from tests.fixtures.polling import until

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


def test_a_process_whose_cgroup_file_is_refused_is_found_counted_and_killed(
    make_node: Callable[..., ArbiterNode], tmp_path: Path
) -> None:
    node = make_node()
    assert node.state_path is not None
    a = node.add("a", 1, "1Gi", start=False)
    hog = node.start_cuda(a, shim=False)
    # A GPU process in no container at all, its cgroup file refused too.
    env = dict(os.environ, SIMGPU_STATE=str(node.state_path), LD_LIBRARY_PATH=str(native.native_dir()))
    env.pop("LD_PRELOAD", None)
    stray = WorkloadProcess.spawn(env, "stray")
    try:
        with deep_below(hog.c.cgroup_dir) as deep:
            deep.enter(hog.pid)
            assert hog.do(f"alloc {2 * GiB} 1") == "ok 1"  # past its 1 GiB limit
            assert stray.do(f"alloc {GiB} 1") == "ok 1"
            proc = refusing_proc(tmp_path, [hog.pid, stray.proc.pid])
            with pytest.raises(OSError, match="File name too long"):
                open(f"{proc}/{hog.pid}/cgroup").close()
            # The driver's count: a's process is found and counted as a's.
            seen = observe(proc)
            usage = node.on_loop(lambda: truth.attribute(seen, node.arbiter.peers))
            assert usage.bytes_of(a.alloc.key, node.gpu) >= 2 * GiB, seen  # and its context
            # The watchdog kills it within its interval, and reports the stray one.
            cfg = WatchdogConfig(mode="enforce", tolerance=256 * MiB, interval=0.05)
            wd = Watchdog(
                cfg,
                node.ledger,
                node.arbiter.peers,
                node.identity.events,
                metrics=node.metrics,
                observer=lambda: observe(proc),
                killer=lambda pid, ident: kill_if_same(pid, ident, proc),
            )
            node.on_loop(wd.start)
            try:
                until(lambda: hog.proc.poll() is not None, timeout=30, what="the kill of a's process")
                until(lambda: stray.proc.pid in wd.unowned, timeout=30, what="the stray process reported")
            finally:
                node.on_loop(wd.stop)
            assert wd.kills == 1 and stray.proc.poll() is None
    finally:
        stray.close()
