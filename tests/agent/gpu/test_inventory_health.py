"""GPU health from NVML: XID events injected into the simulated node make a GPU
Unhealthy; it recovers after the configured window, and a GPU that fell off the
bus stays Unhealthy until it answers again. Real nvidia-ml-py, fake driver."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import pytest

from gpufrac.agent.gpu.health import HealthChange, HealthMonitor
from gpufrac.agent.gpu.inventory import read_inventory
from gpufrac.core.config import HealthConfig
from gpufrac.simgpu import faults

if TYPE_CHECKING:
    from tests.conftest import SimNode

DEADLINE_S = 60.0  # generous: a loaded 2-core box


class FakeClock:
    def __init__(self) -> None:
        self.t = 1_800_000_000.0

    def __call__(self) -> float:
        return self.t


def poll_until(monitor: HealthMonitor, done: Callable[[], bool], what: str) -> list[HealthChange]:
    """Poll (each call waits up to 200 ms for events) until `done`, collecting changes."""
    changes: list[HealthChange] = []
    deadline = time.monotonic() + DEADLINE_S
    while not done():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        changes += monitor.poll(200)
    return changes


@pytest.fixture
def uuids(in_process_nvml: SimNode) -> list[str]:
    return [g.uuid for g in read_inventory().gpus]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def _monitor(clock: Callable[[], float], **cfg: object) -> HealthMonitor:
    return HealthMonitor(HealthConfig(**cfg), read_inventory().gpus, clock=clock)  # type: ignore[arg-type]


def test_all_gpus_start_healthy(in_process_nvml: SimNode, uuids: list[str], clock: FakeClock) -> None:
    with _monitor(clock) as m:
        assert m.poll(0) == []
        assert set(m.current()) == set(uuids)
        assert all(h.healthy and h.reason == "" for h in m.current().values())
    # Without an inventory it watches every GPU NVML reports.
    with HealthMonitor(HealthConfig(), clock=clock) as m:
        assert m.poll(0) == []
        assert set(m.current()) == set(uuids)


def test_xid_makes_the_gpu_unhealthy_until_the_recovery_window_passes(
    in_process_nvml: SimNode, uuids: list[str], clock: FakeClock
) -> None:
    with _monitor(clock, xid_recovery=300.0) as m:
        m.poll(0)
        faults.inject_xid(in_process_nvml.path, 2, xid=79)
        changes = poll_until(m, lambda: not m.current()[uuids[2]].healthy, "GPU 2 to turn Unhealthy")
        assert [(c.index, c.uuid, c.health.healthy) for c in changes] == [(2, uuids[2], False)]
        assert "XID 79" in m.current()[uuids[2]].reason
        assert all(m.current()[u].healthy for i, u in enumerate(uuids) if i != 2)

        clock.t += 299.0
        assert m.poll(0) == []
        assert not m.current()[uuids[2]].healthy

        clock.t += 2.0
        changes = m.poll(0)
        assert [(c.uuid, c.health.healthy, c.health.reason) for c in changes] == [(uuids[2], True, "")]
        assert m.current()[uuids[2]].healthy
        assert m.current()[uuids[2]].since == clock.t


def test_next_change_in_says_when_an_xid_window_closes(
    in_process_nvml: SimNode, uuids: list[str], clock: FakeClock
) -> None:
    """The agent's health loop wakes when a GPU may turn Healthy again, not a poll later."""
    with _monitor(clock, xid_recovery=300.0) as m:
        assert m.next_change_in() is None
        faults.inject_xid(in_process_nvml.path, 1, xid=79)
        poll_until(m, lambda: not m.current()[uuids[1]].healthy, "the XID")
        assert m.next_change_in() == pytest.approx(300.0)
        clock.t += 100.0
        assert m.next_change_in() == pytest.approx(200.0)
        clock.t += 201.0
        m.poll(0)
        assert m.current()[uuids[1]].healthy
        assert m.next_change_in() is None


def test_a_new_xid_restarts_the_recovery_window(
    in_process_nvml: SimNode, uuids: list[str], clock: FakeClock
) -> None:
    with _monitor(clock, xid_recovery=100.0) as m:
        faults.inject_xid(in_process_nvml.path, 0, xid=48)
        poll_until(m, lambda: not m.current()[uuids[0]].healthy, "the first XID")
        clock.t += 90.0
        faults.inject_xid(in_process_nvml.path, 0, xid=94)
        poll_until(m, lambda: "XID 94" in m.current()[uuids[0]].reason, "the second XID")
        clock.t += 90.0  # 180 s after the first XID, 90 s after the second
        m.poll(0)
        assert not m.current()[uuids[0]].healthy
        clock.t += 11.0
        m.poll(0)
        assert m.current()[uuids[0]].healthy


@pytest.mark.parametrize(
    ("ignored", "xid"),
    [
        ([13, 31, 43, 45, 68, 109], 13),  # the default list: an application's own fault
        ([13, 31, 43, 45, 68, 109], 43),
        ([79], 79),  # the list is the config's, not built in
    ],
)
def test_ignored_xids_leave_the_gpu_healthy(
    in_process_nvml: SimNode, uuids: list[str], clock: FakeClock, ignored: list[int], xid: int
) -> None:
    with _monitor(clock, ignored_xids=ignored) as m:
        faults.inject_xid(in_process_nvml.path, 1, xid=xid)
        # The XID is counted once it has been read, so we know the monitor saw it.
        changes = poll_until(m, lambda: m.xid_counts().get((uuids[1], xid)) == 1, f"XID {xid} to be seen")
        assert changes == []
        assert m.current()[uuids[1]].healthy


