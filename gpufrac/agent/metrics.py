"""Prometheus metrics, /healthz and /readyz: every metric gpufrac exports is defined here.

One HTTP server (prometheus-client's WSGI app wrapped with the two probes) runs in
its own thread on metrics.bindAddress:metrics.port, so a slow scrape never blocks
the agent's loop. Names follow deploy/daemonset/METRICS.md, which the Grafana
dashboard is written against.

Per-GPU and per-container series are not long-lived labelled gauges: a custom
collector computes them at scrape time from a snapshot of the agent's state
(gpufrac.agent.status: taken on the loop, enriched with NVML and the usage files
in the scrape thread). So the series of a container that is gone disappear with
it, and no pid or device-ID label ever exists.

Other modules count what happens through a small API, on the agent's loop or any
thread (a lock guards the counts):

    from gpufrac.agent import metrics
    metrics.count_wait(alloc, seconds)           # a wait-resolver wait ended (granted or not)
    metrics.count_eviction(alloc)                # a victim container's processes were killed
    metrics.count_swap(alloc, "out" | "in")      # a swap-out to host RAM / swap-in back
    metrics.count_arbiter_request(kind, outcome) # a slow-path request of a shim was answered
    metrics.count_arbiter_limited(limit)         # a container went past an arbiter limit (fairness)
    metrics.count_reap(action, reason)           # the idle reaper acted (evict…) on an idle|max_runtime pod
    metrics.count_watchdog(action)               # the watchdog reported a container or killed a process
    metrics.set_watchdog_unowned(n, bytes)       # GPU processes of no gpufrac container, last scan
    metrics.count_annotation_error(key)          # a pod annotation was refused
    metrics.count_reconcile_error()              # a reconcile pass failed

`alloc` is a ContainerAlloc or its container key. The module-level functions go to
the running agent's Metrics (agent.metrics); with no agent running they do nothing.
Per-container counts are dropped once the container is gone from the ledger.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector, make_wsgi_app
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import Collector

import gpufrac
from gpufrac.agent.annotations import LIMIT_KEYS, PREFIX, USER_KEYS
from gpufrac.agent.status.capture import capture_threadsafe, readiness
from gpufrac.agent.status.enrich import enrich
from gpufrac.agent.status.model import NodeStatus, UsageView

log = logging.getLogger(__name__)

NAMESPACE = "gpufrac"
# UUID repeats uuid under the DCGM exporter's label name, so a query joins gpufrac and
# DCGM series with one on(UUID) (deploy/daemonset/METRICS.md); uuid stays for dashboards.
GPU_LABELS = ("uuid", "index", "model", "numa_node", "pci_bus_id", "UUID")
CONTAINER_LABELS = ("namespace", "pod", "container", "uuid", "UUID")
# Wait-resolver waits: from a free slot a moment later up to the longest wait timeouts.
WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
SWAP_DIRECTIONS = ("out", "in")
# dry_run: what the reaper would have done in idle.dryRun; delete: idle.allowDelete without the Eviction API.
REAP_ACTIONS = ("notify", "swap", "evict", "delete", "dry_run")
REAP_REASONS = ("idle", "max_runtime")
WATCHDOG_ACTIONS = ("report", "kill")
# Liveness: the loop's heartbeat task beats this often; a beat older than
# HEARTBEAT_STALE_AFTER means the loop is stuck (/healthz fails). Not the arbiter's
# grant staleness: a different clock with a different job.
HEARTBEAT_INTERVAL = 1.0
HEARTBEAT_STALE_AFTER = 15.0


def annotation_label(key: str) -> str:
    """The `key` label of an annotation error, bounded: the annotation keys gpufrac knows
    (per-container overrides folded into their base key), else "unknown"."""
    if key in USER_KEYS:
        return key
    base = key.rpartition(".")[0]
    if base in LIMIT_KEYS:
        return base
    return "unknown" if key.startswith(PREFIX) else "other"


def _key(container: Any) -> str:
    return container if isinstance(container, str) else str(container.key)


@dataclass
class _Histogram:
    buckets: list[int] = field(default_factory=lambda: [0] * len(WAIT_BUCKETS))
    count: int = 0
    sum: float = 0.0

    def observe(self, v: float) -> None:
        for i, bound in enumerate(WAIT_BUCKETS):
            if v <= bound:
                self.buckets[i] += 1
        self.count += 1
        self.sum += v

    def samples(self) -> list[tuple[str, float]]:
        return [
            *((repr(b), float(n)) for b, n in zip(WAIT_BUCKETS, self.buckets, strict=True)),
            ("+Inf", float(self.count)),
        ]

    def add(self, other: _Histogram) -> None:
        self.buckets = [a + b for a, b in zip(self.buckets, other.buckets, strict=True)]
        self.count += other.count
        self.sum += other.sum


@dataclass
class _Counts:
    """What happened to one container (by container key) while the agent watched."""

    since: float = field(default_factory=time.monotonic)
    evictions: int = 0
    swaps: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SWAP_DIRECTIONS, 0))
    waits: _Histogram = field(default_factory=_Histogram)
    # The shim keeps refusals per process slot and a slot is cleared when its process
    # goes: keep the refusals of gone processes so the counter never goes down.
    oom_retired: int = 0
    oom_slots: dict[tuple[int, int], int] = field(default_factory=dict)

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


class Probes:
    """/healthz: the loop's heartbeat is fresh. /readyz: live, and `ready()` says so."""

    def __init__(
        self, stale_after: float = HEARTBEAT_STALE_AFTER, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.stale_after = stale_after
        self.clock = clock
        self.last_beat: float | None = None
        self.ready_check: Callable[[], tuple[bool, str]] = lambda: (False, "starting")

    def beat(self) -> None:
        self.last_beat = self.clock()

    def live(self) -> tuple[bool, str]:
        if self.last_beat is None:
            return False, "the agent loop has not started"
        age = self.clock() - self.last_beat
        if age > self.stale_after:
            return False, f"the agent loop has not run for {age:.0f}s"
        return True, "ok"

    def ready(self) -> tuple[bool, str]:
        ok, why = self.live()
        if not ok:
            return ok, why
        try:
            return self.ready_check()
        except Exception as e:  # a probe answers, it never raises
            return False, f"readiness check failed: {e}"


class Metrics(Collector):
    """The agent's registry, its counts, and the collector of the scrape-time series."""

    def __init__(self, source: Callable[[], NodeStatus | None] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(ProcessCollector(registry=None))
        self.registry.register(PlatformCollector(registry=None))
        self.registry.register(self)
        self.source = source
        self.probes = Probes()
        self._lock = threading.Lock()
        self._containers: dict[str, _Counts] = {}
        self._arbiter: dict[tuple[str, str], int] = {}
        self._limited: dict[str, int] = {}
        self._annotations: dict[str, int] = {}
        # (action, reason); max_runtime series appear once counted.
        self._reaps: dict[tuple[str, str], int] = {(a, "idle"): 0 for a in REAP_ACTIONS}
        self._watchdog: dict[str, int] = dict.fromkeys(WATCHDOG_ACTIONS, 0)
        self._unowned: tuple[int, int] | None = None  # GPU processes of no gpufrac container: count, bytes
        self.reconcile_errors = 0
        self.usage_mismatches = 0  # containers whose usage file disagreed with NVML (gpufrac.agent.truth)
        self.scrape_errors = 0
        self._server: ThreadingWSGIServer | None = None
        self._thread: threading.Thread | None = None
        self._heartbeat: asyncio.Task[None] | None = None

    # -- counting API ---------------------------------------------------------------------------

    def _counts(self, container: Any) -> _Counts:
        key = _key(container)
        c = self._containers.get(key)
        if c is None:
            c = self._containers[key] = _Counts()
        return c

    def count_wait(self, container: Any, seconds: float) -> None:
        with self._lock:
            self._counts(container).waits.observe(max(0.0, float(seconds)))

    def count_eviction(self, container: Any) -> None:
        with self._lock:
            self._counts(container).evictions += 1

    def count_swap(self, container: Any, direction: str) -> None:
        if direction not in SWAP_DIRECTIONS:
            raise ValueError(f"swap direction {direction!r} is not one of {SWAP_DIRECTIONS}")
        with self._lock:
            self._counts(container).swaps[direction] += 1

    def count_arbiter_request(self, kind: str, outcome: str) -> None:
        with self._lock:
            self._arbiter[(kind, outcome)] = self._arbiter.get((kind, outcome), 0) + 1

    def count_arbiter_limited(self, limit: str) -> None:
        with self._lock:
            self._limited[limit] = self._limited.get(limit, 0) + 1

    def count_reap(self, action: str, reason: str = "idle") -> None:
        if action not in REAP_ACTIONS:
            raise ValueError(f"reap action {action!r} is not one of {REAP_ACTIONS}")
        if reason not in REAP_REASONS:
            raise ValueError(f"reap reason {reason!r} is not one of {REAP_REASONS}")
        with self._lock:
            self._reaps[(action, reason)] = self._reaps.get((action, reason), 0) + 1

    def count_watchdog(self, action: str) -> None:
        if action not in WATCHDOG_ACTIONS:
            raise ValueError(f"watchdog action {action!r} is not one of {WATCHDOG_ACTIONS}")
        with self._lock:
            self._watchdog[action] += 1

    def set_watchdog_unowned(self, processes: int, used_bytes: int) -> None:
        with self._lock:
            self._unowned = (processes, used_bytes)

    def count_annotation_error(self, key: str) -> None:
        label = annotation_label(key)
        with self._lock:
            self._annotations[label] = self._annotations.get(label, 0) + 1

    def count_reconcile_error(self) -> None:
        with self._lock:
            self.reconcile_errors += 1

    def count_usage_mismatch(self) -> None:
        with self._lock:
            self.usage_mismatches += 1

    def forget(self, container: Any) -> None:
        """Drop a released container's counts now (they are also dropped at the next scrape)."""
        with self._lock:
            self._containers.pop(_key(container), None)

    # -- the collector (runs in the scrape thread) ------------------------------------------------

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        info = InfoMetricFamily(f"{NAMESPACE}_build", "gpufrac version of this agent (always 1)")
        info.add_metric([], {"version": gpufrac.__version__})
        yield info
        snap: NodeStatus | None = None
        views: dict[str, UsageView] = {}
        if self.source is not None:
            try:
                snap = self.source()
                if snap is not None:
                    views = enrich(snap)
            except Exception as e:  # a scrape shows what it can; the agent goes on
                self.scrape_errors += 1
                log.warning("metrics: agent state unavailable for this scrape: %s", e)
                snap = None
        # Built under the lock, yielded after it: prometheus-client formats each family as it
        # comes, and the loop's count_* calls must not wait for a slow scrape.
        with self._lock:
            families: list[Metric] = []
            if snap is not None:
                self._prune(snap)
                families += self._gpu_families(snap)
                families += self._container_families(snap, views)
            families += self._agent_families(snap)
        yield from families

    def _prune(self, snap: NodeStatus) -> None:
        held = {c.key for c in snap.containers}
        taken = time.monotonic()
        for key in [k for k, c in self._containers.items() if k not in held and c.since < taken - 1.0]:
            del self._containers[key]

    def _gpu_families(self, snap: NodeStatus) -> Iterator[Metric]:
        def gauge(name: str, doc: str, extra: tuple[str, ...] = ()) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"{NAMESPACE}_gpu_{name}", doc, labels=[*GPU_LABELS, *extra])

        total = gauge("memory_total_bytes", "Physical memory of the GPU.")
        alloc = gauge("memory_allocatable_bytes", "GPU memory gpufrac hands out: total minus reservedPerGpu.")
        req = gauge("memory_requested_bytes", "Sum of the guaranteed requests placed on the GPU.")
        used = gauge("memory_used_bytes", "GPU memory in use, as NVML reports it.")
        burst = gauge("memory_burst_granted_bytes", "Burst grants outstanding above the requests on the GPU.")
        util = gauge("utilization_ratio", "SM utilisation of the GPU, 0 to 1 (NVML).")
        healthy = gauge("healthy", "1 while the GPU is Healthy, 0 while Unhealthy.")
        free = gauge(
            "free_slices", "Unallocated slices the kubelet may still admit, per resource.", ("resource",)
        )
        nvlink = gauge("nvlink_links", "Active NVLink links from the GPU to each peer GPU.", ("peer_uuid",))
        xid = CounterMetricFamily(
            f"{NAMESPACE}_gpu_xid_errors",
            "XID errors NVML reported for the GPU since the agent started (ignored XIDs included).",
            labels=[*GPU_LABELS, "xid"],
        )
        mig = gauge(
            "mig_enabled",
            "1 for a GPU in MIG mode, which gpufrac does not share (left to the MIG-aware device plugin).",
        )
        for m in snap.mig:
            numa = m.get("numa_node")
            labels = [
                m["uuid"],
                str(m["index"]),
                m["model"],
                "" if numa is None else str(numa),
                m["pci_bus_id"],
            ]
            mig.add_metric(labels, 1)
        for g in snap.gpus:
            labels = [
                g.uuid,
                str(g.index),
                g.model,
                "" if g.numa_node is None else str(g.numa_node),
                g.pci_bus_id,
                g.uuid,
            ]
            mig.add_metric(labels, 0)
            total.add_metric(labels, g.memory_total_bytes)
            alloc.add_metric(labels, g.memory_allocatable_bytes)
            req.add_metric(labels, g.memory_requested_bytes)
            burst.add_metric(labels, g.memory_burst_granted_bytes)
            if g.memory_used_bytes is not None:
                used.add_metric(labels, g.memory_used_bytes)
            if g.utilization_ratio is not None:
                util.add_metric(labels, g.utilization_ratio)
            healthy.add_metric(labels, 1 if g.healthy else 0)
            for resource, n in g.slices.items():
                free.add_metric([*labels, resource], n["free"])
            for peer, links in g.nvlinks.items():
                nvlink.add_metric([*labels, peer], links)
            for x, n in sorted(g.xid_errors.items()):
                xid.add_metric([*labels, str(x)], n)
        yield from (total, alloc, req, used, burst, util, healthy, free, nvlink, xid, mig)

    def _container_families(self, snap: NodeStatus, views: dict[str, UsageView]) -> Iterator[Metric]:
        # One series per (namespace, pod, container, GPU). A container of a pod not known
        # yet has no name to show: it is left out until its pod is (a second or so), so two
        # such containers never collide on empty labels. Where two allocations share a
        # label set (a container holding both resources on one GPU) they are summed.
        @dataclass
        class Row:
            request: int = 0
            limit: int = 0
            burst: int = 0
            used: int | None = None
            idle: float | None = None
            swapped: int = 0
            oom: int = 0
            evictions: int = 0
            swaps: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SWAP_DIRECTIONS, 0))
            waits: _Histogram = field(default_factory=_Histogram)
            primary: bool = False  # the first GPU of some container: usage and counters shown here

        rows: dict[tuple[str, ...], Row] = {}
        for c in snap.containers:
            if not c.known:
                continue
            counts = self._counts(c.key)
            view = views.get(c.key)
            for i, uuid in enumerate(c.gpus):
                row = rows.setdefault((c.namespace, c.pod, c.container, uuid), Row())
                row.request += c.request_bytes
                row.limit += c.limit_bytes
                row.burst += c.burst_granted_bytes
                if i:  # usage and events are the container's, shown on its first GPU
                    continue
                row.primary = True
                if view is not None:
                    row.used = (row.used or 0) + view.used_bytes
                    row.swapped += view.swapped_bytes
                if c.idle_seconds is not None:  # enrich: the activity tracker's or the usage file's
                    row.idle = c.idle_seconds if row.idle is None else min(row.idle, c.idle_seconds)
                row.oom += counts.oom_total(view.slot_refusals if view is not None else None)
                row.evictions += counts.evictions
                for d in SWAP_DIRECTIONS:
                    row.swaps[d] += counts.swaps[d]
                row.waits.add(counts.waits)

        def gauge(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"{NAMESPACE}_container_{name}", doc, labels=CONTAINER_LABELS)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> CounterMetricFamily:
            return CounterMetricFamily(
                f"{NAMESPACE}_container_{name}", doc, labels=[*CONTAINER_LABELS, *extra]
            )

        req = gauge("memory_request_bytes", "Guaranteed GPU memory of the container on the GPU.")
        lim = gauge("memory_limit_bytes", "Burst ceiling of the container's GPU memory.")
        used = gauge(
            "memory_used_bytes", "GPU memory the container uses, all its processes (memguard usage file)."
        )
        burst = gauge("memory_burst_granted_bytes", "The container's current burst grant above its request.")
        swapped = gauge("swapped_bytes", "The container's GPU memory currently held in host RAM.")
        idle = gauge(
            "idle_seconds", "Seconds since the container's last GPU work (a launch, or NVML activity)."
        )
        evictions = counter("evictions", "Times the container's processes were evicted to free GPU memory.")
        swaps = counter(
            "swaps", "Swaps of the container's GPU memory to host RAM (out) and back (in).", ("direction",)
        )
        oom = counter("oom_refusals", "Allocations of the container refused with CUDA_ERROR_OUT_OF_MEMORY.")
        waits = HistogramMetricFamily(
            f"{NAMESPACE}_container_wait_seconds",
            "Time the container's allocations waited in the wait resolver for memory to be freed.",
            labels=CONTAINER_LABELS,
        )
        for labels, r in rows.items():
            lv = [*labels, labels[-1]]  # UUID: the GPU's uuid again
            req.add_metric(lv, r.request)
            lim.add_metric(lv, r.limit)
            burst.add_metric(lv, r.burst)
            if not r.primary:
                continue
            if r.used is not None:
                used.add_metric(lv, r.used)
                swapped.add_metric(lv, r.swapped)
            if r.idle is not None:
                idle.add_metric(lv, round(r.idle, 3))
            evictions.add_metric(lv, r.evictions)
            for d in SWAP_DIRECTIONS:
                swaps.add_metric([*lv, d], r.swaps[d])
            oom.add_metric(lv, r.oom)
            waits.add_metric(lv, r.waits.samples(), r.waits.sum)
        yield from (req, lim, used, burst, swapped, idle, evictions, swaps, oom, waits)

    def _agent_families(self, snap: NodeStatus | None) -> Iterator[Metric]:
        regs = CounterMetricFamily(
            f"{NAMESPACE}_registrations", "Device-plugin registrations with the kubelet.", labels=["resource"]
        )
        if snap is not None:
            for resource, n in snap.registrations.items():
                regs.add_metric([resource], n)
        yield regs
        yield CounterMetricFamily(
            f"{NAMESPACE}_reconcile_errors",
            "Reconcile passes with the kubelet's pod-resources that failed.",
            value=self.reconcile_errors,
        )
        arb = CounterMetricFamily(
            f"{NAMESPACE}_arbiter_requests",
            "Slow-path requests from shims, by kind and outcome.",
            labels=["kind", "outcome"],
        )
        for (kind, outcome), n in sorted(self._arbiter.items()):
            arb.add_metric([kind, outcome], n)
        yield arb
        limited = CounterMetricFamily(
            f"{NAMESPACE}_arbiter_limited",
            "Arbiter connections and requests refused because their container was over a "
            "per-container limit (connections, inflight, rate) or the node's connection cap (node).",
            labels=["limit"],
        )
        for limit, n in sorted(self._limited.items()):
            limited.add_metric([limit], n)
        yield limited
        ann = CounterMetricFamily(
            f"{NAMESPACE}_annotation_errors",
            "Pod annotations refused (safe default applied, Event posted), by annotation key.",
            labels=["key"],
        )
        for key, n in sorted(self._annotations.items()):
            ann.add_metric([key], n)
        yield ann
        reaps = CounterMetricFamily(
            f"{NAMESPACE}_idle_reaps",
            "Actions of the idle reaper on idle interactive pods, by what triggered them.",
            labels=["action", "reason"],
        )
        for (action, reason), n in self._reaps.items():
            reaps.add_metric([action, reason], n)
        yield reaps
        wd = CounterMetricFamily(
            f"{NAMESPACE}_watchdog_actions",
            "Containers the watchdog found over their limit per NVML: reported, or a process killed.",
            labels=["action"],
        )
        for action, n in self._watchdog.items():
            wd.add_metric([action], n)
        yield wd
        if self._unowned is not None:
            yield GaugeMetricFamily(
                f"{NAMESPACE}_watchdog_unowned_processes",
                "GPU processes that belong to no gpufrac container (last watchdog scan).",
                value=self._unowned[0],
            )
            yield GaugeMetricFamily(
                f"{NAMESPACE}_watchdog_unowned_bytes",
                "GPU memory those processes use, per NVML (last watchdog scan).",
                value=self._unowned[1],
            )
        yield CounterMetricFamily(
            f"{NAMESPACE}_usage_file_mismatches",
            "Times a container's memguard usage file disagreed with NVML's per-process count beyond the "
            "context allowance (a Warning Event names the pod; decisions used the larger figure).",
            value=self.usage_mismatches,
        )
        ready = GaugeMetricFamily(
            f"{NAMESPACE}_ready", "1 when the agent is ready (registered, inventory read)."
        )
        ready.add_metric([], 1 if snap is not None and snap.ready else 0)
        yield ready
        yield CounterMetricFamily(
            f"{NAMESPACE}_scrape_errors",
            "Scrapes that could not read the agent's state.",
            value=self.scrape_errors,
        )

    # -- serving ---------------------------------------------------------------------------------

    def wsgi_app(self) -> Callable[..., Any]:
        """/metrics (prometheus-client's app), /healthz, /readyz."""
        metrics_app = make_wsgi_app(self.registry)

        def probe(result: tuple[bool, str], start_response: Callable[..., Any]) -> list[bytes]:
            ok, why = result
            body = (why + "\n").encode()
            start_response(
                "200 OK" if ok else "503 Service Unavailable",
                [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body)))],
            )
            return [body]

        def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
            path = environ.get("PATH_INFO") or "/"
            if path == "/healthz":
                return probe(self.probes.live(), start_response)
            if path == "/readyz":
                return probe(self.probes.ready(), start_response)
            if path in ("/metrics", "/"):
                return metrics_app(environ, start_response)
            body = b"not found: try /metrics, /healthz or /readyz\n"
            start_response(
                "404 Not Found", [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))]
            )
            return [body]

        return app

    def serve(self, host: str, port: int) -> bool:
        """Start the HTTP server thread; False (error logged) when the address cannot be bound."""

        class Server(ThreadingWSGIServer):
            address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

        try:
            self._server = make_server(host, port, self.wsgi_app(), Server, handler_class=_QuietHandler)
        except OSError as e:
            log.error(
                "metrics, /healthz and /readyz unavailable: cannot listen on %s port %d "
                "(metrics.bindAddress, metrics.port): %s",
                host,
                port,
                e.strerror or e,
            )
            return False
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="gpufrac-metrics", daemon=True
        )
        self._thread.start()
        log.info("metrics on http://%s:%d/metrics (probes /healthz, /readyz)", host, self.port)
        return True

    @property
    def port(self) -> int | None:
        return None if self._server is None else int(self._server.server_address[1])

    async def start(self, agent: Any) -> None:
        """Serve for `agent` (call first thing in Agent.start, on its loop): the probes answer
        during start-up, and the counting functions of this module reach this instance."""
        global _active
        loop = asyncio.get_running_loop()
        self.source = lambda: capture_threadsafe(agent, loop)
        self.probes.ready_check = lambda: readiness(agent)
        self.probes.beat()
        self._heartbeat = asyncio.create_task(self._beat(), name="heartbeat")
        _active = self
        cfg = agent.config.metrics
        await asyncio.to_thread(self.serve, cfg.bind_address, cfg.port)

    async def _beat(self) -> None:
        while True:
            self.probes.beat()
            await asyncio.sleep(HEARTBEAT_INTERVAL)

    async def stop(self) -> None:
        global _active
        if _active is self:
            _active = None
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat
        if self._server is not None:
            await asyncio.to_thread(self._server.shutdown)
            self._server.server_close()
            self._server = None


