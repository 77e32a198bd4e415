"""Each container asks the arbiter on a socket of its own (gpufrac.agent.arbiter.listeners).

The device plugin mounts the directory of a container's own socket into it; the socket lives
as long as the booking, and only that container's processes are answered on it. At the node
cap the sockets of the containers that must wait stop accepting, and take connections again
once there is room. Real processes in real cgroups (tests/fixtures/arbiter_harness.py).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from gpufrac.agent.arbiter import Arbiter
from gpufrac.agent.arbiter.listeners import bind_unix, socket_path
from gpufrac.agent.fairness import Fairness
from gpufrac.agent.metrics import Metrics
from gpufrac.core.slices import MEMORY
from gpufrac.deviceplugin.server import container_response
from gpufrac.memguard import abi
from gpufrac.simgpu.runtime import mounts_of
from tests.fixtures.arbiter_harness import ArbiterNode, Box, GiB, Workload


def _listening(path: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(path)
        except OSError:
            return False
    return True


def start_on_socket_of(node: ArbiterNode, box: Box, other: Box) -> Workload:
    """box's container started with `other`'s socket directory mounted where its own belongs
    (a mount gone wrong, a hostPath): the stand-in workload then asks on other's socket."""
    resp = container_response(box.alloc, node.cfg)
    mounts = [
        dataclasses.replace(m, host_path=os.path.join(other.alloc.directory, abi.SOCKET_DIR))
        if m.container_path.endswith("/" + abi.SOCKET_DIR)
        else m
        for m in mounts_of(resp)
    ]
    c = node.runtime.start(
        box.uid,
        "main",
        [sys.executable, "-m", "gpufrac.simgpu.runtime"],
        envs={k: v for k, v in resp.envs.items() if k != "LD_PRELOAD"},
        mounts=mounts,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    box.container = c
    node.set_container_id(box.pod, box.uid, c.runtime_id)
    box.workload = Workload(box, c)
    return box.workload


def test_a_process_asking_on_another_containers_socket_is_refused(
    make_node: Callable[..., ArbiterNode], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="gpufrac.agent.arbiter")
    node = make_node()
    b = node.add("b", 2, "6Gi")
    a = node.add("a", 2, "6Gi", start=False)
    assert b.workload is not None
    intruder = start_on_socket_of(node, a, b)
    assert intruder.do(f"alloc {3 * GiB}") == "refused"
    assert a.config().grant_bytes == 0 and b.config().grant_bytes == 0
    assert [r for r in caplog.records if f"asked on {b.alloc.key}'s socket" in r.getMessage()]
    # The socket's own container is served on it.
    assert b.workload.do(f"alloc {3 * GiB}") == "granted"


def test_a_containers_socket_lives_as_long_as_its_booking(make_node: Callable[..., ArbiterNode]) -> None:
    node = make_node()
    b = node.add("b", 2, "6Gi")
    path = socket_path(b.alloc.directory)
    assert _listening(path)
    ids = list(b.alloc.device_ids)
    node.on_loop(lambda: node.ledger.release(b.alloc.key))
    node.boxes.remove(b)
    node.until(lambda: b.alloc.key not in node.arbiter.sockets.listeners, what="the socket closed")
    assert not _listening(path)
    # The same devices booked again (the kubelet reuses a deleted pod's): a socket again.
    again = node.on_loop(lambda: node.ledger.allocate(MEMORY, ids))
    assert again.key == b.alloc.key
    assert _listening(socket_path(again.directory))
    node.on_loop(lambda: node.ledger.release(again.key))


def test_a_socket_too_long_for_a_unix_address_is_bound_through_its_directory(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60) / abi.SOCKET_DIR
    deep.mkdir(parents=True)
    path = str(deep / abi.SOCKET_FILE)
    assert len(path) > 108
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        bind_unix(s, path)
        s.listen(1)
        # A container reaches it by a short path of its own (its mount; a link here).
        (tmp_path / "c").symlink_to(deep)
        assert _listening(str(tmp_path / "c" / abi.SOCKET_FILE))
        # Bound again (a restart): the old socket file is replaced, not an error.
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s2:
            bind_unix(s2, path)
            s2.listen(1)
            assert _listening(str(tmp_path / "c" / abi.SOCKET_FILE))


class _Socket:
    """A container's own socket as Fairness sees it: paused until resumed."""

    def __init__(self) -> None:
        self.resumed = 0

    def resume(self) -> None:
        self.resumed += 1


class _Conn:
    op: int | None = None

    def abort(self) -> None:
        pass


def test_sockets_paused_at_the_node_cap_resume_when_a_connection_closes() -> None:
    fair = Fairness(connections=2, inflight=1, rate=10.0, burst=10, node_connections=3, metrics=Metrics())
    held = [_Conn() for _ in range(3)]
    acc_a, _, _ = fair.admit(held[0], "a")
    fair.admit(held[1], "a")
    acc_b, _, _ = fair.admit(held[2], "b")
    assert acc_a is not None and acc_b is not None
    assert fair.at_limit(acc_a) and not fair.at_limit(acc_b)
    a_sock, b_sock = _Socket(), _Socket()
    fair.pause(acc_a, a_sock, node=False)  # at its own limit
    fair.pause(acc_b, b_sock, node=True)  # at the node's
    fair.gone(acc_b, held[2])  # room on the node; a still holds its limit
    assert b_sock.resumed == 1 and a_sock.resumed == 0
    fair.gone(acc_a, held[0])  # a under its limit
    assert a_sock.resumed == 1
    # A socket closed meanwhile is not resumed.
    fair.pause(acc_b, b_sock, node=True)
    fair.forget_socket("b")
    fair.gone(acc_a, held[1])
    assert b_sock.resumed == 1


def test_an_arbiter_started_over_existing_bookings_binds_their_sockets_anew(
    make_node: Callable[..., ArbiterNode],
) -> None:
    """A restarted agent's arbiter binds every booked container's socket anew (the old one
    died with the old agent); the container's directory mount shows the new one."""
    node = make_node()
    b = node.add("b", 2, "6Gi")
    assert b.workload is not None
    path = socket_path(b.alloc.directory)
    old = node.arbiter

    async def stop() -> None:
        await old.stop()

    node.on_loop(stop)
    assert not _listening(path)
    assert b.workload.do(f"alloc {3 * GiB}") != "granted"  # nobody answers: the shim's no

    async def start() -> Arbiter:
        arb = Arbiter(node.cfg, node.ledger, old.peers, node.socket, events=old.events, metrics=node.metrics)
        await arb.start()
        return arb

    node.arbiter = node.on_loop(start)
    assert b.workload.do(f"alloc {3 * GiB}") == "granted"
