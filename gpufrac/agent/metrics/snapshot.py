"""The series read at scrape time from the agent's state: per GPU, per container, and the
agent's registrations and readiness.

They are not long-lived labelled gauges: a collector computes them at each scrape from a
snapshot of the agent's state (gpufrac.agent.status: taken on the loop, enriched with NVML
and the usage files in the scrape thread). So the series of a container that is gone
disappear with it, and no pid or device-ID label ever exists.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from prometheus_client import Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from gpufrac.agent.metrics import names
from gpufrac.agent.metrics.containers import ContainerCounts
from gpufrac.agent.metrics.names import CONTAINER_LABELS, GPU_LABELS, SWAP_DIRECTIONS
from gpufrac.agent.status.enrich import enrich
from gpufrac.agent.status.model import NodeStatus, UsageView

log = logging.getLogger(__name__)

Source = Callable[[], "NodeStatus | None"]  # the agent's state now; None: no agent (yet)


class NodeCollector(Collector):
    """The scrape-time series. `source` gives the snapshot (None: only the agent-wide ones,
    not ready); a source that fails counts in `scrape_errors` and the scrape goes on."""

    def __init__(self, source: Source | None, counts: ContainerCounts, scrape_errors: Counter) -> None:
        self.source = source
        self.counts = counts
        self.scrape_errors = scrape_errors

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        snap: NodeStatus | None = None
        views: dict[str, UsageView] = {}
        if self.source is not None:
            try:
                snap = self.source()
                if snap is not None:
                    views = enrich(snap)
            except Exception as e:  # a scrape shows what it can; the agent goes on
                self.scrape_errors.inc()
                log.warning("metrics: agent state unavailable for this scrape: %s", e)
                snap = None
        # Built under the lock, yielded after it: prometheus-client formats each family as it
        # comes, and the loop's counting must not wait for a slow scrape.
        with self.counts.lock:
            families: list[Metric] = []
            if snap is not None:
                self.counts.prune({c.key for c in snap.containers})
                families += gpu_families(snap)
                families += container_families(snap, views, self.counts)
            families += agent_families(snap)
        yield from families


def agent_families(snap: NodeStatus | None) -> Iterator[Metric]:
    regs = CounterMetricFamily(
        names.REGISTRATIONS, "Device-plugin registrations with the kubelet.", labels=["resource"]
    )
    if snap is not None:
        for resource, n in snap.registrations.items():
            regs.add_metric([resource], n)
    yield regs
    ready = GaugeMetricFamily(names.READY, "1 when the agent is ready (registered, inventory read).")
    ready.add_metric([], 1 if snap is not None and snap.ready else 0)
    yield ready


def gpu_families(snap: NodeStatus) -> Iterator[Metric]:
    def gauge(name: str, doc: str, extra: tuple[str, ...] = ()) -> GaugeMetricFamily:
        return GaugeMetricFamily(name, doc, labels=[*GPU_LABELS, *extra])

    total = gauge(names.GPU_MEMORY_TOTAL, "Physical memory of the GPU.")
    alloc = gauge(names.GPU_MEMORY_ALLOCATABLE, "GPU memory gpufrac hands out: total minus reservedPerGpu.")
    req = gauge(names.GPU_MEMORY_REQUESTED, "Sum of the guaranteed requests placed on the GPU.")
    used = gauge(names.GPU_MEMORY_USED, "GPU memory in use, as NVML reports it.")
    burst = gauge(names.GPU_MEMORY_BURST_GRANTED, "Burst grants outstanding above the requests on the GPU.")
    util = gauge(names.GPU_UTILIZATION, "SM utilisation of the GPU, 0 to 1 (NVML).")
    healthy = gauge(names.GPU_HEALTHY, "1 while the GPU is Healthy, 0 while Unhealthy.")
    free = gauge(
        names.GPU_FREE_SLICES, "Unallocated slices the kubelet may still admit, per resource.", ("resource",)
    )
    nvlink = gauge(
        names.GPU_NVLINK_LINKS, "Active NVLink links from the GPU to each peer GPU.", ("peer_uuid",)
    )
    xid = CounterMetricFamily(
        names.GPU_XID_ERRORS,
        "XID errors NVML reported for the GPU since the agent started (ignored XIDs included).",
        labels=[*GPU_LABELS, "xid"],
    )
    mig = gauge(
        names.GPU_MIG_ENABLED,
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
        for x, seen in sorted(g.xid_errors.items()):
            xid.add_metric([*labels, str(x)], seen)
    yield from (total, alloc, req, used, burst, util, healthy, free, nvlink, xid, mig)


def container_families(
    snap: NodeStatus, views: dict[str, UsageView], counts: ContainerCounts
) -> Iterator[Metric]:
    """Call with counts.lock held."""

    # One series per (namespace, pod, container, claim, GPU). A container of a pod not known
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
        wait_buckets: dict[str, float] = field(default_factory=dict)  # le -> cumulative count
        wait_sum: float = 0.0
        primary: bool = False  # the first GPU of some container: usage and counters shown here
        compute: tuple[float, float, float, bool] | None = None  # share, used, throttled s, paced

    rows: dict[tuple[str, ...], Row] = {}
    for c in snap.containers:
        if not c.known:
            continue
        counted = counts.of(c.key)
        view = views.get(c.key)
        for i, uuid in enumerate(c.gpus):
            row = rows.setdefault((c.namespace, c.pod, c.container, c.claim, uuid), Row())
            row.request += c.request_bytes
            row.limit += c.limit_bytes
            row.burst += c.burst_granted_bytes
            if i:  # usage and events are the container's, shown on its first GPU
                continue
            row.primary = True
            if view is not None:
                row.used = (row.used or 0) + view.used_bytes
                row.swapped += view.swapped_bytes
            if c.compute_share is not None and c.compute_used is not None:
                row.compute = (c.compute_share, c.compute_used, c.compute_throttled_seconds, c.compute_paced)
            if c.idle_seconds is not None:  # enrich: the activity tracker's or the usage file's
                row.idle = c.idle_seconds if row.idle is None else min(row.idle, c.idle_seconds)
            row.oom += counted.oom_total(view.slot_refusals if view is not None else None)
            row.evictions += int(counted.eviction_count())
            for d, n in counted.swap_counts().items():
                row.swaps[d] += int(n)
            buckets, total = counted.wait_figures()
            for le, n in buckets:
                row.wait_buckets[le] = row.wait_buckets.get(le, 0.0) + n
            row.wait_sum += total

    def gauge(name: str, doc: str) -> GaugeMetricFamily:
        return GaugeMetricFamily(name, doc, labels=CONTAINER_LABELS)

    def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> CounterMetricFamily:
        return CounterMetricFamily(name, doc, labels=[*CONTAINER_LABELS, *extra])

    req = gauge(names.CONTAINER_MEMORY_REQUEST, "Guaranteed GPU memory of the container on the GPU.")
    lim = gauge(names.CONTAINER_MEMORY_LIMIT, "Burst ceiling of the container's GPU memory.")
    used = gauge(
        names.CONTAINER_MEMORY_USED, "GPU memory the container uses, all its processes (memguard usage file)."
    )
    burst = gauge(
        names.CONTAINER_MEMORY_BURST_GRANTED, "The container's current burst grant above its request."
    )
    swapped = gauge(names.CONTAINER_SWAPPED, "The container's GPU memory currently held in host RAM.")
    idle = gauge(
        names.CONTAINER_IDLE, "Seconds since the container's last GPU work (a launch, or NVML activity)."
    )
    evictions = counter(
        names.CONTAINER_EVICTIONS, "Times the container's processes were evicted to free GPU memory."
    )
    swaps = counter(
        names.CONTAINER_SWAPS,
        "Swaps of the container's GPU memory to host RAM (out) and back (in).",
        ("direction",),
    )
    oom = counter(
        names.CONTAINER_OOM_REFUSALS, "Allocations of the container refused with CUDA_ERROR_OUT_OF_MEMORY."
    )
    share = gauge(
        names.CONTAINER_COMPUTE_SHARE, "The container's compute share of its GPU, 0 to 1 (docs/compute.md)."
    )
    cused = gauge(
        names.CONTAINER_COMPUTE_UTILIZATION,
        "The container's use of its GPU's compute as the driver measures it (NVML per process), 0 to 1.",
    )
    paced = gauge(
        names.CONTAINER_COMPUTE_PACED, "1 while the container's launches are paced to hold it to its share."
    )
    throttled = counter(
        names.CONTAINER_COMPUTE_THROTTLED,
        "Time the container's launches were paced, since the agent started.",
    )
    waits = HistogramMetricFamily(
        names.CONTAINER_WAIT_SECONDS,
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
        waits.add_metric(lv, list(r.wait_buckets.items()), r.wait_sum)
        if r.compute is not None:
            share.add_metric(lv, r.compute[0])
            cused.add_metric(lv, r.compute[1])
            throttled.add_metric(lv, r.compute[2])
            paced.add_metric(lv, 1 if r.compute[3] else 0)
    yield from (req, lim, used, burst, swapped, idle, evictions, swaps, oom, waits)
    yield from (share, cused, paced, throttled)
