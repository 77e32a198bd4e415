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
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from gpufrac.memguard import abi, wire
from tests.fixtures.arbiter_harness import ArbiterNode, Box, GiB

NS_LAST_PID = Path("/proc/sys/kernel/ns_last_pid")


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


def spawn_with_pid(pid: int, procs: Path) -> int | None:
    """A sleeping process with exactly `pid` in `procs`'s cgroup, or None if another fork
    on the machine took that pid first."""
    try:
        NS_LAST_PID.write_text(str(pid - 1))
    except OSError:
        pytest.skip("ns_last_pid is not writable here")
    r, w = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(r)
        try:
            if os.getpid() == pid:
                procs.write_text(str(os.getpid()))
                os.write(w, b"1")
            else:
                os.write(w, b"0")
            os.close(w)
            time.sleep(60)
        finally:
            os._exit(0)
    os.close(w)
    ok = os.read(r, 1) == b"1"
    os.close(r)
    if not ok:
        os.waitpid(child, 0)
        return None
    return child


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
