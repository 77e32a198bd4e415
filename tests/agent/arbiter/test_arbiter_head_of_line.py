"""A request that cannot be served holds back a neighbour's burst that fits only for a bound.

Requests on a GPU are served by priority, then arrival. A tenant may set its pod's
`gpufrac.dev/wait-timeout` to anything the shim can hold (about 49.7 days), ask for a burst
the GPU cannot give, and keep its one connection open: under every fairness limit, its
request heads the GPU's queue for as long as it likes. In strict order, a neighbour's burst
of equal priority that fits waited behind it until its own deadline and was DENIED, and no
resolver did anything for it (it needs nothing freed). Now a waiter holds back a request
that fits for at most the node's headOfLineBound (default 1 s) from that request's arrival,
however long the waiter may wait itself (gpufrac.agent.arbiter.queue.WaitQueue.ahead).

The arbiter runs in this process on simgpu's NVML (tests/fixtures/arbiter_harness.py); both
tenants are the real CUDA workload under the real memguard shim, in their pods' real cgroups.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from gpufrac.core import native
from tests.fixtures.arbiter_harness import ArbiterNode, GiB

pytestmark = pytest.mark.security

Make = Callable[..., ArbiterNode]

BOUND = 1.0  # headOfLineBound, the node config's default
# What the test allows on top of the bound: one NVML poll of the waiting request (0.1 s), the
# shim's round trips and a busy 2-core machine. A request held in strict order waits its whole
# wait timeout (15 s here).
SLACK = 4.0


def waiters(node: ArbiterNode) -> int:
    return sum(len(v) for v in node.arbiter.queue.waiters.values())


def test_a_burst_that_fits_is_granted_within_the_bound_behind_one_that_cannot_be_served(
    make_node: Make,
) -> None:
    node = make_node(resolvers=["evict", "wait"], paths={"shimHostPath": str(native.library(native.SHIM))})
    assert node.cfg.head_of_line_bound == BOUND
    filler = node.add("filler", 30, "78Gi", priority=1000, preemptible=False)
    t = node.add("t", 2, "20Gi", wait_timeout="1h", start=False)
    n = node.add("n", 2, "20Gi", wait_timeout="15s", start=False)
    tapp, napp = node.start_cuda(t), node.start_cuda(n)
    assert napp.do(f"alloc {GiB} 1") == "ok 1"  # within its request
    # Something holds all but 6 GiB of what may be granted on the GPU (a non-preemptible,
    # higher-priority burst: no resolver frees any of it).
    free = node.on_loop(lambda: node.arbiter.grantable(filler.alloc))
    fw = filler.workload
    assert fw is not None and fw.do(f"alloc {filler.alloc.request_bytes}") == "fast"
    assert fw.do(f"alloc {free - 6 * GiB}") == "granted"

    # T asks for 10 GiB that cannot be had, and waits: up to an hour, one connection.
    tapp.send(f"alloc {10 * GiB} 1")
    node.until(lambda: waiters(node) == 1, what="t's burst waiting")

    # N, same priority, later: its 2 GiB burst fits.
    started = time.monotonic()
    assert napp.do(f"alloc {2 * GiB} 2") == "ok 2"
    took = time.monotonic() - started
    assert took < BOUND + SLACK, f"n's fitting burst waited {took:.1f}s behind t's"
    assert napp.do("check 2") == "ok"
    assert n.config().grant_bytes > GiB  # what it holds past its 2 GiB request
    # T keeps its place and gets nothing it cannot have.
    assert waiters(node) == 1 and t.config().grant_bytes == 0
    assert tapp.proc.poll() is None
    # Memory freed goes to the head first: once 10 GiB can be had, T gets them.
    assert fw.do(f"free {8 * GiB}") == "granted"
    assert tapp.line().startswith("ok ")
    assert t.config().grant_bytes > 8 * GiB  # 10 GiB above what it held within its request
