"""A grant nobody uses comes back whatever its holder's usage file says.

The arbiter takes back a grant that lies unused for GRANT_STALE_AFTER (10 s). "Unused" was
judged on the larger of the container's usage file and the driver's count: a container that
kept writing total_used = request + grant into its own file kept a grant it did not use for
ever, out of every neighbour's reach. The sweep now judges on the driver's count whenever it
has a reading (gpufrac.agent.arbiter.sweep; taking back a grant costs its holder only, so the
larger-of rule for decisions that cost others does not apply).

The arbiter runs in this process on simgpu's NVML (tests/fixtures/arbiter_harness.py). The
tenant is a process in its pod's real cgroup speaking the shim's protocol on its socket; the
neighbour is the real CUDA workload under the real memguard shim.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from gpufrac.agent.arbiter.grants import GRANT_STALE_AFTER
from gpufrac.core import native
from tests.fixtures.arbiter_harness import ArbiterNode, GiB
from tests.fixtures.hostile_tenant import write_total

pytestmark = pytest.mark.security

Make = Callable[..., ArbiterNode]


def test_a_usage_counter_written_up_to_the_grant_does_not_keep_an_unused_grant(make_node: Make) -> None:
    node = make_node(resolvers=["wait"], paths={"shimHostPath": str(native.library(native.SHIM))})
    n = node.add("n", 2, "20Gi", wait_timeout="40s", start=False)
    napp = node.start_cuda(n)
    assert napp.do(f"alloc {GiB} 1") == "ok 1"  # within its request
    t = node.add("t", 2, "78Gi")
    tw = t.workload
    assert tw is not None and tw.do(f"alloc {2 * GiB}") == "fast"
    # T asks for all but 2 GiB of what may be granted, and gets it, without using any of it.
    free = node.on_loop(lambda: node.arbiter.grantable(t.alloc))
    assert tw.do(f"burst {free - 2 * GiB} {free}") == "granted"
    grant = t.config().grant_bytes
    assert grant == free - 2 * GiB
    # "I use all of it", for as long as it likes: its own file says so.
    write_total(t.alloc.directory, 2 * GiB + grant)

    # N's 6 GiB burst needs T's unused grant back: it waits for it.
    started = time.monotonic()
    assert napp.do(f"alloc {6 * GiB} 2", timeout=120) == "ok 2"
    took = time.monotonic() - started
    assert took < GRANT_STALE_AFTER + 20, took
    assert napp.do("check 2") == "ok"
    assert t.config().grant_bytes < GiB  # what the driver counts T using above its request: nothing
