"""Holding back a container the shim's pace does not hold (docs/compute.md, "A tenant that skips
the shim").

A container whose processes launch without the shim (or that rewrites its own launch clock) goes
on using more of its GPU than its share allows, however slow its pace: the compute loop flags it
unheld. The driver still says which processes run work on the GPU, and the kernel where they
live, so the agent holds it back from outside: it stops those processes (SIGSTOP) for part of each
control period and lets them go on (SIGCONT) for the rest. A stopped process launches nothing, so
the container's use falls to what its share allows, and it loses CPU time as well as GPU time:
skipping the shim gains a tenant nothing.

Each process is signalled through a pidfd, and only once the pidfd pins it and its cgroup still
names the container it was sampled in (a pid is a number the kernel may hand to another process
at any time; gpufrac.agent.processes.kill does the same for SIGKILL). The pidfd is kept until the same
process is continued. An agent that stops continues every process it stopped; one that died
leaves them stopped, so a starting agent continues the stopped GPU processes of the pods it books
(`continue_stopped`, from gpufrac.agent.compute.leftover). All of it blocks (a /proc read, a
syscall per process): callers run it in a worker thread.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from collections.abc import Iterable, Sequence

from gpufrac.agent.processes.callers import CgroupIdentity, PeerError, read_cgroup

log = logging.getLogger(__name__)


def _state(pid: int, proc: str) -> str:
    """A process's state letter (/proc/<pid>/stat), "" when it is gone."""
    try:
        with open(f"{proc}/{pid}/stat", "rb") as f:
            stat = f.read()
        return stat[stat.rindex(b")") + 2 :].split()[0].decode()
    except (OSError, ValueError, IndexError):
        return ""


def _pin(pid: int, ident: CgroupIdentity, proc: str) -> int | None:
    """A pidfd of `pid` while it is still the process of the container `ident` names; None when
    it is gone or elsewhere now."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return None
    try:
        now = read_cgroup(pid, proc)
    except PeerError:
        now = None
    if now is None or (now.pod_uid, now.container_id) != (ident.pod_uid, ident.container_id):
        os.close(fd)
        return None
    return fd


def stop(processes: Iterable[tuple[int, CgroupIdentity]], proc: str = "/proc") -> list[int]:
    """SIGSTOP each process still in its container: the pidfds of those stopped (for `resume`)."""
    held = []
    for pid, ident in processes:
        fd = _pin(pid, ident, proc)
        if fd is None:
            continue
        try:
            signal.pidfd_send_signal(fd, signal.SIGSTOP)
        except OSError:  # it exited meanwhile
            os.close(fd)
            continue
        held.append(fd)
    return held


def resume(fds: Sequence[int]) -> None:
    """SIGCONT the processes `stop` stopped, and let go of their pidfds."""
    for fd in fds:
        with contextlib.suppress(OSError):  # gone meanwhile
            signal.pidfd_send_signal(fd, signal.SIGCONT)
        os.close(fd)


def continue_stopped(processes: Iterable[tuple[int, CgroupIdentity]], proc: str = "/proc") -> int:
    """SIGCONT every process of these stopped by a signal (state T: an earlier agent may have
    stopped it and died), each still in the container `ident` names; how many. A process the
    tenant stopped itself is continued too: the price of never leaving one stopped for ever
    (docs/compute.md, Stopping). One stopped by a debugger (state t) is left alone."""
    n = 0
    for pid, ident in processes:
        if _state(pid, proc) != "T":
            continue
        fd = _pin(pid, ident, proc)
        if fd is None:
            continue
        with contextlib.suppress(OSError):
            signal.pidfd_send_signal(fd, signal.SIGCONT)
            n += 1
        os.close(fd)
    if n:
        log.warning("compute shares: continued %d stopped GPU processes (an earlier agent's hold)", n)
    return n
