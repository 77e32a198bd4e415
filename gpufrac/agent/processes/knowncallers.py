"""Which container a new arbiter connection is charged to, without reading /proc each time.

The per-container limits on the arbiter socket (gpufrac.agent.arbiter.fairness) need the caller's
container before anything else is done for a connection, and a flood's connections are many:
reading `/proc/<pid>/cgroup` for each was most of what a flood cost the agent's loop. A
flooder's connections come from few processes, so the container found for a process is kept
with a pidfd of that process: while that pidfd says the process is alive, its pid names
no other process, and a new connection whose SO_PEERCRED names the same pid is the same
process's (a process cannot leave its pod's cgroup for another pod's: the outermost pod
component, which names the container, stays; gpufrac.agent.processes.callers). Once the process has
exited, its entry is dropped and the pid read again. Only the fairness account uses this:
every request is still identified afresh before anything is decided for it
(gpufrac.agent.processes.callers.PeerLookup.identify).
"""

from __future__ import annotations

import os
import signal
import socket

from gpufrac.agent.processes.callers import CgroupIdentity, PeerError, cgroup_of, peer_credentials, peer_pidfd

# Processes remembered at once: each holds one pidfd (within the agent's file reserve,
# gpufrac.agent.arbiter.fairness.FD_RESERVE). The oldest entry goes first.
SIZE = 128


def _alive(pidfd: int) -> bool:
    try:
        signal.pidfd_send_signal(pidfd, 0)
    except ProcessLookupError:
        return False
    return True


class KnownCallers:
    """pid -> (a pidfd of the process that had it, the account key of its container)."""

    def __init__(self, proc: str = "/proc", size: int = SIZE) -> None:
        self.proc = proc
        self.size = size
        self._known: dict[int, tuple[int, CgroupIdentity | None]] = {}
        self.hits = self.misses = 0

    def identify(self, sock: socket.socket) -> CgroupIdentity | None:
        """The connecting process's kubelet container (None: in none). Raises PeerError when
        the process that connected has exited (its pid may name another one) or the kernel
        refuses its cgroup file (CgroupUnreadable: not kept, and never searched for: one
        failed read per connection), OSError."""
        pid = peer_credentials(sock).pid
        pidfd = peer_pidfd(sock, pid)  # refused when it cannot be had on a kernel that has it
        if pidfd is None:  # a kernel before 6.5: the pid alone, read every time
            return cgroup_of(pid, self.proc)
        hit = self._known.get(pid)
        if hit is not None:
            # The connector's own pidfd first: its pid may since name a cached neighbour's
            # process. Two live processes never share a pid, so the connector alive and the
            # cached process alive means they are one.
            try:
                connector_alive = _alive(pidfd)
            finally:
                os.close(pidfd)
            if not connector_alive:
                raise PeerError(f"process {pid} that connected has exited")
            if _alive(hit[0]):
                self.hits += 1
                return hit[1]
            os.close(hit[0])
            del self._known[pid]
            return self.identify(sock)  # cached one gone: read afresh (and cache) below
        self.misses += 1
        try:
            ident = cgroup_of(pid, self.proc)
            if not _alive(pidfd):
                raise PeerError(f"process {pid} that connected has exited")
        except BaseException:
            os.close(pidfd)
            raise
        if len(self._known) >= self.size:
            oldest = next(iter(self._known))
            os.close(self._known.pop(oldest)[0])
        self._known[pid] = (pidfd, ident)
        return ident

    def close(self) -> None:
        for pidfd, _ in self._known.values():
            os.close(pidfd)
        self._known.clear()
