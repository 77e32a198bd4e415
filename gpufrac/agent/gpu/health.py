"""GPU health: XID critical errors from NVML event sets, and GPUs that stop answering.

A GPU is Unhealthy while
  * an XID outside `health.ignoredXids` arrived less than `health.xidRecovery` ago, or
  * it does not answer NVML (fell off the bus: NVML_ERROR_GPU_IS_LOST).
It is Healthy again as soon as neither holds — unlike device plugins that mark a
GPU Unhealthy once and never look back, so a transient XID does not take the GPU
away until the plugin is restarted.

The monitor blocks in nvmlEventSetWait: the agent runs `poll` through
asyncio.to_thread, one call at a time, and reads `current()` from its loop.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from typing import Any

import pynvml  # nvidia-ml-py ships no type hints

from gpufrac.agent.gpu.inventory import LOST_REASON, NvmlError, nvml_call, nvml_init, nvml_shutdown
from gpufrac.core.config import HealthConfig
from gpufrac.core.gpus import Gpu, GpuHealth

log = logging.getLogger(__name__)

XID_EVENTS = pynvml.nvmlEventTypeXidCriticalError
# Events drained per poll after the first: bounds one poll's time under an event storm.
MAX_EVENTS_PER_POLL = 1024


@dataclass(frozen=True)
class HealthChange:
    """A GPU whose health (or the reason it is unhealthy) changed in one poll."""

    index: int
    uuid: str
    health: GpuHealth


@dataclass
class _Watched:
    index: int
    uuid: str
    handle: Any
    health: GpuHealth
    last_xid: int = 0
    last_xid_at: float | None = None
    answer_error: str = ""  # "" while the GPU answers NVML


def _address(handle: Any) -> int | None:
    return ctypes.cast(handle, ctypes.c_void_p).value


def _utc(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class HealthMonitor:
    """Watches the given GPUs (default: every GPU NVML reports) for XIDs and loss.

    `clock` returns seconds (time.time by default); tests pass their own so the
    recovery window passes without sleeping."""

    def __init__(
        self,
        config: HealthConfig,
        gpus: Iterable[Gpu] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._config = config
        self._ignored = frozenset(config.ignored_xids)
        self._clock = clock
        self._xids: Counter[tuple[str, int]] = Counter()
        # Serialises poll against close(): freeing the event set while another
        # thread waits on it would be a use-after-free inside the driver.
        self._lock = threading.Lock()
        self._closed = threading.Event()
        nvml_init()
        try:
            self._watched = self._open(gpus)
            self._event_set = self._register()
        except BaseException:
            nvml_shutdown()
            raise
        self._nvml_held = True
        self._by_address = {_address(w.handle): w for w in self._watched}
        self._snapshot = {w.uuid: replace(w.health) for w in self._watched}

    def _open(self, gpus: Iterable[Gpu] | None) -> list[_Watched]:
        now = self._clock()
        if gpus is not None:
            get = pynvml.nvmlDeviceGetHandleByUUID
            return [
                _Watched(g.index, g.uuid, nvml_call(f"handle of {g.uuid}", get, g.uuid), GpuHealth(since=now))
                for g in gpus
            ]
        out = []
        for i in range(nvml_call("nvmlDeviceGetCount", pynvml.nvmlDeviceGetCount)):
            h = nvml_call(f"nvmlDeviceGetHandleByIndex({i})", pynvml.nvmlDeviceGetHandleByIndex, i)
            uuid = nvml_call(f"nvmlDeviceGetUUID(GPU {i})", pynvml.nvmlDeviceGetUUID, h)
            out.append(_Watched(i, uuid, h, GpuHealth(since=now)))
        return out

    def _register(self) -> Any | None:
        """One event set with every GPU that can report XIDs; None if none can."""
        event_set = nvml_call("nvmlEventSetCreate", pynvml.nvmlEventSetCreate)
        registered = 0
        for w in self._watched:
            try:
                pynvml.nvmlDeviceRegisterEvents(w.handle, XID_EVENTS, event_set)
                registered += 1
            except pynvml.NVMLError as e:
                # vGPU and some older boards cannot deliver XID events; loss is still detected.
                log.warning("GPU %d (%s): no XID events (%s); only loss is detected", w.index, w.uuid, e)
        if registered:
            return event_set
        pynvml.nvmlEventSetFree(event_set)
        return None

    # ------------------------------------------------------------ queries

    def current(self) -> dict[str, GpuHealth]:
        """Health per GPU UUID as of the last poll (a copy; safe from any thread)."""
        return {uuid: replace(h) for uuid, h in self._snapshot.items()}

    def next_change_in(self) -> float | None:
        """Seconds until the earliest XID recovery window of a GPU closes (it may turn
        Healthy then), None if no GPU is waiting for one. Read between polls."""
        now = self._clock()
        due = [
            w.last_xid_at + self._config.xid_recovery - now
            for w in self._watched
            if w.last_xid_at is not None and not w.health.healthy
        ]
        # A window already closed (a lost GPU stays Unhealthy for another reason) is no reason
        # to poll sooner.
        due = [d for d in due if d > 0]
        return min(due) if due else None

    def xid_counts(self) -> dict[tuple[str, int], int]:
        """(uuid, xid) -> XIDs seen since start, ignored ones included (for metrics)."""
        return dict(self._xids)

    # ------------------------------------------------------------ polling

    def poll(self, timeout_ms: int) -> list[HealthChange]:
        """Wait up to timeout_ms for XID events, check every GPU still answers, and
        return the GPUs whose health changed."""
        with self._lock:
            if self._closed.is_set():
                raise RuntimeError("HealthMonitor.poll after close()")
            self._read_events(max(0, int(timeout_ms)))
            now = self._clock()
            changes = []
            for w in self._watched:
                self._probe(w)
                healthy, reason = self._judge(w, now)
                if healthy != w.health.healthy or reason != w.health.reason:
                    w.health = GpuHealth(healthy=healthy, reason=reason, since=now)
                    changes.append(HealthChange(w.index, w.uuid, replace(w.health)))
                    log.log(
                        logging.INFO if healthy else logging.WARNING,
                        "GPU %d (%s) is %s%s",
                        w.index,
                        w.uuid,
                        "Healthy" if healthy else "Unhealthy",
                        f": {reason}" if reason else "",
                    )
            # Swap in a new dict so current() never sees a half-updated one.
            self._snapshot = {w.uuid: replace(w.health) for w in self._watched}
            return changes

    def _read_events(self, timeout_ms: int) -> None:
        if self._event_set is None:
            # Nothing to wait on: keep poll's pacing so a caller's loop does not spin.
            self._closed.wait(timeout_ms / 1000)
            return
        wait = timeout_ms
        start = time.monotonic()
        for _ in range(MAX_EVENTS_PER_POLL):
            try:
                event = pynvml.nvmlEventSetWait(self._event_set, wait)
            except pynvml.NVMLError as e:
                if e.value != pynvml.NVML_ERROR_TIMEOUT:
                    # GPU_IS_LOST and friends: the per-GPU probe that follows says which GPU.
                    # A driver that keeps failing at once must not make the caller's loop spin:
                    # the rest of the wait is spent here.
                    log.debug("nvmlEventSetWait: %s", e)
                    if wait:
                        self._closed.wait(max(0.0, timeout_ms / 1000 - (time.monotonic() - start)))
                return
            self._on_event(event)
            wait = 0  # drain what is queued, do not wait again

    def _on_event(self, event: Any) -> None:
        if not event.eventType & XID_EVENTS:
            return
        xid = int(event.eventData)
        targets = self._event_gpus(event)
        now = self._clock()
        for w in targets:
            self._xids[(w.uuid, xid)] += 1
            if xid in self._ignored:
                log.info("GPU %d (%s): XID %d (ignored: application fault)", w.index, w.uuid, xid)
                continue
            log.warning("GPU %d (%s): XID %d", w.index, w.uuid, xid)
            w.last_xid, w.last_xid_at = xid, now

    def _event_gpus(self, event: Any) -> list[_Watched]:
        w = self._by_address.get(_address(event.device))
        if w is not None:
            return [w]
        try:
            uuid = pynvml.nvmlDeviceGetUUID(event.device)
        except pynvml.NVMLError:
            uuid = None
        match = [w for w in self._watched if w.uuid == uuid]
        # An XID the driver cannot pin on one GPU may concern any of them.
        return match or list(self._watched)

    def _probe(self, w: _Watched) -> None:
        """Does the GPU still answer? Memory info goes to the device, not a cache."""
        try:
            pynvml.nvmlDeviceGetMemoryInfo(w.handle)
        except pynvml.NVMLError as e:
            w.answer_error = (
                LOST_REASON if e.value == pynvml.NVML_ERROR_GPU_IS_LOST else f"does not answer NVML: {e}"
            )
        else:
            w.answer_error = ""

    def _judge(self, w: _Watched, now: float) -> tuple[bool, str]:
        if w.answer_error:
            return False, w.answer_error
        if w.last_xid_at is not None and now - w.last_xid_at < self._config.xid_recovery:
            return False, f"XID {w.last_xid} at {_utc(w.last_xid_at)}"
        return True, ""

    # ------------------------------------------------------------ lifetime

    def close(self) -> None:
        """Free the event set and release NVML; waits for a poll in progress."""
        self._closed.set()
        with self._lock:
            if not self._nvml_held:
                return
            if self._event_set is not None:
                try:
                    pynvml.nvmlEventSetFree(self._event_set)
                except pynvml.NVMLError as e:
                    log.warning("nvmlEventSetFree: %s", e)
                self._event_set = None
            self._nvml_held = False
            nvml_shutdown()

    def __enter__(self) -> HealthMonitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["HealthChange", "HealthMonitor", "NvmlError"]
