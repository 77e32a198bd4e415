"""The DRA health stream: the whole device list at once, again when a device's health
changes (not on every booking, which also calls notify()), and again every heartbeat,
since the kubelet counts a device it has not heard of for 30 s as Unknown."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import pytest

from gpufrac.dra.server import Health
from gpufrac.proto import dra_health_v1_pb2 as hpb

pytestmark = pytest.mark.unit


@dataclass(frozen=True)
class Dev:
    pool: str
    device: str
    healthy: bool
    message: str = ""


class Backend:
    def __init__(self) -> None:
        self.devices = [Dev("node-a", "gpu-0", True), Dev("node-a", "gpu-1", True)]

    async def prepare_claims(self, refs: Sequence[object]) -> dict[str, object]:
        return {}

    async def unprepare_claims(self, refs: Sequence[object]) -> dict[str, object]:
        return {}

    def device_health(self) -> Sequence[Dev]:
        return self.devices


def test_health_stream_sends_changes_and_heartbeats_not_bookings() -> None:
    async def scenario() -> None:
        backend = Backend()
        health = Health(backend, heartbeat=0.3)  # type: ignore[arg-type]
        stream = health.NodeWatchResources(hpb.NodeWatchResourcesRequest(), None)  # type: ignore[arg-type]
        first = await asyncio.wait_for(anext(stream), 1)
        assert [(d.device.device_name, d.health) for d in first.devices] == [
            ("gpu-0", hpb.HEALTHY),
            ("gpu-1", hpb.HEALTHY),
        ]
        assert health.streams == 1
        loop = asyncio.get_running_loop()
        started = loop.time()
        health.notify()  # a booking: nothing new to say
        nxt = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0.1)
        assert not nxt.done()
        backend.devices = [Dev("node-a", "gpu-0", True), Dev("node-a", "gpu-1", False, "XID 79")]
        health.notify()
        changed = await asyncio.wait_for(nxt, 1)
        assert loop.time() - started < 0.3
        assert changed.devices[1].health == hpb.UNHEALTHY and changed.devices[1].message == "XID 79"
        # Nothing changes: the same list again within the heartbeat.
        started = loop.time()
        again = await asyncio.wait_for(anext(stream), 2)
        assert 0.2 <= loop.time() - started < 1.5
        assert again.devices[1].health == hpb.UNHEALTHY
        await stream.aclose()
        assert health.streams == 0

    asyncio.run(scenario())
