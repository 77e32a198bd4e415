"""A connection whose connector died is not charged to the live process now holding its pid.

The arbiter's fairness account (gpufrac.agent.arbiter.fairness) charges each new connection to its
caller's container, and gpufrac.agent.processes.knowncallers keeps the container found for a process
(with a pidfd of it) so a flood's connections need not each read /proc. A tenant can connect
from a short-lived process and leave its connection in the backlog until a neighbour's

pytestmark = pytest.mark.security
process is given the same pid and has connected itself (so is in the cache): the tenant's
connection must then be refused, not charged to the neighbour's container (where enough of
them would lock the neighbour out of the arbiter).

Real processes, a real unix socket, real cgroups (gpufrac.simgpu.runtime names the
neighbour's as the kubelet does); the pid is handed to the neighbour's process through
ns_last_pid, as the kernel's pid allocator would in time.
"""

from __future__ import annotations

import os
import signal
import socket
import uuid
from pathlib import Path

import pytest

from gpufrac.agent.processes.callers import PeerError
from gpufrac.agent.processes.knowncallers import KnownCallers
from gpufrac.simgpu.runtime import ContainerRuntime
from tests.fixtures.hostile_tenant import spawn_with_pid


def connect_and_die(path: str) -> int:
    """Connect to `path` from a child that then exits (and is reaped); returns its pid."""
    pid = os.fork()
    if pid == 0:
        try:
            socket.socket(socket.AF_UNIX, socket.SOCK_STREAM).connect(path)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    return pid


def test_a_dead_connectors_connection_is_refused_not_charged_to_the_cached_owner_of_its_pid(
    runtime: ContainerRuntime, tmp_path: Path
) -> None:
    pod = str(uuid.uuid4())
    neighbour = runtime.start(pod, "neighbour", ["sleep", "60"])
    runtime.wait_entered(neighbour)
    procs = neighbour.cgroup_dir / "cgroup.procs"
    path = str(tmp_path / "arbiter.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(64)
    callers = KnownCallers()
    try:
        for _ in range(20):  # another fork on the machine may take the pid first: try again
            dead = connect_and_die(path)
            heir = spawn_with_pid(dead, procs, connect_to=path)
            if heir is not None:
                break
            srv.accept()[0].close()
        else:
            pytest.skip("the pid was always taken by another process first")
        try:
            # Accepted in the order they connected: the dead connector's first.
            tenant_conn, _ = srv.accept()
            heir_conn, _ = srv.accept()
            with tenant_conn, heir_conn:
                # The neighbour's own connection is identified first and so cached.
                got = callers.identify(heir_conn)
                assert got is not None and got.pod_uid == pod
                with pytest.raises(PeerError):
                    callers.identify(tenant_conn)
        finally:
            os.kill(heir, signal.SIGKILL)
            os.waitpid(heir, 0)
    finally:
        callers.close()
        srv.close()
        neighbour.stop()
