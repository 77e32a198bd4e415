"""Breaking its own usage file shields a container from nothing.

The usage file is the tenant's to write. One it cannot read (a bad magic, a short file) must
not take the container out of what the arbiter weighs when it reclaims memory for someone
else: the agent then counts it from the driver (NVML's per-process memory), or as holding all
it may, and as idle (arbiter/context.py Resolution.holdings).

One 1 GiB GPU (960 MiB allocatable, 64 MiB units); the real agent, real shim, real workload
processes (tests/fixtures/e2e.py). Node resolvers: wait only; lendUnusedRequests on.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from gpufrac.agent.kube.events import REASON_EVICTED
from tests.fixtures.e2e import E2ENode, MiB
from tests.fixtures.hostile_tenant import agent_alive, agent_config, break_magic
from tests.fixtures.polling import until

pytestmark = pytest.mark.security

MakeNode = Callable[..., E2ENode]


def test_a_borrower_that_breaks_its_usage_file_still_gives_a_guarantee_back(e2e_node: MakeNode) -> None:
    node = e2e_node(**agent_config(lendUnusedRequests=True))  # resolvers: [wait]
    b = node.run_pod("b", 8, None, wait_timeout="30s")  # 512 MiB request
    assert b.alloc(32 * MiB, 1) == "ok 1"  # b uses little of it: the rest may be lent
    a = node.run_pod("a", 2, "896Mi", wait_timeout="0s")  # request 128 MiB
    assert a.alloc(100 * MiB, 1) == "ok 1"
    assert a.alloc(600 * MiB, 2) == "ok 2"  # a burst borrowing most of b's unused guarantee
    assert a.grant() > 500 * MiB
    break_magic(a.host_dir)  # "the agent cannot see me"
    # b allocates up to its request: the driver has not the memory, its shim sends RECLAIM.
    assert b.alloc(448 * MiB, 2) == "ok 2"
    assert b.app.do("check 1") == "ok" and b.app.do("check 2") == "ok"
    until(lambda: not a.alive(), what="a's burst taken back")
    assert node.events(a, REASON_EVICTED)
    assert agent_alive(node)
