"""Requests from callers the agent cannot identify are refused without a log line each.

Anyone who reaches the socket without being a served container (a host process, a
socket kept after its connecting process exited) is refused; sent back to back, each
refusal must not become a log line of its own (hundreds a second, within the rate limit).
Real socket, real agent loop (tests/fixtures/arbiter_harness.py); this test process is in no
kubelet container.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest

from gpufrac.memguard import wire
from tests.fixtures.arbiter_harness import ArbiterNode, GiB

pytestmark = pytest.mark.security


def test_refusals_of_unidentified_callers_are_logged_once_with_a_count(
    make_node: Callable[..., ArbiterNode], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="gpufrac.agent.arbiter")
    node = make_node()
    for _ in range(50):
        rep = wire.request(node.socket, wire.BURST_OP_BURST, GiB, 3 * GiB, timeout=10)
        assert rep is not None and rep.status == wire.BURST_REFUSED
    assert node.arbiter.stats.refused == 50
    lines = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "not in a kubelet container" in lines[0]
