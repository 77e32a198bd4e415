"""A connection whose process died is not taken for whoever gets its pid next.

SO_PEERCRED names the pid that connected; the agent reads that pid's cgroup when the
request comes. A tenant can connect from a short-lived process, keep the socket, and wait
for a neighbour's process to be given the same pid (a pid_max of 32768 wraps in a second
of forking): its request would then act for the neighbour. Real processes in real cgroups
on the real socket; the pid is handed to the neighbour's process through ns_last_pid, as
the kernel's own pid allocator would in time.
"""

from __future__ import annotations

import os
import signal
import socket
from collections.abc import Callable
from pathlib import Path

import pytest

from gpufrac.memguard import abi, wire
from tests.fixtures.arbiter_harness import ArbiterNode, Box, GiB
from tests.fixtures.hostile_tenant import spawn_with_pid

pytestmark = pytest.mark.security


def cgroup_procs(node: ArbiterNode, box: Box) -> Path:
    assert box.container is not None
    return box.container.cgroup_dir / "cgroup.procs"


def connect_and_die(path: str, procs: Path) -> tuple[socket.socket, int]:
    """A socket connected by a child of this process that joined `procs`'s cgroup, then
    exited (and was reaped): SO_PEERCRED names a pid free for anyone."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    pid = os.fork()
    if pid == 0:
        try:
            procs.write_text(str(os.getpid()))
            s.connect(path)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    return s, pid


def test_a_request_from_a_dead_process_is_not_taken_for_the_next_owner_of_its_pid(
    make_node: Callable[..., ArbiterNode],
) -> None:
    node = make_node()
    tenant = node.add("tenant", 2, "6Gi")
    b = node.add("b", 2, "6Gi")
    grant = b.config().grant_bytes
    for _ in range(20):  # another fork on the machine may take the pid first: try again
        s, dead = connect_and_die(node.socket, cgroup_procs(node, tenant))
        heir = spawn_with_pid(dead, cgroup_procs(node, b))
        if heir is not None:
            break
        s.close()
    else:
        pytest.skip("the pid was always taken by another process first")
    try:
        with s:
            s.settimeout(30)
            req = wire.BurstRequest(
                wire.BURST_MAGIC, abi.ABI_VERSION, wire.BURST_OP_BURST, dead, 0, GiB, 3 * GiB, 0
            )
            s.sendall(bytes(req))
            data = b""
            while len(data) < wire.REPLY_SIZE:
                chunk = s.recv(wire.REPLY_SIZE - len(data))
                if not chunk:
                    break
                data += chunk
        rep = wire.BurstReply.from_buffer_copy(data)
        # Not acted on for the neighbour: refused, and its grant is as it was.
        assert rep.status == wire.BURST_REFUSED
        assert b.config().grant_bytes == grant
    finally:
        os.kill(heir, signal.SIGKILL)
        os.waitpid(heir, 0)
