"""Every series gpufrac exports, named as a scrape shows it, with its labels and their values.

deploy/daemonset/METRICS.md documents them and the Grafana dashboard is written against it.
Counters are named with the `_total` the exposition shows (prometheus-client drops it when
given and adds it back); a histogram by its base name (the scrape shows `_bucket`, `_sum`,
`_count`); the build info with its `_info`. grep for a name a dashboard or alert uses and
you land here, and on the one place each is used.
"""

from __future__ import annotations

from gpufrac.core.annotations import PER_CONTAINER_KEYS, PREFIX, USER_KEYS

# -- the agent: counted as things happen (metrics/registry.py) --------------------------------
BUILD_INFO = "gpufrac_build_info"
SCRAPE_ERRORS = "gpufrac_scrape_errors_total"
RECONCILE_ERRORS = "gpufrac_reconcile_errors_total"
ARBITER_REQUESTS = "gpufrac_arbiter_requests_total"
ARBITER_LIMITED = "gpufrac_arbiter_limited_total"
ANNOTATION_ERRORS = "gpufrac_annotation_errors_total"
IDLE_REAPS = "gpufrac_idle_reaps_total"
WATCHDOG_ACTIONS_TOTAL = "gpufrac_watchdog_actions_total"
WATCHDOG_UNOWNED_PROCESSES = "gpufrac_watchdog_unowned_processes"
WATCHDOG_UNOWNED_BYTES = "gpufrac_watchdog_unowned_bytes"
USAGE_FILE_MISMATCHES = "gpufrac_usage_file_mismatches_total"

# -- the agent, read at scrape time (metrics/snapshot.py) -------------------------------------
REGISTRATIONS = "gpufrac_registrations_total"
READY = "gpufrac_ready"

# -- per GPU, read at scrape time (metrics/snapshot.py) ---------------------------------------
GPU_MEMORY_TOTAL = "gpufrac_gpu_memory_total_bytes"
GPU_MEMORY_ALLOCATABLE = "gpufrac_gpu_memory_allocatable_bytes"
GPU_MEMORY_REQUESTED = "gpufrac_gpu_memory_requested_bytes"
GPU_MEMORY_USED = "gpufrac_gpu_memory_used_bytes"
GPU_MEMORY_BURST_GRANTED = "gpufrac_gpu_memory_burst_granted_bytes"
GPU_UTILIZATION = "gpufrac_gpu_utilization_ratio"
GPU_HEALTHY = "gpufrac_gpu_healthy"
GPU_FREE_SLICES = "gpufrac_gpu_free_slices"
GPU_NVLINK_LINKS = "gpufrac_gpu_nvlink_links"
GPU_XID_ERRORS = "gpufrac_gpu_xid_errors_total"
GPU_MIG_ENABLED = "gpufrac_gpu_mig_enabled"

# -- per container and GPU, read at scrape time (metrics/snapshot.py; counts: containers.py) --
CONTAINER_MEMORY_REQUEST = "gpufrac_container_memory_request_bytes"
CONTAINER_MEMORY_LIMIT = "gpufrac_container_memory_limit_bytes"
CONTAINER_MEMORY_USED = "gpufrac_container_memory_used_bytes"
CONTAINER_MEMORY_BURST_GRANTED = "gpufrac_container_memory_burst_granted_bytes"
CONTAINER_SWAPPED = "gpufrac_container_swapped_bytes"
CONTAINER_IDLE = "gpufrac_container_idle_seconds"
CONTAINER_EVICTIONS = "gpufrac_container_evictions_total"
CONTAINER_SWAPS = "gpufrac_container_swaps_total"
CONTAINER_OOM_REFUSALS = "gpufrac_container_oom_refusals_total"
CONTAINER_WAIT_SECONDS = "gpufrac_container_wait_seconds"  # a histogram
CONTAINER_COMPUTE_SHARE = "gpufrac_container_compute_share"
CONTAINER_COMPUTE_UTILIZATION = "gpufrac_container_compute_utilization_ratio"
CONTAINER_COMPUTE_PACED = "gpufrac_container_compute_paced"
CONTAINER_COMPUTE_THROTTLED = "gpufrac_container_compute_throttled_seconds_total"

# Every name above: what a scrape may show (tests/agent/metrics/test_metrics.py holds it to one).
EXPORTED = frozenset(
    v for k, v in dict(globals()).items() if k.isupper() and isinstance(v, str) and v.startswith("gpufrac_")
)
# UUID repeats uuid under the DCGM exporter's label name, so a query joins gpufrac and
# DCGM series with one on(UUID) (deploy/daemonset/METRICS.md); uuid stays for dashboards.
GPU_LABELS = ("uuid", "index", "model", "numa_node", "pci_bus_id", "UUID")
# claim: a DRA claim's name (its series: `pod` its first pod, `container` empty); "" otherwise.
CONTAINER_LABELS = ("namespace", "pod", "container", "claim", "uuid", "UUID")
# Wait-resolver waits: from a free slot a moment later up to the longest wait timeouts.
WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
SWAP_DIRECTIONS = ("out", "in")
# dry_run: what the reaper would have done in idle.dryRun; delete: idle.allowDelete without the Eviction API.
REAP_ACTIONS = ("notify", "swap", "evict", "delete", "dry_run")
REAP_REASONS = ("idle", "max_runtime")
# hidden_*: a GPU process whose cgroup file the kernel refuses (gpufrac.agent.watchdog.service).
WATCHDOG_ACTIONS = ("report", "kill", "hidden_report", "hidden_kill")


def annotation_label(key: str) -> str:
    """The `key` label of an annotation error, bounded: the annotation keys gpufrac knows
    (per-container overrides folded into their base key), else "unknown"."""
    if key in USER_KEYS:
        return key
    base = key.rpartition(".")[0]
    if base in PER_CONTAINER_KEYS:
        return base
    return "unknown" if key.startswith(PREFIX) else "other"
