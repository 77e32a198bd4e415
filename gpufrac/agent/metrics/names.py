"""The names and label values of gpufrac's series (deploy/daemonset/METRICS.md lists them; the
Grafana dashboard is written against it)."""

from __future__ import annotations

from gpufrac.core.annotations import LIMIT_KEYS, PREFIX, USER_KEYS

NAMESPACE = "gpufrac"
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
# hidden_*: a GPU process whose cgroup file the kernel refuses (gpufrac.agent.watchdog).
WATCHDOG_ACTIONS = ("report", "kill", "hidden_report", "hidden_kill")


def annotation_label(key: str) -> str:
    """The `key` label of an annotation error, bounded: the annotation keys gpufrac knows
    (per-container overrides folded into their base key), else "unknown"."""
    if key in USER_KEYS:
        return key
    base = key.rpartition(".")[0]
    if base in LIMIT_KEYS:
        return base
    return "unknown" if key.startswith(PREFIX) else "other"
