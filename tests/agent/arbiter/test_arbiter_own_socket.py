"""Each container asks the arbiter on a socket of its own (gpufrac.agent.arbiter.listeners).

The device plugin mounts the directory of a container's own socket into it; the socket lives
as long as the booking, and only that container's processes are answered on it. At the node
cap the sockets of the containers that must wait stop accepting, and take connections again
once there is room. Real processes in real cgroups (tests/fixtures/arbiter_harness.py).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from test_arbiter_flood import start_flood

from gpufrac.agent.arbiter.fairness import OUTSIDE, Fairness
from gpufrac.agent.arbiter.listeners import socket_path
from gpufrac.agent.arbiter.server import listening_socket
from gpufrac.agent.arbiter.service import Arbiter
from gpufrac.agent.metrics.registry import Metrics
from gpufrac.core.slices import MEMORY
from gpufrac.deviceplugin.server import container_response
from gpufrac.memguard import abi
from gpufrac.simgpu.runtime import mounts_of
from tests.fixtures.arbiter_harness import ArbiterNode, GiB
from tests.fixtures.polling import listening

pytestmark = pytest.mark.security


def test_a_process_asking_on_another_containers_socket_is_refused(
    make_node: Callable[..., ArbiterNode], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="gpufrac.agent.arbiter")
    node = make_node()
    b = node.add("b", 2, "6Gi")
    a = node.add("a", 2, "6Gi", start=False)
    assert b.workload is not None
    intruder = node.start(a, socket_dir=os.path.join(b.alloc.directory, abi.SOCKET_DIR))
    assert intruder.do(f"alloc {3 * GiB}") == "refused"
    assert a.config().grant_bytes == 0 and b.config().grant_bytes == 0
    assert [r for r in caplog.records if f"asked on {b.alloc.key}'s socket" in r.getMessage()]
    # The socket's own container is served on it.
    assert b.workload.do(f"alloc {3 * GiB}") == "granted"


def test_another_pods_flood_on_a_containers_socket_is_not_charged_to_it(
    make_node: Callable[..., ArbiterNode],
) -> None:
    """A flood reaching a neighbour's socket is counted against the flooder's own container
    (held to its limits as on the node-wide socket): the neighbour's connections and request
    rate stay its own, and its bursts are granted."""
    node = make_node()
    b = node.add("b", 2, "6Gi")
    a = node.add("a", 2, "6Gi", start=False)
    assert b.workload is not None
    c = start_flood(node, a, "idle", 200, socket_of=b)
    fair = node.arbiter.fairness
    intruder = f"{a.uid}/{c.container_id}"  # its account, as the kernel names its container
    node.until(lambda: node.arbiter.stats.busy > 0, what="the intruder held to its own limit")
    assert len(fair.account(intruder).connections) > fair.max_connections
    assert not fair.account(b.alloc.key).connections
    for _ in range(5):
        assert b.workload.do(f"burst {GiB} {3 * GiB}") == "granted"
    assert not node.arbiter.sockets.listeners[b.alloc.key].paused


def test_the_node_cap_holds_across_containers_own_sockets(make_node: Callable[..., ArbiterNode]) -> None:
    """Two containers flood their own sockets past a small node cap: the agent never holds
    more than the cap, the two share it, and a third container's bursts still get in (the
    heaviest's silent connection makes room)."""
    limit, cap = 8, 10
    node = make_node(arbiterLimits={"connectionsPerContainer": limit, "maxConnections": cap})
    f1 = node.add("f1", 1, "2Gi", start=False)
    f2 = node.add("f2", 1, "2Gi", start=False)
    b = node.add("b", 2, "6Gi")
    assert b.workload is not None
    fair = node.arbiter.fairness
    start_flood(node, f1, "idle", 100)
    start_flood(node, f2, "idle", 100)
    seen: list[int] = []
    node.until(lambda: seen.append(fair.open) or len(seen) > 200, what="samples of the node's count")
    assert max(seen) <= cap, max(seen)
    held = [len(fair.account(f.alloc.key).connections) for f in (f1, f2)]
    assert all(h > 0 for h in held) and sum(held) <= cap, held
    for _ in range(3):
        assert b.workload.do(f"burst {GiB} {3 * GiB}") == "granted"
    assert fair.open <= cap


def test_two_containers_at_the_node_cap_do_not_take_the_place_from_each_other(
    make_node: Callable[..., ArbiterNode],
) -> None:
    """At an odd cap two silent floods end one connection apart: neither closes the other's
    connections for its own (which would have them accept and close without end)."""
    node = make_node(arbiterLimits={"connectionsPerContainer": 3, "maxConnections": 5})
    floods = [node.add(f"f{i}", 1, "2Gi", start=False) for i in (1, 2)]
    for f in floods:
        start_flood(node, f, "idle", 50)
    listeners = [node.arbiter.sockets.listeners[f.alloc.key] for f in floods]
    node.until(lambda: all(lst.paused for lst in listeners), what="both floods held")
    before = sum(lst.accepted for lst in listeners)
    window = node.arbiter.read_timeout  # a window to count accepts in, not a deadline
    time.sleep(window)
    # The five places change hands only as silent connections time out: at most the cap's
    # worth per read timeout, twice over; taken back and forth it would be thousands.
    assert sum(lst.accepted for lst in listeners) - before <= 2 * 5 * 2
    assert node.arbiter.fairness.open <= 5


