"""Prometheus metrics, /healthz and /readyz: every metric gpufrac exports is defined here.

One HTTP server (prometheus-client's WSGI app wrapped with the two probes) runs in
its own thread on metrics.bindAddress:metrics.port, so a slow scrape never blocks
the agent's loop. Names follow deploy/daemonset/METRICS.md, which the Grafana
dashboard is written against.

    names.py       series names, label names and their bounded values
    registry.py    Metrics: the registry, the agent-wide Counters and Gauges, the counting
                   API, serving
    containers.py  per-container counts, kept by container key
    snapshot.py    the series read at scrape time from the agent's state (per GPU, per
                   container, registrations, readiness)
    endpoint.py    the probes and the WSGI app

The composition root (gpufrac.agent.main) builds one Metrics and hands it to every part
that counts; each part declares the narrow Protocol it needs next to itself (the
arbiter's ArbiterMetrics, the watchdog's WatchdogMetrics, ...). The counting API, on the
agent's loop or any thread:

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
    metrics.count_usage_mismatch()               # a usage file disagreed with NVML beyond the allowance

`alloc` is a ContainerAlloc or its container key. Per-container counts are dropped once
the container is gone from the ledger.
"""
