"""The agent's one reader of NVML's per-process utilisation (gpufrac.agent.gpu.utilisation): what the
compute loop polls reaches the activity tracker's view, and the view polls by itself only while no
loop drives the feed. The compute loop polls every GPU that holds a container, whole GPUs too (the
idle detector of a whole-GPU container reads the same samples)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest

from gpufrac.agent.compute.loop import ComputeLoop
from gpufrac.agent.gpu.activity import ProcessSample
from gpufrac.agent.gpu.utilisation import UtilisationFeed
from gpufrac.core.config import load

pytestmark = pytest.mark.unit


@dataclass
class Source:
    """NVML's samples as a test hands them out: a list per GPU, taken by each call."""

    queued: dict[str, list[ProcessSample]] = field(default_factory=dict)
    calls: list[str] = field(default_factory=list)

    def supported(self, gpu_uuid: str) -> bool:
        return True

    def samples(self, gpu_uuid: str) -> list[ProcessSample]:
        self.calls.append(gpu_uuid)
        return self.queued.pop(gpu_uuid, [])

    def close(self) -> None:
        pass


def test_a_driven_feed_hands_each_poll_to_the_views_which_do_not_poll() -> None:
    src = Source()
    feed = UtilisationFeed(src)
    view = feed.view(threshold=5)
    feed.driven = True
    src.queued["g"] = [ProcessSample(7, 10.0, 3, 3), ProcessSample(8, 11.0, 50, 50)]
    assert [s.pid for s in feed.poll("g")] == [7, 8]
    src.queued["g"] = [ProcessSample(7, 12.0, 1, 1), ProcessSample(8, 13.0, 0, 0)]
    feed.poll("g")
    # newest sample of each; 8 was busy (at 11.0) and that outranks its newer idle one
    assert view.sampled_pids("g") == {7: (12.0, False), 8: (11.0, True)}
    assert src.calls == ["g", "g"]  # the view took what the polls read, asked nothing itself
    assert view.sampled_pids("g") == {}  # and each sample is given once


def test_an_undriven_feed_is_polled_by_its_view() -> None:
    src = Source({"g": [ProcessSample(7, 10.0, 90, 90)]})
    view = UtilisationFeed(src).view()
    assert view.sampled_pids("g") == {7: (10.0, True)}
    assert src.calls == ["g"]


@dataclass(frozen=True)
class Alloc:
    key: str
    gpus: tuple[str, ...]
    whole_gpu: bool
    request_bytes: int = 1 << 30
    directory: str = "/nonexistent"
    namespace: str | None = None
    pod: str | None = None
    pod_uid: str | None = None
    container: str | None = None


@dataclass(frozen=True)
class Geo:
    allocatable: int = 10 << 30


class Bookings:
    def __init__(self, allocs: list[Any]) -> None:
        self.allocs = allocs
        self.geometry = {g: Geo() for a in allocs for g in a.gpus}
        self.paces: dict[str, int] = {}

    def containers(self) -> list[Any]:
        return self.allocs

    def set_compute_pace(self, key: str, pace_ns: int) -> None:
        self.paces[key] = pace_ns


class NoPolicies:
    def policy(self, key: str) -> None:
        return None


class NoOwners:
    def owner(self, pod_uid: str, container_id: str) -> None:
        return None


def test_the_loop_reads_every_gpu_holding_a_container_whole_gpus_too() -> None:
    src = Source()
    feed = UtilisationFeed(src)
    bookings = Bookings([Alloc("shared", ("g0",), False), Alloc("whole", ("g1", "g2"), True)])
    loop = ComputeLoop(load(), bookings, NoPolicies(), NoOwners(), feed)  # type: ignore[arg-type]
    assert feed.driven
    asyncio.run(loop.tick())
    assert sorted(src.calls) == ["g0", "g1", "g2"]
    # the shared container's pace is written at first sight (0: an earlier agent's pace lifted)
    assert bookings.paces == {"shared": 0}
    asyncio.run(loop.close())
    assert not feed.driven