class _QuietHandler(WSGIRequestHandler):
    """No access log line per scrape or probe."""

    def log_message(self, format: str, *args: Any) -> None:
        pass


# -- module-level counting API: goes to the running agent's Metrics ------------------------------

_active: Metrics | None = None


def active() -> Metrics | None:
    return _active


def count_wait(container: Any, seconds: float) -> None:
    if _active is not None:
        _active.count_wait(container, seconds)


def count_eviction(container: Any) -> None:
    if _active is not None:
        _active.count_eviction(container)


def count_swap(container: Any, direction: str) -> None:
    if _active is not None:
        _active.count_swap(container, direction)


def count_arbiter_request(kind: str, outcome: str) -> None:
    if _active is not None:
        _active.count_arbiter_request(kind, outcome)


def count_arbiter_limited(limit: str) -> None:
    if _active is not None:
        _active.count_arbiter_limited(limit)


def count_reap(action: str, reason: str = "idle") -> None:
    if _active is not None:
        _active.count_reap(action, reason)


def count_watchdog(action: str) -> None:
    if _active is not None:
        _active.count_watchdog(action)


def set_watchdog_unowned(processes: int, used_bytes: int) -> None:
    if _active is not None:
        _active.set_watchdog_unowned(processes, used_bytes)


def count_annotation_error(key: str) -> None:
    if _active is not None:
        _active.count_annotation_error(key)


def count_reconcile_error() -> None:
    if _active is not None:
        _active.count_reconcile_error()


def count_usage_mismatch() -> None:
    if _active is not None:
        _active.count_usage_mismatch()
