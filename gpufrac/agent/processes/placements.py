"""Which kubelet container each of many processes is in, without reading /proc for each again.

The compute loop places every process the driver sampled in its container by its cgroup, once a
control period (100 ms): on a busy node that is hundreds of `/proc/<pid>/cgroup` reads a second,
the same processes' every time. So the container found for a process is kept with a pidfd of
it, as gpufrac.agent.processes.knowncallers keeps an arbiter caller's: while the pidfd says the
process has not exited, its pid names no other process. Once it has exited, its entry goes and
its pid is read afresh when sampled again: a reused pid never inherits a placement.

A process stays in the cgroup it was read in unless someone with write access to the cgroup
tree moves it (the runtime places a container's processes when they start; a container cannot
move one into another pod's: gpufrac.agent.processes.callers). Whoever can, a placement is
still read again once it is MAX_AGE_S old, so a moved process is placed where it is within
that time; what stops a process (gpufrac.agent.compute.hold) reads its cgroup again anyway.
What a tenant controls (its processes, their number and their pids) costs the agent one read
per process it starts and per MAX_AGE_S, never one per period: between, a process is checked
with one signal-0 syscall.

At most SIZE processes are kept (one pidfd each, within the agent's file reserve,
gpufrac.agent.arbiter.fairness.FD_RESERVE); past it the least recently asked goes. Blocking: the
owner (one caller at a time) runs `lookup` in a worker thread.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterable

from gpufrac.agent.processes.callers import CgroupIdentity, PeerError, read_cgroup

SIZE = 256
MAX_AGE_S = 5.0  # a kept placement is read again once this old (a process moved by the root)


def _alive(pidfd: int) -> bool:
    """Whether the process a pidfd pins has not exited (a zombie counts: its pid is still its)."""
    try:
        signal.pidfd_send_signal(pidfd, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # lives, but not ours to signal
        return True
    return True


class Placements:
    """pid -> (a pidfd of the process that had it, the kubelet container its cgroup names, when
    that was read)."""

    def __init__(
        self,
        proc: str = "/proc",
        size: int = SIZE,
        max_age_s: float = MAX_AGE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.proc = proc
        self.size = size
        self.max_age_s = max_age_s
        self.clock = clock
        self._known: dict[int, tuple[int, CgroupIdentity | None, float]] = {}  # in order of last use
        self.reads = 0  # cgroup files read (tests)

    def lookup(self, pids: Iterable[int]) -> dict[int, CgroupIdentity | None]:
        """Each pid's kubelet container (None: in none, gone, or its cgroup file refused)."""
        now = self.clock()
        out: dict[int, CgroupIdentity | None] = {}
        for pid in pids:
            hit = self._known.pop(pid, None)
            if hit is not None:
                pidfd, ident, read_at = hit
                if not _alive(pidfd):
                    os.close(pidfd)  # exited: its pid may name another process now
                elif now - read_at < self.max_age_s:
                    self._known[pid] = hit  # most recently used last
                    out[pid] = ident
                    continue
                else:
                    out[pid] = self._read(pid, now, pidfd)  # the same process, read again
                    continue
            out[pid] = self._read(pid, now)
        return out

    def _read(self, pid: int, now: float, pidfd: int | None = None) -> CgroupIdentity | None:
        """Read a process's cgroup and keep it, pinned by a pidfd taken first: the process
        alive after the read is the one that was read."""
        if pidfd is None:
            try:
                pidfd = os.pidfd_open(pid)
            except OSError:  # gone, or no file to pin it with: read, not kept
                return self._read_only(pid)
        self.reads += 1
        try:
            ident = read_cgroup(pid, self.proc)
            if not _alive(pidfd):
                raise PeerError(f"process {pid} exited while it was read")
        except PeerError:  # gone since it was sampled, or its cgroup refused: no one's
            os.close(pidfd)
            return None
        if len(self._known) >= self.size:
            oldest = next(iter(self._known))
            os.close(self._known.pop(oldest)[0])
        self._known[pid] = (pidfd, ident, now)
        return ident

    def _read_only(self, pid: int) -> CgroupIdentity | None:
        self.reads += 1
        try:
            return read_cgroup(pid, self.proc)
        except PeerError:
            return None

    def close(self) -> None:
        for pidfd, _, _ in self._known.values():
            with contextlib.suppress(OSError):
                os.close(pidfd)
        self._known.clear()
