"""The agent's metrics: one registry, the counting API, and the HTTP server for /metrics,
/healthz and /readyz.

Agent-wide counts are prometheus-client Counters and Gauges with their labels; per-container
counts are kept by container key (containers.py) and, with the per-GPU figures, read at
scrape time from the agent's state (snapshot.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Iterable, Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Info,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

import gpufrac
from gpufrac.agent.metrics import names
from gpufrac.agent.metrics.containers import Container, ContainerCounts, Counts
from gpufrac.agent.metrics.endpoint import HEARTBEAT_INTERVAL, Probes, wsgi_app
from gpufrac.agent.metrics.names import (
    REAP_ACTIONS,
    REAP_REASONS,
    SWAP_DIRECTIONS,
    WATCHDOG_ACTIONS,
    annotation_label,
)
from gpufrac.agent.metrics.snapshot import NodeCollector, Source
from gpufrac.agent.status.capture import Observed, capture_threadsafe, readiness
from gpufrac.agent.status.httpd import Served, serve_tcp

log = logging.getLogger(__name__)


class _WithoutCreated(Collector):
    """The metrics of `inner` less their `_created` series, which gpufrac never exported
    (prometheus-client can switch them off process-wide only from 0.20, above its floor)."""

    def __init__(self, inner: CollectorRegistry) -> None:
        self.inner = inner

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        for family in self.inner.collect():
            family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield family


class Metrics:
    """The agent's registry and what it counts. `source`: the agent's state for the
    scrape-time series (start() sets it; tests give their own)."""

    def __init__(self, source: Source | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        counted = CollectorRegistry(auto_describe=False)
        self._counted = counted
        Info(
            names.BUILD_INFO.removesuffix("_info"),
            "gpufrac version of this agent (always 1)",
            registry=self.registry,
        ).info({"version": gpufrac.__version__})
        self._store = ContainerCounts()
        self._containers: dict[str, Counts] = self._store.by_key
        self._scrape_errors = Counter(
            names.SCRAPE_ERRORS, "Scrapes that could not read the agent's state.", registry=counted
        )
        # Registered before the counts: a scrape's own failure shows in that scrape.
        self._node = NodeCollector(source, self._store, self._scrape_errors)
        self.registry.register(self._node)
        self._reconcile_errors = Counter(
            names.RECONCILE_ERRORS,
            "Reconcile passes with the kubelet's pod-resources that failed.",
            registry=counted,
        )
        self._arbiter = Counter(
            names.ARBITER_REQUESTS,
            "Slow-path requests from shims, by kind and outcome.",
            ["kind", "outcome"],
            registry=counted,
        )
        self._limited = Counter(
            names.ARBITER_LIMITED,
            "Arbiter connections and requests refused because their container was over a "
            "per-container limit (connections, inflight, rate) or the node's connection cap (node).",
            ["limit"],
            registry=counted,
        )
        self._annotations = Counter(
            names.ANNOTATION_ERRORS,
            "Pod annotations refused (safe default applied, Event posted), by annotation key.",
            ["key"],
            registry=counted,
        )
        self._reaps = Counter(
            names.IDLE_REAPS,
            "Actions of the idle reaper on idle interactive pods, by what triggered them.",
            ["action", "reason"],
            registry=counted,
        )
        for action in REAP_ACTIONS:  # max_runtime series appear once counted
            self._reaps.labels(action, "idle")
        self._watchdog = Counter(
            names.WATCHDOG_ACTIONS_TOTAL,
            "Containers the watchdog found over their limit per NVML, and hidden GPU processes: "
            "reported, or killed.",
            ["action"],
            registry=counted,
        )
        for action in WATCHDOG_ACTIONS:
            self._watchdog.labels(action)
        # Registered at the watchdog's first scan: no figure before it.
        self._unowned_processes = Gauge(
            names.WATCHDOG_UNOWNED_PROCESSES,
            "GPU processes that belong to no gpufrac container (last watchdog scan).",
            registry=None,
        )
        self._unowned_bytes = Gauge(
            names.WATCHDOG_UNOWNED_BYTES,
            "GPU memory those processes use, per NVML (last watchdog scan).",
            registry=None,
        )
        self._unowned_shown = False
        self._unowned_lock = threading.Lock()
        self._usage_mismatches = Counter(
            names.USAGE_FILE_MISMATCHES,
            "Times a container's memguard usage file disagreed with NVML's per-process count beyond the "
            "context allowance (a Warning Event names the pod; decisions used the larger figure).",
            registry=counted,
        )
        self.registry.register(_WithoutCreated(counted))
        self.registry.register(ProcessCollector(registry=None))
        self.registry.register(PlatformCollector(registry=None))
        self.probes = Probes()
        self._served: Served | None = None
        self._heartbeat: asyncio.Task[None] | None = None

    def collect(self) -> Iterator[Metric]:
        """What one scrape sees, family by family."""
        yield from self.registry.collect()

    # -- counting API: on the agent's loop or any thread ------------------------------------------

    def count_wait(self, container: Container, seconds: float) -> None:
        with self._store.lock:
            self._store.of(container).waits.observe(max(0.0, float(seconds)))

    def count_eviction(self, container: Container) -> None:
        with self._store.lock:
            self._store.of(container).evictions.inc()

    def count_swap(self, container: Container, direction: str) -> None:
        if direction not in SWAP_DIRECTIONS:
            raise ValueError(f"swap direction {direction!r} is not one of {SWAP_DIRECTIONS}")
        with self._store.lock:
            self._store.of(container).swaps.labels(direction).inc()

    def count_arbiter_request(self, kind: str, outcome: str) -> None:
        self._arbiter.labels(kind, outcome).inc()

    def count_arbiter_limited(self, limit: str) -> None:
        self._limited.labels(limit).inc()

    def count_reap(self, action: str, reason: str = "idle") -> None:
        if action not in REAP_ACTIONS:
            raise ValueError(f"reap action {action!r} is not one of {REAP_ACTIONS}")
        if reason not in REAP_REASONS:
            raise ValueError(f"reap reason {reason!r} is not one of {REAP_REASONS}")
        self._reaps.labels(action, reason).inc()

    def count_watchdog(self, action: str) -> None:
        if action not in WATCHDOG_ACTIONS:
            raise ValueError(f"watchdog action {action!r} is not one of {WATCHDOG_ACTIONS}")
        self._watchdog.labels(action).inc()

    def set_watchdog_unowned(self, processes: int, used_bytes: int) -> None:
        self._unowned_processes.set(processes)
        self._unowned_bytes.set(used_bytes)
        with self._unowned_lock:
            if not self._unowned_shown:
                self._counted.register(self._unowned_processes)
                self._counted.register(self._unowned_bytes)
                self._unowned_shown = True

    def count_annotation_error(self, key: str) -> None:
        self._annotations.labels(annotation_label(key)).inc()

    def count_reconcile_error(self) -> None:
        self._reconcile_errors.inc()

    def count_usage_mismatch(self) -> None:
        self._usage_mismatches.inc()

    def forget(self, container: Container) -> None:
        """Drop a released container's counts now (they are also dropped at the next scrape)."""
        self._store.forget(container)

    # -- serving -----------------------------------------------------------------------------------

    def serve(self, host: str, port: int) -> bool:
        """Start the HTTP server thread; False (error logged) when the address cannot be bound."""
        try:
            self._served = serve_tcp(wsgi_app(self.registry, self.probes), host, port, "gpufrac-metrics")
        except OSError as e:
            log.error(
                "metrics, /healthz and /readyz unavailable: cannot listen on %s port %d "
                "(metrics.bindAddress, metrics.port): %s",
                host,
                port,
                e.strerror or e,
            )
            return False
        log.info("metrics on http://%s:%d/metrics (probes /healthz, /readyz)", host, self.port)
        return True

    @property
    def port(self) -> int | None:
        return None if self._served is None else int(self._served.server.server_address[1])

    async def start(self, agent: Observed) -> None:
        """Serve for `agent` (call first thing in Agent.start, on its loop): the probes answer
        during start-up."""
        loop = asyncio.get_running_loop()
        self._node.source = lambda: capture_threadsafe(agent, loop)
        self.probes.ready_check = lambda: readiness(agent)
        self.probes.beat()
        self._heartbeat = asyncio.create_task(self._beat(), name="heartbeat")
        cfg = agent.config.metrics
        await asyncio.to_thread(self.serve, cfg.bind_address, cfg.port)

    async def _beat(self) -> None:
        while True:
            self.probes.beat()
            await asyncio.sleep(HEARTBEAT_INTERVAL)

    async def stop(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat
        served, self._served = self._served, None
        if served is not None:
            await asyncio.to_thread(served.stop)
