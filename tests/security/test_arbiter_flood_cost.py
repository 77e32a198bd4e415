"""A flood's held connections are answered at its limit's pace, not each once a second.

A connection past its container's connection limit is held and answered BUSY later
(gpufrac.agent.fairness). Were each answered REFUSE_DELAY after it came, a container holding
1,100 connections and reopening each as it is answered would have the agent's loop accept,
identify, answer and close about a thousand connections a second for nothing. The delay
grows with how far past its limit the container is (Fairness.refuse_delay, up to MAX_STRETCH
times), so it gets a fraction of its connections answered per REFUSE_DELAY; and its
processes' container is read from /proc once per process, not once per connection
(gpufrac.agent.knowncallers).

Real processes in real cgroups on the real socket (tests/fixtures/arbiter_harness.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from test_arbiter_flood import start_flood

from gpufrac.agent.fairness import MAX_STRETCH, REFUSE_DELAY
from tests.fixtures.arbiter_harness import ArbiterNode, GiB


def test_a_container_holding_1100_connections_is_answered_at_its_limits_pace(
    make_node: Callable[..., ArbiterNode],
) -> None:
    node = make_node()
    flood = node.add("flood", 2, "4Gi", start=False)
    b = node.add("b", 2, "6Gi")
    assert b.workload is not None
    fair = node.arbiter.fairness
    start_flood(node, flood, "idle", 1100)
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
    assert b.workload.do(f"alloc {3 * GiB}") == "granted"
