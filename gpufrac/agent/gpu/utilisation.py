"""The agent's one reader of NVML's per-process utilisation, shared by the compute controller
and the activity tracker (the idle reaper and the arbiter's victims), so that both judge a
container by the same measured utilisation.

NVML hands each reader the samples since the time stamp it passes; a driver (and simgpu,
docs/simgpu.md) may also measure a sample's period from the caller's previous call. Two readers
polling the same GPU at their own paces would each cut the other's periods short. So there is
one reader: the compute loop polls every GPU it watches once a control period (`poll`), and
every `view` (the activity tracker's) receives what each poll read. A view whose feed no loop
drives (compute shares off) polls the feed itself when asked.

Blocking (NVML): callers run poll() and a view's sampled_pids() in worker threads. A lock
keeps polls one at a time and their samples in order.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from gpufrac.agent.gpu.activity import DEFAULT_UTIL_THRESHOLD, NvmlUtilisation, ProcessSample


class SampleSource(Protocol):
    """Where samples come from (gpufrac.agent.gpu.activity.NvmlUtilisation)."""

    def supported(self, gpu_uuid: str) -> bool: ...

    def samples(self, gpu_uuid: str) -> list[ProcessSample]: ...

    def close(self) -> None: ...


@dataclass
class _Seen:
    """What a view holds of one process since it was last asked: its newest sample, and its
    newest at or above the view's threshold."""

    newest: float = 0.0
    newest_busy: float | None = None


@dataclass
class FeedView:
    """One consumer's view of the feed (the activity tracker's ProcessSamples)."""

    feed: UtilisationFeed
    threshold: int = DEFAULT_UTIL_THRESHOLD
    _seen: dict[str, dict[int, _Seen]] = field(default_factory=dict)

    def supported(self, gpu_uuid: str) -> bool:
        return self.feed.supported(gpu_uuid)

    def sampled_pids(self, gpu_uuid: str) -> dict[int, tuple[float, bool]]:
        """Host pid -> (wall time of its newest sample, whether one reached the threshold), for
        every process sampled since the previous call (NvmlUtilisation.sampled_pids' answer)."""
        if not self.feed.driven:
            self.feed.poll(gpu_uuid)
        with self.feed.lock:
            seen = self._seen.pop(gpu_uuid, {})
        return {
            pid: (s.newest_busy, True) if s.newest_busy is not None else (s.newest, False)
            for pid, s in seen.items()
        }

    def close(self) -> None:
        """The feed is its owner's to close."""

    def _take(self, gpu_uuid: str, samples: Sequence[ProcessSample]) -> None:  # under feed.lock
        seen = self._seen.setdefault(gpu_uuid, {})
        for s in samples:
            cur = seen.setdefault(s.pid, _Seen())
            cur.newest = max(cur.newest, s.time)
            if s.top >= self.threshold:
                cur.newest_busy = max(cur.newest_busy or 0.0, s.time)


class UtilisationFeed:
    """NVML's per-process utilisation, read by one poller and handed to every view."""

    def __init__(self, source: SampleSource) -> None:
        self.source = source
        self.lock = threading.Lock()
        self._views: list[FeedView] = []
        self.driven = False  # a loop polls every GPU it watches (compute shares)

    @classmethod
    def open(cls) -> UtilisationFeed:
        """Over NVML (blocking); raises when NVML cannot be had."""
        return cls(NvmlUtilisation())

    def view(self, threshold: int = DEFAULT_UTIL_THRESHOLD) -> FeedView:
        v = FeedView(self, threshold)
        with self.lock:
            self._views.append(v)
        return v

    def supported(self, gpu_uuid: str) -> bool:
        return self.source.supported(gpu_uuid)

    def poll(self, gpu_uuid: str) -> list[ProcessSample]:
        """The GPU's samples since the previous poll (blocking); every view receives them too."""
        with self.lock:
            samples = self.source.samples(gpu_uuid)
            for v in self._views:
                v._take(gpu_uuid, samples)
        return samples

    def close(self) -> None:
        self.source.close()
