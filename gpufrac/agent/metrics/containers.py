"""What happened to each container while the agent watched: evictions, swaps, wait-resolver
waits and OOM refusals, by container key.

A container's series carry its pod's names, which may not be known yet when something is
counted: the counts are kept by key in prometheus-client metrics of their own (registered
nowhere) and shown under the pod's labels at scrape time (gpufrac.agent.metrics.snapshot).
A container's counts go with it: forgotten on release, or at the first scrape that no longer
sees it.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol, TypeAlias

from prometheus_client import Counter, Histogram

from gpufrac.agent.metrics import names
from gpufrac.agent.metrics.names import SWAP_DIRECTIONS


class Keyed(Protocol):
    """A container's allocation (gpufrac.agent.booking.ledger.ContainerAlloc), or anything that
    names one by its container key."""

    @property
    def key(self) -> str: ...


Container: TypeAlias = "str | Keyed"  # a container key, or what has one


def key_of(container: Container) -> str:
    return container if isinstance(container, str) else str(container.key)


def _totals(counter: Counter) -> dict[tuple[str, ...], float]:
    """A counter's values by label values (its _total samples)."""
    return {
        tuple(s.labels.values()): s.value
        for family in counter.collect()
        for s in family.samples
        if s.name.endswith("_total")
    }


class Counts:
    """One container's counts."""

    def __init__(self) -> None:
        self.since = time.monotonic()
        self.evictions = Counter(names.CONTAINER_EVICTIONS, "evictions", registry=None)
        self.swaps = Counter(names.CONTAINER_SWAPS, "swaps", ["direction"], registry=None)
        for d in SWAP_DIRECTIONS:
            self.swaps.labels(d)
        self.waits = Histogram(
            names.CONTAINER_WAIT_SECONDS, "waits", buckets=names.WAIT_BUCKETS, registry=None
        )
        # The shim keeps refusals per process slot and a slot is cleared when its process
        # goes: keep the refusals of gone processes so the counter never goes down.
        self.oom_retired = 0
        self.oom_slots: dict[tuple[int, int], int] = {}

    def eviction_count(self) -> float:
        return sum(_totals(self.evictions).values())

    def swap_counts(self) -> dict[str, float]:
        """direction -> swaps."""
        return {labels[0]: n for labels, n in _totals(self.swaps).items()}

    def wait_figures(self) -> tuple[list[tuple[str, float]], float]:
        """The waits histogram: its cumulative buckets (le, count) up to +Inf, and its sum."""
        buckets: list[tuple[str, float]] = []
        total = 0.0
        for family in self.waits.collect():
            for s in family.samples:
                if s.name.endswith("_bucket"):
                    buckets.append((s.labels["le"], s.value))
                elif s.name.endswith("_sum"):
                    total = s.value
        return buckets, total

    def oom_total(self, slots: dict[tuple[int, int], int] | None) -> int:
        """OOM refusals so far. `slots`: per live process slot, from this scrape's usage file
        (a slot gone is a process gone: its count is kept); None when the file could not be
        read this time, which says nothing about the slots."""
        if slots is None:
            return self.oom_retired + sum(self.oom_slots.values())
        for slot, seen in self.oom_slots.items():
            if slot not in slots:
                self.oom_retired += seen
        self.oom_slots = {s: max(n, self.oom_slots.get(s, 0)) for s, n in slots.items()}
        return self.oom_retired + sum(self.oom_slots.values())


class ContainerCounts:
    """Counts by container key, on the agent's loop or any thread: `lock` guards the map
    (and the scrape's reading of it)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_key: dict[str, Counts] = {}

    def of(self, container: Container) -> Counts:
        """The container's counts, created on first use. Call with `lock` held."""
        key = key_of(container)
        c = self.by_key.get(key)
        if c is None:
            c = self.by_key[key] = Counts()
        return c

    def forget(self, container: Container) -> None:
        with self.lock:
            self.by_key.pop(key_of(container), None)

    def prune(self, held: set[str]) -> None:
        """Drop the counts of containers a snapshot no longer holds (unless first counted
        within the last second: the snapshot may predate the container). Call with `lock` held."""
        taken = time.monotonic()
        for key in [k for k, c in self.by_key.items() if k not in held and c.since < taken - 1.0]:
            del self.by_key[key]