CONNECT_AND_EXIT = """
import os, socket, sys, time
from gpufrac.memguard import wire
path = wire.socket_path(os.environ["GPUFRAC_CONTAINER_DIR"])
pid = os.fork()
if pid == 0:  # the connector: its connections outlive it, in the holder it forks
    held = []
    deadline = time.monotonic() + 30
    while len(held) < int(sys.argv[1]) and time.monotonic() < deadline:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK)
        try:
            s.connect(path)
            held.append(s)
        except OSError:  # the queue full for a moment: again
            s.close()
            time.sleep(0.001)
    if os.fork() == 0:
        time.sleep(600)
    os._exit(0)
os.waitpid(pid, 0)  # reaped: nothing of the connector is left
print("ready", flush=True)
time.sleep(600)
"""


def test_connections_whose_connector_exited_count_against_the_socket_owner(
    make_node: Callable[..., ArbiterNode],
) -> None:
    """A container cannot pass its own limit by connecting from processes that exit before
    the agent accepts (handing the sockets on): those connections are still its own."""
    node = make_node()
    f = node.add("f", 1, "2Gi", start=False)
    resp = container_response(f.alloc, node.cfg)
    c = node.runtime.start(
        f.uid,
        "main",
        [sys.executable, "-c", CONNECT_AND_EXIT, "45"],
        envs={k: v for k, v in resp.envs.items() if k != "LD_PRELOAD"},
        mounts=mounts_of(resp),
        stdout=subprocess.PIPE,
    )
    node.set_container_id(f.pod, f.uid, c.runtime_id)
    assert c.proc.stdout is not None and c.proc.stdout.readline().strip() == b"ready"
    fair = node.arbiter.fairness
    own = node.arbiter.sockets.listeners[f.alloc.key]
    # 45 connections: its limit's worth taken at once, the rest queued. The first time out (they
    # send nothing) and those queued behind them, whose connector is gone by then, are taken:
    # still counted as its own, never as nobody's.
    node.until(lambda: own.accepted > fair.max_connections, timeout=30, what="the queued connections taken")
    assert not fair.account(OUTSIDE).connections
    assert 0 < len(fair.account(f.alloc.key).connections) <= fair.max_connections


def test_a_containers_socket_lives_as_long_as_its_booking(make_node: Callable[..., ArbiterNode]) -> None:
    node = make_node()
    b = node.add("b", 2, "6Gi")
    path = socket_path(b.alloc.directory)
    assert listening(path)
    ids = list(b.alloc.device_ids)
    node.on_loop(lambda: node.ledger.release(b.alloc.key))
    node.boxes.remove(b)
    node.until(lambda: b.alloc.key not in node.arbiter.sockets.listeners, what="the socket closed")
    assert not listening(path)
    # The same devices booked again (the kubelet reuses a deleted pod's): a socket again.
    again = node.on_loop(lambda: node.ledger.allocate(MEMORY, ids))
    assert again.key == b.alloc.key
    assert listening(socket_path(again.directory))
    node.on_loop(lambda: node.ledger.release(again.key))


def test_a_socket_too_long_for_a_unix_address_is_bound_through_its_directory(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60) / abi.SOCKET_DIR
    deep.mkdir(parents=True)
    path = str(deep / abi.SOCKET_FILE)
    assert len(path) > 108
    with listening_socket(path, 1):
        assert os.stat(path).st_mode & 0o777 == 0o666  # container processes run as any uid
        # A container reaches it by a short path of its own (its mount; a link here).
        (tmp_path / "c").symlink_to(deep)
        assert listening(str(tmp_path / "c" / abi.SOCKET_FILE))
        # Bound again (a restart): the old socket file is replaced, not an error.
        with listening_socket(path, 1):
            assert listening(str(tmp_path / "c" / abi.SOCKET_FILE))


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
    assert not listening(path)
    assert b.workload.do(f"alloc {3 * GiB}") != "granted"  # nobody answers: the shim's no

    async def start() -> Arbiter:
        arb = Arbiter(
            node.cfg, node.ledger, old.peers, node.socket, events=old.resolution.events, metrics=node.metrics
        )
        await arb.start()
        return arb

    node.arbiter = node.on_loop(start)
    assert b.workload.do(f"alloc {3 * GiB}") == "granted"


def test_containers_are_served_when_the_node_wide_socket_cannot_be_bound(
    make_node: Callable[..., ArbiterNode], caplog: pytest.LogCaptureFixture
) -> None:
    """The node-wide socket is only for the agent's tools and containers an older agent
    admitted: an arbiter that cannot bind it still serves every container's own socket."""
    caplog.set_level(logging.ERROR, logger="gpufrac.agent.arbiter")
    node = make_node()
    b = node.add("b", 2, "6Gi")
    assert b.workload is not None
    old = node.arbiter

    async def restart() -> Arbiter:
        await old.stop()
        os.mkdir(node.socket)  # something in the way where the node-wide socket goes
        arb = Arbiter(
            node.cfg, node.ledger, old.peers, node.socket, events=old.resolution.events, metrics=node.metrics
        )
        await arb.start()
        return arb

    node.arbiter = node.on_loop(restart)
    assert [r for r in caplog.records if "cannot listen on the node-wide socket" in r.getMessage()]
    assert b.workload.do(f"alloc {3 * GiB}") == "granted"
