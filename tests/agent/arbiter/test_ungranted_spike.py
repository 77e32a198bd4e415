"""A moment's spike above the request is not taken for memory held without a grant.

A process that does not load the shim holds memory above its container's request without
asking the arbiter; a neighbour's guarantee takes that memory back by evicting it
(tests/agent/arbiter/test_ungranted.py). But a process may also go above its request for a moment
(a CUDA module loaded lazily, a scratch buffer freed at once): killing it for a spike seen on
ONE driver reading would be the arbiter's mistake. It is judged on two distinct readings
(gpufrac.agent.arbiter.readings: the smaller of the two counts), so a spike over by the second
reading costs its holder nothing, and memory held across both is still taken back.

The arbiter runs in this process on simgpu's NVML (tests/fixtures/arbiter_harness.py); the
holder is the real CUDA workload without the shim, in its pod's real cgroup. The spike is
timed against the arbiter's NVML readings: it begins just before the reclaim's first
reading, and (in the first test) ends just before the next one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

import pytest

from gpufrac.agent.arbiter.admission import reclaim_guarantee
from gpufrac.agent.arbiter.readings import MemoryReading
from gpufrac.simgpu.workload import WorkloadProcess
from tests.fixtures.arbiter_harness import ArbiterNode, Box, GiB

pytestmark = pytest.mark.security

Make = Callable[..., ArbiterNode]


def reclaim_with_spike(node: ArbiterNode, hog: WorkloadProcess, b: Box, *, spike_ends: bool) -> int:
    """b's guarantee reclaimed while `hog` spikes 20 GiB above its container's request: the
    spike begins just before the arbiter's first NVML reading and, if `spike_ends`, is freed
    just before its next one. What is still missing of b's request (-1: no NVML reading)."""
    readings = node.arbiter.readings
    real: Callable[[], Mapping[str, MemoryReading]] = readings.read_memory
    seen: list[int] = []

    def read_memory() -> Mapping[str, MemoryReading]:
        if not seen:
            assert hog.do(f"alloc {20 * GiB} 2") == "ok 2"
        elif len(seen) == 1 and spike_ends:
            assert hog.do("free 2") == "ok"
        seen.append(1)
        return real()

    async def reclaim() -> int:
        readings.read_memory = read_memory
        try:
            await node.arbiter.resolution.refresh_memory()  # as admission does before it reclaims
            deadline = asyncio.get_running_loop().time() + 10
            left = await reclaim_guarantee(node.arbiter.resolution, b.alloc, node.gpu, deadline)
            return -1 if left is None else left
        finally:
            readings.read_memory = real

    return asyncio.run_coroutine_threadsafe(reclaim(), node.lt.loop).result(60)


def setup(make_node: Make) -> tuple[ArbiterNode, WorkloadProcess, Box]:
    node = make_node(resolvers=["evict", "wait"])
    a = node.add("a", 10, "70Gi", start=False)  # request 10 GiB, may hold up to 70 GiB
    hog = node.start_cuda(a, shim=False)
    assert hog.do(f"alloc {5 * GiB} 1") == "ok 1"  # within its request
    # b's 60 GiB are physically free only while a holds no more than about its request.
    b = node.add("b", 60, start=False)
    return node, hog, b


def test_a_holder_above_its_request_for_one_reading_only_is_not_evicted(make_node: Make) -> None:
    node, hog, b = setup(make_node)
    assert reclaim_with_spike(node, hog, b, spike_ends=True) == 0  # the guarantee is free
    assert hog.proc.poll() is None, "a moment's spike got its process evicted"
    assert hog.do("check 1") == "ok"


def test_a_holder_above_its_request_on_two_readings_is_still_evicted_for_a_guarantee(make_node: Make) -> None:
    node, hog, b = setup(make_node)
    assert reclaim_with_spike(node, hog, b, spike_ends=False) == 0  # taken back
    assert hog.proc.wait(30) == -9
