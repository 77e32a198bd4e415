"""What a flood of connections costs the agent's loop: about its limit's worth, not each one.

On its own socket (gpufrac.agent.arbiter.listeners) a container holding its connection limit
has nothing more accepted: its further connections wait in the kernel's listen queue, then
fail to connect (EAGAIN) or wait in connect(), and the agent's loop does no work for them
until one of the connections it holds closes (here: after the read timeout, sent nothing).

On the node-wide socket (containers an older agent admitted) a connection past its
container's connection limit is held and answered BUSY later (gpufrac.agent.arbiter.fairness). Were
each answered REFUSE_DELAY after it came, a container holding 1,100 connections and reopening
each as it is answered would have the agent's loop accept, identify, answer and close about
a thousand connections a second for nothing. The delay grows with how far past its limit the
container is (Fairness.refuse_delay, up to MAX_STRETCH times), so it gets a fraction of its
connections answered per REFUSE_DELAY; and its processes' container is read from /proc once
per process, not once per connection (gpufrac.agent.processes.knowncallers).

Real processes in real cgroups on the real socket (tests/fixtures/arbiter_harness.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from test_arbiter_flood import start_flood

from gpufrac.agent.arbiter.fairness import MAX_STRETCH, REFUSE_DELAY
from tests.fixtures.arbiter_harness import ArbiterNode, Box, GiB, Workload

pytestmark = pytest.mark.security


def flooder_and_neighbour(make_node: Callable[..., ArbiterNode]) -> tuple[ArbiterNode, Box, Workload]:
    """A node with a container to flood from (not started) and a neighbour running."""
    node = make_node()
    flood = node.add("flood", 2, "4Gi", start=False)
    b = node.add("b", 2, "6Gi")
    assert b.workload is not None
    return node, flood, b.workload


def test_a_container_holding_1100_connections_on_its_own_socket_has_only_its_limit_accepted(
    make_node: Callable[..., ArbiterNode],
) -> None:
    node, flood, neighbour = flooder_and_neighbour(make_node)
    limit = node.cfg.arbiter_limits.connections_per_container
    start_flood(node, flood, "idle", 1100)
    own = node.arbiter.sockets.listeners[flood.alloc.key]
    node.until(lambda: own.paused, what="the flooder's socket not accepting")
    before = own.accepted
    window = 3 * node.arbiter.read_timeout  # a window to count accepts in, not a deadline
    time.sleep(window)
    accepted = own.accepted - before
    # It holds `limit` connections, each dropped after the read timeout (it sends nothing) and
    # replaced from the queue: about `limit` accepts per read timeout, some 96 here; taking
    # every connection it tries would be thousands.
    assert accepted <= limit * (window / node.arbiter.read_timeout + 2), accepted
    assert len(node.arbiter.fairness.account(flood.alloc.key).connections) <= limit
    # None of its connections was read from /proc to be counted: the socket says whose it is.
    assert node.arbiter.fairness.known.misses <= 2, node.arbiter.fairness.known.misses
    # Its neighbour's burst is still granted, on a new connection.
    assert neighbour.do(f"alloc {3 * GiB}") == "granted"


def test_a_container_holding_1100_connections_on_the_shared_socket_is_answered_at_its_limits_pace(
    make_node: Callable[..., ArbiterNode],
) -> None:
    node, flood, neighbour = flooder_and_neighbour(make_node)
    fair = node.arbiter.fairness
    start_flood(node, flood, "idle", 1100, shared=True)
    node.until(lambda: node.arbiter.stats.busy > 0, what="the flooder told BUSY")
    before = node.arbiter.stats.busy
    time.sleep(4 * REFUSE_DELAY)  # a window to count answers in, not a deadline
    answered = node.arbiter.stats.busy - before
    # About a tenth of its 1,068 held connections per REFUSE_DELAY (MAX_STRETCH), some 430
    # here; one per held connection per REFUSE_DELAY would be over 4,000.
    assert answered <= 4 * 1100 * 2 / MAX_STRETCH, answered
    # The flooder's connections came from one process: its container was read once or so.
    assert fair.known.hits > 10 * fair.known.misses, (fair.known.hits, fair.known.misses)
    # Its neighbour's burst is still granted, on a new connection.
    assert neighbour.do(f"alloc {3 * GiB}") == "granted"


def test_connect_and_close_churn_is_charged_to_its_container_from_the_accept(
    make_node: Callable[..., ArbiterNode],
) -> None:
    """Four processes connect and close as fast as the kernel lets them, never sending a request.
    Each connection is charged a token of the container's rate at its accept: past it, its socket
    is not accepted from until the next token, so the agent takes about `requestsPerSecond` of
    them a second (each an accept, an identity lookup and a task), not every one it tries."""
    rate = 50
    node = make_node(arbiterLimits={"requestsPerSecond": rate, "requestBurst": rate})
    flood = node.add("flood", 2, "4Gi", start=False)
    b = node.add("b", 2, "6Gi")
    assert b.workload is not None
    start_flood(node, flood, "churn", 4)
    own = node.arbiter.sockets.listeners[flood.alloc.key]
    node.until(lambda: own.accepted > rate, what="the churn under way")
    before = own.accepted
    window = 2.0  # a window to count accepts in, not a deadline
    time.sleep(window)
    accepted = own.accepted - before
    # About `rate` a second once its bucket is empty (100 here); without the charge, thousands.
    assert accepted <= rate * (window + 1), accepted
    assert own.slowed > 0
    # Its neighbour's bursts are granted meanwhile, each on a new connection.
    assert b.workload.do(f"alloc {3 * GiB}") == "granted"
    for _ in range(3):
        assert b.workload.do(f"burst {GiB} {3 * GiB}") == "granted"
