"""The connecting process's pidfd (SO_PEERPIDFD): only a kernel without it means "the pid alone".

Any other failure to get it (the agent out of files) refuses the request: answering on the
bare pid then would let a process given a connector's pid after it exited pass for it
(gpufrac.agent.callers.peer_pidfd, used by PeerLookup and KnownCallers). Real sockets, a real
file limit.
"""

from __future__ import annotations

import contextlib
import os
import resource
import socket
from collections.abc import Iterator

import pytest

from gpufrac.agent.callers import AgentOutOfResources, peer_pidfd
from gpufrac.agent.knowncallers import KnownCallers


@contextlib.contextmanager
def no_free_descriptor() -> Iterator[None]:
    """Every descriptor this process may open is taken, until the block ends."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    highest = max(int(fd) for fd in os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (highest + 16, hard))
    fillers = []
    try:
        with contextlib.suppress(OSError):
            while True:
                fillers.append(os.open("/dev/null", os.O_RDONLY))
        yield
    finally:
        for fd in fillers:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_pidfd_that_cannot_be_had_refuses_the_caller() -> None:
    a, b = socket.socketpair()
    with a, b:
        fd = peer_pidfd(a, os.getpid())
        if fd is None:
            pytest.skip("this kernel has no SO_PEERPIDFD")
        os.close(fd)
        known = KnownCallers()
        with no_free_descriptor():
            with pytest.raises(AgentOutOfResources, match="cannot pin process"):
                peer_pidfd(a, os.getpid())
            with pytest.raises(AgentOutOfResources):
                known.identify(a)
        known.close()
