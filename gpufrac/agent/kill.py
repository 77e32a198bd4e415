"""Killing a container's processes: the one place the agent sends SIGKILL.

Used by the arbiter's eviction (every process of a victim container) and by the watchdog's
enforcement (one process over its container's limit). A pid is only a number the kernel may
hand to a new process at any time, so every kill goes through a pidfd, and the process is
checked to still be in the container it was chosen from once that pidfd pins it. All of it
blocks (a /proc read per pid, waiting for exits): callers run it in a worker thread.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from gpufrac.agent.callers import CgroupIdentity, PeerError, in_container, read_cgroup
from gpufrac.agent.ledger import ContainerAlloc

log = logging.getLogger(__name__)

# How long killed processes get to exit after SIGKILL before the killer gives up waiting.
KILL_WAIT = 10.0


def kill_and_wait(
    pids: Sequence[int], timeout: float = KILL_WAIT, still_ours: Callable[[int], bool] | None = None
) -> int:
    """SIGKILL every pid and wait (pidfd, no polling) until they are gone. Blocking: run in
    a thread. `still_ours(pid)`, checked once the pidfd pins the process, skips a pid that
    now names another process (reused). Returns how many were signalled."""
    fds, killed = [], 0
    for pid in pids:
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            continue  # already gone
        sent = False
        try:
            if still_ours is None or still_ours(pid):
                signal.pidfd_send_signal(fd, signal.SIGKILL)
                sent = True
        except OSError:
            pass  # exited between pidfd_open and the signal
        finally:
            if sent:
                killed += 1
                fds.append(fd)
            else:
                os.close(fd)
    try:
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        deadline = time.monotonic() + timeout
        pending = set(fds)
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                log.error("%d killed process(es) did not exit within %.0fs", len(pending), timeout)
                break
            for fd, _ in poller.poll(left * 1000):
                pending.discard(fd)
                with contextlib.suppress(KeyError):
                    poller.unregister(fd)
    finally:
        for fd in fds:
            os.close(fd)
    return killed


def kill_if_same(
    pid: int, ident: CgroupIdentity, proc_root: str = "/proc", timeout: float = KILL_WAIT
) -> bool:
    """SIGKILL `pid` only if it is still the process of that container (a pidfd pins it
    against pid reuse between the check and the signal); wait for it to exit."""
    return kill_and_wait([pid], timeout, still_ours=lambda p: in_container(p, ident, proc_root)) == 1


class ContainerPids(Protocol):
    """Where a container's host pids come from (gpufrac.agent.callers.PeerLookup)."""

    @property
    def proc(self) -> str: ...  # the /proc root
    @property
    def seen(self) -> Mapping[str, CgroupIdentity]: ...  # container key -> the cgroup a caller was in

    def pids_of(self, alloc: ContainerAlloc) -> list[int]: ...


def container_targets(pids: ContainerPids, alloc: ContainerAlloc) -> dict[int, CgroupIdentity]:
    """The container's host pids, each with the container its cgroup names: the one a caller
    of it was seen in, else each pid's as read now (still in the pod)."""
    seen = pids.seen.get(alloc.key)
    out: dict[int, CgroupIdentity] = {}
    for pid in pids.pids_of(alloc):
        ident: CgroupIdentity | None = seen
        if ident is None:
            try:
                ident = read_cgroup(pid, pids.proc)
            except PeerError:
                continue  # exited
            if ident is None or ident.pod_uid != alloc.pod_uid:
                continue  # the pid was reused meanwhile
        out[pid] = ident
    return out


def kill_container(pids: ContainerPids, alloc: ContainerAlloc) -> int:
    """SIGKILL every process of the container, each only while it is still in that container;
    all signalled, then waited for at once. Returns how many were signalled."""
    targets = container_targets(pids, alloc)
    return kill_and_wait(list(targets), still_ours=lambda p: in_container(p, targets[p], pids.proc))
