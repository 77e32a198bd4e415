"""One container floods the arbiter socket; its neighbour's burst is still granted.

Real processes in real cgroups on the real socket (tests/fixtures/arbiter_harness.py): the
flooder is gpufrac.simgpu.flood in its own container, the neighbour the stand-in
workload in another. Limits: gpufrac.agent.arbiter.fairness, docs/arbiter-protocol.md. A flood
runs on the flooder's own socket (gpufrac.agent.arbiter.listeners), as the device plugin
mounts it, or with shared=True on the node-wide socket, as a container admitted by an
older agent has it.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpufrac.agent.arbiter.fairness import Fairness
from gpufrac.agent.metrics.registry import Metrics
from gpufrac.core import native
from gpufrac.core.config import arbiter_socket_dir
from gpufrac.deviceplugin.server import container_response
from gpufrac.memguard import abi, wire
from gpufrac.simgpu.runtime import Container, mounts_of
from tests.fixtures.arbiter_harness import ArbiterNode, Box, GiB, socket_mounted

pytestmark = pytest.mark.security


def start_flood(
    node: ArbiterNode,
    box: Box,
    mode: str,
    n: int,
    *extra: int,
    shared: bool = False,
    socket_of: Box | None = None,
) -> Container:
    """box's container runs the flood (gpufrac.simgpu.flood); returns once it is under way.
    shared: on the node-wide socket (an older agent's mount), not the container's own;
    socket_of: on that container's socket (a mount gone wrong, a hostPath)."""
    resp = container_response(box.alloc, node.cfg)
    mounts = mounts_of(resp)
    if shared:
        mounts = socket_mounted(mounts, arbiter_socket_dir(node.cfg))
    elif socket_of is not None:
        mounts = socket_mounted(mounts, os.path.join(socket_of.alloc.directory, abi.SOCKET_DIR))
    c = node.runtime.start(
        box.uid,
        "main",
        [sys.executable, "-m", "gpufrac.simgpu.flood", mode, str(n), *map(str, extra)],
        envs={k: v for k, v in resp.envs.items() if k != "LD_PRELOAD"},
        mounts=mounts,
        stdout=subprocess.PIPE,
    )
    box.container = c
    node.set_container_id(box.pod, box.uid, c.runtime_id)
    assert c.proc.stdout is not None
    line = c.proc.stdout.readline().decode().strip()
    assert line == "ready", f"flood {mode} did not start: {line!r}"
    # Keep its report lines flowing (a full pipe would stop it).
    threading.Thread(target=c.proc.stdout.read, daemon=True).start()
    return c


def limit_lines(caplog: pytest.LogCaptureFixture, box: Box, limit: str) -> list[str]:
    """The log lines saying box's container is over `limit`: named by its pod on its own
    socket, by its pod UID (from its cgroup) on the node-wide one."""
    return [
        r.getMessage()
        for r in caplog.records
        if f"over its {limit} limit" in r.getMessage()
        and (box.uid in r.getMessage() or f"pod default/{box.pod} container" in r.getMessage())
    ]


@pytest.fixture
def node(make_node: Callable[..., ArbiterNode]) -> ArbiterNode:
    return make_node()


@pytest.mark.parametrize(("mode", "shared"), [("idle", False), ("slow", False), ("idle", True)])
def test_a_neighbour_bursts_while_a_container_holds_1100_connections(
    node: ArbiterNode, mode: str, shared: bool, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="gpufrac.agent.arbiter.fairness")
    flood = node.add("flood", 2, "4Gi", start=False)
    b = node.add("b", 2, "6Gi")
    assert b.workload is not None
    start_flood(node, flood, mode, 1100, shared=shared)
    # Each of these is a new connection while the flooder holds (and keeps reopening) its own.
    assert b.workload.do(f"alloc {3 * GiB}") == "granted"
    for _ in range(5):  # each a new connection: the grant is there already, the answer must come
        assert b.workload.do(f"burst {GiB} {3 * GiB}") == "granted"
    # The flooder was held to its own share (on its own socket: the agent stopped taking its
    # connections; on the shared one: those past its share were answered BUSY), and this was
    # said in one log line, not one per refusal.
    if shared:
        node.until(lambda: node.arbiter.stats.busy > 0, what="the flooder told BUSY")
    else:
        own = node.arbiter.sockets.listeners[flood.alloc.key]
        node.until(lambda: own.paused, what="the flooder's socket not accepting")
        assert (
            len(node.arbiter.fairness.account(flood.alloc.key).connections)
            <= node.cfg.arbiter_limits.connections_per_container
        )
    assert len(limit_lines(caplog, flood, "connections")) == 1
    assert not limit_lines(caplog, b, "connections")


def test_a_neighbour_bursts_while_a_container_sends_requests_back_to_back(
    make_node: Callable[..., ArbiterNode], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="gpufrac.agent.arbiter.fairness")
    node = make_node(arbiterLimits={"requestsPerSecond": 20, "requestBurst": 20})
    flood = node.add("flood", 2, "4Gi", start=False)
    b = node.add("b", 2, "6Gi")
    assert b.workload is not None
    start_flood(node, flood, "rate", 4)
    own = node.arbiter.sockets.listeners[flood.alloc.key]
    # Past its rate its connections wait at the accept (Fairness.token_wait), each charged.
    node.until(lambda: own.slowed > 20, what="the flood to be slowed at accept")
    assert b.workload.do(f"alloc {3 * GiB}") == "granted"
    for _ in range(5):  # under its own limit, whatever the flooder does
        assert b.workload.do(f"burst {GiB} {3 * GiB}") == "granted"
    assert len(limit_lines(caplog, flood, "rate")) == 1
    assert not limit_lines(caplog, b, "rate")


@pytest.mark.parametrize("shared", [False, True])
def test_requests_over_the_rate_are_not_decided(make_node: Callable[..., ArbiterNode], shared: bool) -> None:
    """Three requests within the bucket are decided (granted). Past it, on the container's own
    socket its next connection is not accepted until the bucket has a token (a thousand seconds
    here): the request is never read, and the caller hears nothing by its timeout (the shim's
    no). On the node-wide socket, where every connection is accepted to be counted, it is
    answered BUSY without being read. Either way: no grant."""
    node = make_node(arbiterLimits={"requestsPerSecond": 0.001, "requestBurst": 3})
    # No wait: the caller gives up arbiterTimeout (2 s) after its send.
    a = node.add("a", 2, "6Gi", wait_timeout="0s", start=False)
    w = node.start(a, arbiter_socket_dir(node.cfg) if shared else None)
    answers = [w.do(f"burst {GiB} {3 * GiB}") for _ in range(3 if shared else 4)]
    if shared:
        answers += [w.do(f"burst {GiB} {3 * GiB}") for _ in range(2)]
        assert answers == ["granted"] * 3 + ["busy"] * 2
    else:
        assert answers == ["granted"] * 3 + ["none"]
        own = node.arbiter.sockets.listeners[a.alloc.key]
        assert own.paused and own.slowed >= 1 and own.accepted == 3
    assert a.config().grant_bytes == GiB
    b = node.add("b", 2, "6Gi")
    assert b.workload is not None and b.workload.do(f"alloc {3 * GiB}") == "granted"


def test_the_shim_takes_busy_for_a_no(make_node: Callable[..., ArbiterNode]) -> None:
    """The real shim over the fake driver: an allocation whose burst request is answered BUSY
    fails with CUDA_ERROR_OUT_OF_MEMORY and raises no grant."""
    node = make_node(
        arbiterLimits={"requestsPerSecond": 0.001, "requestBurst": 1},
        paths={"shimHostPath": str(native.library(native.SHIM))},
    )
    a = node.add("a", 2, "8Gi", start=False)
    # On the node-wide socket, where a connection past the rate is answered BUSY (on its own
    # socket it would not be accepted until a token came, and the shim would give up).
    app = node.start_cuda(a, socket_dir=arbiter_socket_dir(node.cfg))
    assert app.do(f"alloc {GiB} 1").startswith("ok ")  # within the request: no agent
    assert app.do(f"alloc {3 * GiB} 2").startswith("ok ")  # a burst: the one request of the bucket
    grant = a.config().grant_bytes
    assert grant > 0
    assert app.do(f"alloc {GiB} 3") == "oom"  # a burst past the rate: BUSY, a no
    assert a.config().grant_bytes == grant
    assert node.arbiter.stats.busy == 1


def test_a_container_gets_no_more_requests_decided_at_once_than_its_inflight_limit(
    make_node: Callable[..., ArbiterNode],
) -> None:
    node = make_node(arbiterLimits={"inflightPerContainer": 2})
    node.add("hog", 60)  # booked: a burst of 70 GiB cannot fit the pool and waits
    flood = node.add("flood", 2, "72Gi", wait_timeout="60s", start=False)
    start_flood(node, flood, "rate", 6, 70 * GiB)

    def flood_waiters() -> int:
        return sum(
            1
            for ws in node.arbiter.queue.waiters.values()
            for w in ws
            if w.need.requester.key == flood.alloc.key
        )

    seen: list[int] = []
    node.until(lambda: node.arbiter.stats.busy >= 20 and not seen.append(flood_waiters()), what="refusals")
    assert max(seen) <= 2 and flood_waiters() == 2
    # A neighbour of higher priority is served at once (it ranks ahead of the queue).
    b = node.add("b", 2, "6Gi", priority=10)
    assert b.workload is not None and b.workload.do(f"alloc {3 * GiB}") == "granted"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(junk=st.lists(st.binary(min_size=0, max_size=120), min_size=1, max_size=4))
def test_random_bytes_on_the_socket_get_a_clean_answer_or_a_close(
    node: ArbiterNode, junk: list[bytes]
) -> None:
    """Whatever arrives, the connection is answered (a whole 16-byte reply) or closed, and the
    agent keeps serving a container's burst."""
    if not hasattr(node, "_fuzz_box"):
        node._fuzz_box = node.add("fz", 2, "6Gi")  # type: ignore[attr-defined]
    box: Box = node._fuzz_box  # type: ignore[attr-defined]
    for chunk in junk:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(10)
            s.connect(node.socket)
            try:
                s.sendall(chunk)
                s.shutdown(socket.SHUT_WR)
                data = b""
                while chunk := s.recv(64):
                    data += chunk
            except OSError:
                data = b""
            assert len(data) in (0, ctypes_sizeof_reply()), data
            if data:
                rep = wire.BurstReply.from_buffer_copy(data)
                assert rep.magic == wire.BURST_MAGIC and rep.status != wire.BURST_GRANTED
    assert box.workload is not None
    assert box.workload.do(f"burst {GiB} {3 * GiB}") == "granted"


def ctypes_sizeof_reply() -> int:
    import ctypes

    return ctypes.sizeof(wire.BurstReply)


def test_at_the_node_cap_the_container_holding_the_most_connections_makes_room() -> None:
    fair = Fairness(connections=5, inflight=1, rate=1000.0, burst=100, node_connections=6, metrics=Metrics())
    flood = [SimpleNamespace(op=None) for _ in range(5)]
    for c in flood:
        acc, victim, over = fair.admit(c, "flood")
        assert acc is not None and victim is None and not over
    first = SimpleNamespace(op=None)
    assert fair.admit(first, "b")[0] is not None  # the sixth connection: the node is full now
    # A neighbour's next connection: the flooder's newest one that sent nothing is closed for it.
    acc, victim, over = fair.admit(SimpleNamespace(op=None), "b")
    assert acc is not None and victim is flood[-1] and not over
    fair.gone(fair.accounts["flood"], victim)
    # The node is full and the flooder holds the most: its next one is refused at once.
    acc, victim, over = fair.admit(SimpleNamespace(op=None), "flood")
    assert acc is None and victim is None
