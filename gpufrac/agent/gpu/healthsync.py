"""GPU health, as the monitor reports it, applied to the rest of the agent.

A change of a GPU's health marks its slices (un)healthy in the ledger (the device plugins
resend their lists), is logged as a decision, posted as an Event on the Node, and, once
the agent is up, moves the gpufrac.dev/gpu.healthy label. The monitor's blocking wait
runs in a worker thread; everything else on the agent's event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Protocol

from gpufrac.agent.kube import events
from gpufrac.agent.kube.events import EventSink
from gpufrac.core.gpus import GpuHealth
from gpufrac.core.logs import decision

log = logging.getLogger("gpufrac.agent")


class HealthSource(Protocol):
    """GPU health as the agent follows it (gpufrac.agent.gpu.health.HealthMonitor); `poll` blocks
    (run in a worker thread) and returns the changes, empty when none, None when unknown."""

    def current(self) -> dict[str, GpuHealth]: ...
    def poll(self, timeout_ms: int) -> Sequence[object] | None: ...
    def next_change_in(self) -> float | None: ...


class HealthLedger(Protocol):
    """gpufrac.agent.booking.ledger.Ledger: True when the GPU's health changed."""

    def set_health(self, gpu_uuid: str, healthy: bool, reason: str = "") -> bool: ...


class Labels(Protocol):
    """The Node's labels (gpufrac.agent.gpu.nodelabels.NodeLabels)."""

    def refresh(self) -> None: ...


class HealthSync:
    """Applies `source`'s health to `ledger` and, from post_to / publish_to on, to the Node's
    Events and labels. Health is followed from before the apiserver is reached (a bad GPU's
    slices are never advertised), so those two come later, from the composition root."""

    def __init__(
        self, source: HealthSource, ledger: HealthLedger, node_name: str, poll_interval: float
    ) -> None:
        self.source = source
        self.ledger = ledger
        self.node_name = node_name
        self.poll_interval = poll_interval
        self._events: EventSink | None = None
        self._labels: Labels | None = None

    def post_to(self, events: EventSink | None) -> None:
        """From now on a change is posted as an Event on the Node (None: no apiserver)."""
        self._events = events

    def publish_to(self, labels: Labels) -> None:
        """From now on a change refreshes the Node's labels (the composition root calls this
        once the agent is up; its own first refresh covers what changed before)."""
        self._labels = labels

    def apply(self) -> None:
        """Apply the source's current health."""
        changed = False
        for uuid, h in self.source.current().items():
            if self.ledger.set_health(uuid, h.healthy, h.reason):
                changed = True
                state = "Healthy" if h.healthy else "Unhealthy"
                text = f"GPU {uuid} is now {state}{f' ({h.reason})' if h.reason else ''}: its slices follow"
                decision(log, "gpu-health", text, level=logging.WARNING, gpu=uuid, healthy=h.healthy)
                events.post_node(
                    self._events,
                    self.node_name,
                    events.NORMAL if h.healthy else events.WARNING,
                    events.REASON_GPU_HEALTHY if h.healthy else events.REASON_GPU_UNHEALTHY,
                    text,
                )
        if changed and self._labels is not None:
            self._labels.refresh()  # gpufrac.dev/gpu.healthy follows

    async def run(self) -> None:
        health = self.source
        interval = self.poll_interval
        while True:
            # The wait ends at once on an XID; otherwise after the poll interval (loss checks),
            # or sooner when an XID's recovery window closes and the GPU may be Healthy again.
            wait = interval
            recovery = health.next_change_in()
            if recovery is not None:
                wait = min(wait, recovery)
            try:
                changes = await asyncio.to_thread(health.poll, max(10, int(wait * 1000)))
            except Exception as e:
                log.error("health poll failed: %s", e)
                await asyncio.sleep(interval)
                continue
            if changes or changes is None:  # the ledger already holds an unchanged health
                self.apply()
