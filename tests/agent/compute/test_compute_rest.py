"""The compute loop at rest (docs/compute.md, "What the loop costs"): a node whose shared GPUs
run nothing is polled by the driver alone, and what must still happen at once does.

The real loop's periods, driven here one by one (`tick`), on a simulated GPU shared by real
containers under the shim (bench/_compute_node.py): what wakes a GPU is the driver's samples
of its processes' work.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench._compute_node import ComputeNode
from gpufrac.memguard import abi
from tests.fixtures.polling import until

pytestmark = pytest.mark.slow

SPIN = "spin 2000 8 1 launch"


@pytest.fixture
def node() -> Iterator[ComputeNode]:
    n = ComputeNode(mode="strict", control=False)  # periods driven by the test
    yield n
    n.close()


def written_pace(node: ComputeNode, key: str) -> int:
    """The pace in the container's config, where its shim reads it."""
    alloc = node.ledger.get(key)
    assert alloc is not None
    data = (Path(alloc.directory) / abi.CONFIG_FILE).read_bytes()
    off = abi.ConfigStruct.compute_pace_ns.offset
    return int.from_bytes(data[off : off + 4], sys.byteorder)


def tick(node: ComputeNode) -> list[Any]:
    """One control period, a period's length after the last."""
    time.sleep(node.compute.interval)
    return node.run(node.compute.tick())


def tick_until(node: ComputeNode, cond: Any, what: str) -> None:
    until(lambda: (tick(node), cond())[1], timeout=120, interval=0, what=what)


def test_a_gpu_at_rest_notices_its_tenants_work_at_the_next_period(node: ComputeNode) -> None:
    """Strict 30/70, nothing running: the node rests. The 30 % container starts work: the very
    next period measures it (from the driver's samples) and paces it."""
    small, big = node.add("small", 30), node.add("big", 70)
    tick_until(node, lambda: node.compute.at_rest, "the node at rest")
    small.do(SPIN)
    until(lambda: node.busy([small])["small"] > 200_000_000, what="200 ms of its work on the GPU")
    made = {d.key: d for d in node.run(node.compute.tick())}
    assert small.key in made and made[small.key].used > 0, made
    assert made[small.key].pace_ns > 0  # over its strict share: paced at once
    assert node.figures(big).pace_ns == 0
    small.do("stop")


def test_containers_booked_or_released_at_rest_are_seen_at_the_next_period(node: ComputeNode) -> None:
    """A rest lasts several periods; a container booked meanwhile is served (its first-sight
    pace written, its figures shown) and one released is forgotten at the next."""
    node.add("a", 30)
    gone = node.add("gone", 20)
    tick_until(node, lambda: node.compute.at_rest, "the node at rest")
    late = node.add("late", 20)
    tick(node)
    assert node.figures(late) is not None

    async def release() -> None:
        node.ledger.release(gone.key)

    tick_until(node, lambda: node.compute.at_rest, "the node at rest again")
    node.run(release())
    tick(node)
    assert node.figures(gone) is None


def test_a_paced_container_gone_idle_is_unpaced_before_its_gpu_rests(node: ComputeNode) -> None:
    small = node.add("small", 30)
    node.add("big", 70)
    small.do(SPIN)
    tick_until(node, lambda: node.figures(small) is not None and node.figures(small).pace_ns > 0, "a pace")
    assert written_pace(node, small.key) > 0
    small.do("stop")
    tick_until(node, lambda: node.compute.at_rest, "the node at rest")
    assert node.figures(small).pace_ns == 0
    assert written_pace(node, small.key) == 0
