"""The connecting process's pidfd (SO_PEERPIDFD): only a kernel without it means "the pid alone".

Any other failure to get it (the agent out of files) refuses the request: answering on the
bare pid then would let a process given a connector's pid after it exited pass for it
(gpufrac.agent.processes.callers.peer_pidfd, used by PeerLookup and KnownCallers). Real sockets, a real
file limit.
"""

from __future__ import annotations

import os
import socket

import pytest

from gpufrac.agent.processes.callers import AgentOutOfResources, peer_pidfd
from gpufrac.agent.processes.knowncallers import KnownCallers
from tests.fixtures.descriptors import no_free_descriptor

pytestmark = pytest.mark.unit


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