def test_an_xid_not_in_the_ignored_list_counts(
    in_process_nvml: SimNode, uuids: list[str], clock: FakeClock
) -> None:
    with _monitor(clock, ignored_xids=[79]) as m:
        faults.inject_xid(in_process_nvml.path, 1, xid=13)
        poll_until(m, lambda: not m.current()[uuids[1]].healthy, "XID 13 to count")
        assert "XID 13" in m.current()[uuids[1]].reason


def test_a_gpu_off_the_bus_is_unhealthy_until_restored(
    in_process_nvml: SimNode, uuids: list[str], clock: FakeClock
) -> None:
    with _monitor(clock, xid_recovery=60.0) as m:
        faults.fall_off_bus(in_process_nvml.path, 3)
        changes = m.poll(0)
        assert [(c.index, c.health.healthy) for c in changes] == [(3, False)]
        assert "fell off the bus" in m.current()[uuids[3]].reason
        clock.t += 3600.0  # no recovery window applies to a lost GPU
        assert m.poll(0) == []
        assert not m.current()[uuids[3]].healthy

        faults.restore_gpu(in_process_nvml.path, 3)
        changes = m.poll(0)
        assert [(c.index, c.health.healthy) for c in changes] == [(3, True)]
        assert all(h.healthy for h in m.current().values())


def test_a_restored_gpu_still_waits_out_its_xid_window(
    in_process_nvml: SimNode, uuids: list[str], clock: FakeClock
) -> None:
    with _monitor(clock, xid_recovery=60.0) as m:
        faults.inject_xid(in_process_nvml.path, 4, xid=79)
        poll_until(m, lambda: not m.current()[uuids[4]].healthy, "the XID")
        faults.fall_off_bus(in_process_nvml.path, 4)
        m.poll(0)
        assert "fell off the bus" in m.current()[uuids[4]].reason
        faults.restore_gpu(in_process_nvml.path, 4)
        m.poll(0)
        assert "XID 79" in m.current()[uuids[4]].reason
        clock.t += 61.0
        m.poll(0)
        assert m.current()[uuids[4]].healthy


def test_recovery_with_the_real_clock(in_process_nvml: SimNode, uuids: list[str]) -> None:
    """The default clock: a short configured window passes in real time."""
    with HealthMonitor(HealthConfig(xid_recovery=0.5), read_inventory().gpus) as m:
        faults.inject_xid(in_process_nvml.path, 5, xid=62)
        poll_until(m, lambda: not m.current()[uuids[5]].healthy, "the XID")
        poll_until(m, lambda: m.current()[uuids[5]].healthy, "recovery after 0.5 s")


def test_poll_after_close_is_refused(in_process_nvml: SimNode, clock: FakeClock) -> None:
    m = _monitor(clock)
    m.close()
    m.close()  # idempotent
    with pytest.raises(RuntimeError, match="after close"):
        m.poll(0)


def test_the_agent_pattern_poll_in_a_worker_thread(in_process_nvml: SimNode, uuids: list[str]) -> None:
    """As the agent runs it: blocking NVML calls via asyncio.to_thread, state read on the loop."""

    async def main() -> list[HealthChange]:
        inv = await asyncio.to_thread(read_inventory)
        monitor = await asyncio.to_thread(HealthMonitor, HealthConfig(), inv.gpus)
        try:
            faults.inject_xid(in_process_nvml.path, 7, xid=79)
            changes: list[HealthChange] = []
            deadline = time.monotonic() + DEADLINE_S
            while monitor.current()[uuids[7]].healthy:
                assert time.monotonic() < deadline, "XID not seen"
                changes += await asyncio.to_thread(monitor.poll, 200)
            return changes
        finally:
            await asyncio.to_thread(monitor.close)

    changes = asyncio.run(main())
    assert [(c.index, c.health.healthy) for c in changes] == [(7, False)]


def test_close_waits_for_a_poll_in_progress(in_process_nvml: SimNode, clock: FakeClock) -> None:
    """Freeing the event set under a waiting nvmlEventSetWait would be a use-after-free."""
    m = _monitor(clock)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(m.poll, 1500)
        while not m._lock.locked() and not waiting.done():
            time.sleep(0.001)
        m.close()
        assert waiting.done()
        assert waiting.result() == []


def test_an_event_wait_that_keeps_failing_at_once_still_paces_the_poll(
    in_process_nvml: SimNode, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A driver whose event wait fails straight away (not a timeout) every time: poll still
    takes its timeout, so the agent's health loop does not spin on NVML."""
    import pynvml

    def failing(event_set: object, timeout_ms: int) -> object:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)

    with _monitor(clock) as m:
        monkeypatch.setattr(pynvml, "nvmlEventSetWait", failing)
        start = time.monotonic()
        for _ in range(3):
            assert m.poll(100) == []
        assert time.monotonic() - start >= 0.3  # a lower bound: three waits of 100 ms
