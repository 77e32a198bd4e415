"""A container's flood cannot run the agent out of file descriptors.

The node-wide connection cap (`arbiterLimits.maxConnections`, 4096) only protects the
agent if the process may open that many files: a container runtime commonly starts the
agent with a soft RLIMIT_NOFILE of 1024. Past it, accept() fails (EMFILE), the loop stops
accepting for a while, and the agent cannot open its own files either. Real processes in
real cgroups on the real socket (tests/fixtures/arbiter_harness.py), the flood from
gpufrac.simgpu.flood. Also here: a flood that holds nothing at all (connect and close,
never over a limit) but keeps the kernel's listen queue full.
"""

from __future__ import annotations

import logging
import resource
import time
from collections.abc import Callable, Iterator

import pytest
from test_arbiter_flood import start_flood

from gpufrac.agent.arbiter.fairness import FD_RESERVE, fit_fd_limit
from tests.fixtures.arbiter_harness import ArbiterNode, GiB

pytestmark = pytest.mark.security


@pytest.fixture
def soft_1024() -> Iterator[None]:
    """This process (the agent's) starts with a soft limit of 1024 files, hard limit as is."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 4096 + FD_RESERVE:
        pytest.skip(f"the hard file limit ({hard}) is too low to show the soft one raised")
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_neighbour_bursts_while_a_container_holds_more_connections_than_the_agent_may_open(
    soft_1024: None, make_node: Callable[..., ArbiterNode], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="asyncio")
    node = make_node()
    flood = node.add("flood", 2, "4Gi", start=False)
    b = node.add("b", 2, "6Gi")
    assert b.workload is not None
    # On the node-wide socket (a container an older agent admitted): on its own socket a
    # container never gets more than its connection limit accepted.
    start_flood(node, flood, "idle", 1500, shared=True)
    node.until(lambda: node.arbiter.stats.busy > 1500, what="the flood's connections held and refused")
    assert b.workload.do(f"alloc {3 * GiB}") == "granted"
    for _ in range(5):  # each a new connection while the flood keeps its own open
        assert b.workload.do(f"burst {GiB} {3 * GiB}") == "granted"
    # The agent can still open files of its own, and its loop never ran out of them.
    end = time.monotonic() + 2
    while time.monotonic() < end:
        with open("/proc/self/status", "rb") as f:
            f.read()
        time.sleep(0.01)
    assert not [r.getMessage() for r in caplog.records if "Too many open files" in str(r.exc_info or r.msg)]


@pytest.mark.parametrize(
    ("want", "soft", "hard", "new_soft", "cap"),
    [
        (4096, 1024, 1 << 20, 4096 + FD_RESERVE, 4096),  # raised: the configured cap holds
        (4096, 1 << 20, 1 << 20, 1 << 20, 4096),  # already enough: left as it is
        (4096, 1024, resource.RLIM_INFINITY, 4096 + FD_RESERVE, 4096),
        (4096, 1024, 2048, 2048, 2048 - FD_RESERVE),  # the hard limit is lower: the cap follows it
        (4096, 100, 100, 100, 1),  # at least one connection, whatever the limit
    ],
)
def test_the_node_cap_fits_the_file_limit(want: int, soft: int, hard: int, new_soft: int, cap: int) -> None:
    assert fit_fd_limit(want, soft, hard) == (new_soft, cap)


def test_a_neighbour_bursts_while_a_container_keeps_the_listen_queue_full(
    make_node: Callable[..., ArbiterNode],
) -> None:
    """Connect-and-close churn from several processes (no request, never waiting for an
    answer, a full backlog retried at once) keeps the kernel's queue full; the neighbour's
    blocking connect still gets in and its bursts are granted."""
    node = make_node()
    flood = node.add("flood", 2, "4Gi", start=False)
    b = node.add("b", 2, "6Gi")
    assert b.workload is not None
    start_flood(node, flood, "churn", 8)
    time.sleep(1)
    assert b.workload.do(f"alloc {3 * GiB}") == "granted"
    for _ in range(5):
        assert b.workload.do(f"burst {GiB} {3 * GiB}") == "granted"
