"""The metrics collector, probes, structured logs and Event reasons, without an agent.

The collector is fed NodeStatus snapshots as the agent's loop would take them, with
real usage files (abi.create_usage) written slot by slot as the shim does."""

from __future__ import annotations

import io
import json
import logging
import re
import threading
import time
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

import gpufrac
from gpufrac.agent.cli.status import format_status
from gpufrac.agent.kube import events
from gpufrac.agent.metrics.endpoint import Probes
from gpufrac.agent.metrics.names import annotation_label
from gpufrac.agent.metrics.registry import Metrics
from gpufrac.agent.status.model import ContainerStatus, GpuStatus, NodeStatus
from gpufrac.core import logs
from gpufrac.core.slices import FRACTION, MEMORY
from gpufrac.memguard import abi

pytestmark = pytest.mark.unit

GiB = 1 << 30


def gpu(index: int, requested: int = 0) -> GpuStatus:
    return GpuStatus(
        index=index,
        uuid=f"GPU-{index}",
        model="Sim H100",
        pci_bus_id=f"00000000:{index:02x}:00.0",
        numa_node=index // 2,
        memory_total_bytes=80 * GiB,
        memory_allocatable_bytes=79 * GiB,
        memory_requested_bytes=requested,
        memory_burst_granted_bytes=0,
        healthy=True,
        slices={
            MEMORY: {"total": 79, "allocated": 0, "free": 79},
            FRACTION: {"total": 100, "allocated": 0, "free": 100},
        },
        nvlinks={f"GPU-{1 - index}": 18} if index < 2 else {},
    )


def container(
    tmp: Path, key: str, pod: str, gpus: tuple[str, ...] = ("GPU-0",), **kw: object
) -> ContainerStatus:
    d = tmp / key
    d.mkdir(exist_ok=True)
    abi.create_usage(d)
    fields: dict[str, object] = dict(
        key=key,
        resource=MEMORY,
        namespace="default",
        pod=pod,
        container="main",
        gpus=list(gpus),
        slices=8,
        whole_gpu=False,
        request_bytes=8 * GiB,
        limit_bytes=24 * GiB,
        burst_granted_bytes=0,
        workload_class="batch",
        priority=0,
        created=time.time(),
        directory=str(d),
    )
    fields.update(kw)
    return ContainerStatus(**fields)  # type: ignore[arg-type]


def node(*containers: ContainerStatus) -> NodeStatus:
    return NodeStatus(
        node="n1",
        version="0",
        time=time.time(),
        ready=True,
        ready_reason="ok",
        registered={MEMORY: True, FRACTION: True},
        registrations={MEMORY: 1, FRACTION: 2},
        gpus=[gpu(0), gpu(1)],
        containers=list(containers),
    )


def scrape(m: Metrics) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    text = generate_latest(m.registry).decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = (s.name, frozenset(s.labels.items()))
            assert key not in out, f"duplicate series {key}"
            out[key] = s.value
    return out


def value(
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str
) -> float | None:
    found = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= ls]
    assert len(found) <= 1
    return found[0] if found else None


def test_departed_container_series_and_counts_disappear(tmp_path: Path) -> None:
    a, b = container(tmp_path, "m-a", "pod-a"), container(tmp_path, "m-b", "pod-b")
    state = {"snap": node(a, b)}
    m = Metrics(source=lambda: state["snap"])
    m.count_eviction("m-a")
    m.count_swap("m-a", "out")
    m.count_wait("m-b", 0.3)
    s = scrape(m)
    assert value(s, "gpufrac_container_memory_request_bytes", pod="pod-a", uuid="GPU-0") == 8 * GiB
    assert value(s, "gpufrac_container_evictions_total", pod="pod-a") == 1
    assert value(s, "gpufrac_container_swaps_total", pod="pod-a", direction="out") == 1
    assert value(s, "gpufrac_container_wait_seconds_count", pod="pod-b") == 1
    assert value(s, "gpufrac_container_wait_seconds_bucket", pod="pod-b", le="0.25") == 0
    assert value(s, "gpufrac_container_wait_seconds_bucket", pod="pod-b", le="0.5") == 1
    # pod-a goes: every series naming it is gone, and so are its counts.
    state["snap"] = node(b)
    m._containers["m-a"].since -= 10  # counted well before this snapshot
    s = scrape(m)
    assert not [k for k in s if ("pod", "pod-a") in k[1]]
    assert "m-a" not in m._containers
    assert value(s, "gpufrac_container_wait_seconds_count", pod="pod-b") == 1


def test_oom_refusals_never_go_down_when_a_process_leaves(tmp_path: Path) -> None:
    c = container(tmp_path, "m-a", "pod-a")
    m = Metrics(source=lambda: node(c))
    usage = abi.UsageFile(c.directory)
    try:
        slot = usage.usage.slots[0]
        slot.pid, slot.start_time, slot.oom_refusals = 1234, 99, 3
        assert value(scrape(m), "gpufrac_container_oom_refusals_total", pod="pod-a") == 3
        slot.oom_refusals = 5
        assert value(scrape(m), "gpufrac_container_oom_refusals_total", pod="pod-a") == 5
        # The process exits: its slot is cleared and reused by another one.
        slot.pid, slot.start_time, slot.oom_refusals = 4321, 100, 1
        assert value(scrape(m), "gpufrac_container_oom_refusals_total", pod="pod-a") == 6
        del slot  # the mapping closes only when no slot refers to it
    finally:
        usage.close()


def test_a_scrape_that_cannot_read_the_usage_file_counts_no_refusal_twice(tmp_path: Path) -> None:
    c = container(tmp_path, "m-a", "pod-a")
    m = Metrics(source=lambda: node(c))
    usage = abi.UsageFile(c.directory)
    path = Path(c.directory) / abi.USAGE_FILE
    try:
        slot = usage.usage.slots[0]
        slot.pid, slot.start_time, slot.oom_refusals = 1234, 99, 5
        assert value(scrape(m), "gpufrac_container_oom_refusals_total", pod="pod-a") == 5
        path.rename(path.with_name("away"))  # unreadable for one scrape
        assert value(scrape(m), "gpufrac_container_oom_refusals_total", pod="pod-a") == 5
        path.with_name("away").rename(path)
        assert value(scrape(m), "gpufrac_container_oom_refusals_total", pod="pod-a") == 5
        del slot
    finally:
        usage.close()


def test_counting_does_not_wait_for_a_scrape_in_progress(tmp_path: Path) -> None:
    """prometheus-client formats families as the collector yields them: the agent's loop,
    counting meanwhile, must not wait on that."""
    m = Metrics(source=lambda: node(container(tmp_path, "m-a", "pod-a")))
    scraping = m.collect()
    next(scraping), next(scraping)  # the build info, then the first GPU family
    counter = threading.Thread(target=m.count_eviction, args=("m-a",))
    counter.start()
    counter.join(10)
    alive = counter.is_alive()
    scraping.close()
    counter.join()
    assert not alive


def test_usage_file_figures(tmp_path: Path) -> None:
    c = container(tmp_path, "m-a", "pod-a")
    usage = abi.UsageFile(c.directory)
    try:
        usage.usage.total_used = 3 * GiB
        s0, s1 = usage.usage.slots[0], usage.usage.slots[1]
        s0.pid, s0.used_bytes, s0.swapped = 10, 2 * GiB, 1
        s1.pid, s1.used_bytes = 11, 1 * GiB
        s1.last_activity_ns = time.monotonic_ns() - 5 * 10**9
        del s0, s1
    finally:
        usage.close()
    s = scrape(Metrics(source=lambda: node(c)))
    assert value(s, "gpufrac_container_memory_used_bytes", pod="pod-a") == 3 * GiB
    assert value(s, "gpufrac_container_swapped_bytes", pod="pod-a") == 2 * GiB
    idle = value(s, "gpufrac_container_idle_seconds", pod="pod-a")
    assert idle is not None and 5 <= idle < 300


def test_unknown_pods_are_left_out_and_shared_labels_are_summed(tmp_path: Path) -> None:
    # Two containers whose pods are not known yet would collide on empty labels; a container
    # holding both resources on one GPU shares its label set: summed, never duplicated.
    snap = node(
        container(tmp_path, "m-x", ""),
        container(tmp_path, "f-y", ""),
        container(tmp_path, "m-a", "pod-a"),
        container(tmp_path, "f-a", "pod-a", resource=FRACTION, request_bytes=GiB, limit_bytes=GiB),
        container(tmp_path, "f-w", "whole", gpus=("GPU-0", "GPU-1"), whole_gpu=True, request_bytes=79 * GiB),
    )
    s = scrape(Metrics(source=lambda: snap))
    assert value(s, "gpufrac_container_memory_request_bytes", pod="pod-a") == 9 * GiB
    assert not [k for k in s if ("pod", "") in k[1]]
    for u in ("GPU-0", "GPU-1"):
        assert value(s, "gpufrac_container_memory_request_bytes", pod="whole", uuid=u) == 79 * GiB
    # usage and counters once per container (on its first GPU)
    assert value(s, "gpufrac_container_evictions_total", pod="whole", uuid="GPU-1") is None


def test_gpu_and_agent_series(tmp_path: Path) -> None:
    m = Metrics(source=lambda: node())
    m.count_arbiter_request("burst", "granted")
    m.count_arbiter_request("burst", "granted")
    m.count_annotation_error("gpufrac.dev/gpu-memory-limit.main")
    m.count_annotation_error("gpufrac.dev/gpu-memroy-limit")
    m.count_reap("notify")
    m.count_reconcile_error()
    s = scrape(m)
    labels = dict(uuid="GPU-1", index="1", model="Sim H100", numa_node="0", pci_bus_id="00000000:01:00.0")
    assert value(s, "gpufrac_gpu_memory_total_bytes", **labels) == 80 * GiB
    assert value(s, "gpufrac_gpu_free_slices", uuid="GPU-1", resource=MEMORY) == 79
    assert value(s, "gpufrac_gpu_nvlink_links", uuid="GPU-1", peer_uuid="GPU-0") == 18
    assert value(s, "gpufrac_registrations_total", resource=FRACTION) == 2
    assert value(s, "gpufrac_arbiter_requests_total", kind="burst", outcome="granted") == 2
    assert value(s, "gpufrac_annotation_errors_total", key="gpufrac.dev/gpu-memory-limit") == 1
    assert value(s, "gpufrac_annotation_errors_total", key="unknown") == 1
    assert value(s, "gpufrac_idle_reaps_total", action="notify") == 1
    assert value(s, "gpufrac_reconcile_errors_total") == 1
    assert value(s, "gpufrac_build_info", version=gpufrac.__version__) == 1
    assert value(s, "gpufrac_ready") == 1


def test_a_failing_snapshot_still_scrapes() -> None:
    def broken() -> NodeStatus:
        raise TimeoutError("loop busy")

    m = Metrics(source=broken)
    s = scrape(m)
    assert value(s, "gpufrac_scrape_errors_total") == 1
    assert value(s, "gpufrac_ready") == 0
    assert not [k for k in s if k[0].startswith("gpufrac_gpu_")]


def test_annotation_label_is_bounded() -> None:
    assert annotation_label("gpufrac.dev/idle-timeout") == "gpufrac.dev/idle-timeout"
    assert annotation_label("gpufrac.dev/gpu-fraction-limit.sidecar") == "gpufrac.dev/gpu-fraction-limit"
    assert annotation_label("gpufrac.dev/anything-a-user-typed") == "unknown"
    assert annotation_label("example.com/x") == "other"


def test_counting_api_refuses_unknown_label_values() -> None:
    m = Metrics()
    with pytest.raises(ValueError, match="direction"):
        m.count_swap("k", "sideways")
    with pytest.raises(ValueError, match="reap action"):
        m.count_reap("delete-everything")


def test_probes() -> None:
    now = [100.0]
    p = Probes(stale_after=15, clock=lambda: now[0])
    assert p.live() == (False, "the agent loop has not started")
    p.beat()
    assert p.live() == (True, "ok")
    assert p.ready() == (False, "starting")
    p.ready_check = lambda: (True, "ok")
    assert p.ready() == (True, "ok")
    now[0] += 20  # the loop stopped beating
    ok, why = p.live()
    assert not ok and "20s" in why
    assert not p.ready()[0]


def test_structured_log_lines() -> None:
    out = io.StringIO()
    log = logging.getLogger("gpufrac.test.logs")
    log.propagate = False
    log.setLevel(logging.INFO)
    for json_lines in (True, False):
        handler = logging.StreamHandler(out)
        handler.setFormatter(logs.JsonFormatter() if json_lines else logs.TextFormatter())
        log.addHandler(handler)
        try:
            logs.decision(
                log, "evict", "evicted %s", "pod-a", pod="pod-a", bytes=5, msg="clash", why="low priority"
            )
        finally:
            log.removeHandler(handler)
    json_line, text_line = out.getvalue().splitlines()
    doc = json.loads(json_line)
    assert doc["msg"] == "evicted pod-a" and doc["decision"] == "evict" and doc["bytes"] == 5
    assert doc["field_msg"] == "clash"  # a field never overwrites the line's own keys
    assert re.match(
        r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z INFO gpufrac.test.logs: evicted pod-a ", text_line
    )
    assert 'decision=evict pod=pod-a bytes=5 msg=clash why="low priority"' in text_line


def test_event_reasons_are_camel_case_and_checked() -> None:
    assert {
        "GpuLimitApplied",
        "InvalidAnnotation",
        "GpuMemoryEvicted",
        "GpuMemorySwappedOut",
    } <= events.REASONS
    for r in events.REASONS:
        assert re.fullmatch(r"(?:[A-Z][a-z0-9]+)+", r), r
    with pytest.raises(ValueError, match="unknown Event reason"):
        events.post(object(), object(), events.WARNING, "gpu evicted", "x")


def test_status_table_from_a_document(tmp_path: Path) -> None:
    snap = node(container(tmp_path, "m-a", "pod-a", used_bytes=3 * GiB, idle_seconds=125.0))
    snap.unreachable = {7: "fell off the bus"}
    text = format_status(snap.to_dict())
    assert "Ready" in text.splitlines()[0]
    gpu0 = next(line for line in text.splitlines() if line.startswith("0 "))
    assert "80Gi" in gpu0 and "79Gi" in gpu0 and "0/79" in gpu0 and "Healthy" in gpu0
    assert any(line.startswith("7 ") and "fell off the bus" in line for line in text.splitlines())
    row = next(line for line in text.splitlines() if "pod-a" in line)
    assert re.search(
        r"default\s+pod-a\s+main\s+0\s+gpu-memory 8\s+8Gi\s+24Gi\s+3Gi\s+0B\s+2m05s\s+-\s+-\s+-\s+batch", row
    ), row  # no compute share shown: compute shares off


def test_status_table_shows_compute_shares(tmp_path: Path) -> None:
    held = container(
        tmp_path,
        "m-a",
        "pod-a",
        compute_share=0.25,
        compute_mode="fair",
        compute_used=0.31,
        compute_paced=True,
    )
    free = container(tmp_path, "m-b", "pod-b", compute_share=0.75, compute_mode="strict", compute_used=0.5)
    unheld = container(tmp_path, "m-c", "pod-c", compute_share=0.1, compute_mode="fair", compute_used=0.6)
    unheld.compute_unheld = True
    text = format_status(node(held, free, unheld).to_dict())
    rows = {p: next(line for line in text.splitlines() if p in line) for p in ("pod-a", "pod-b", "pod-c")}
    assert re.search(r"\s25%\s+fair\s+31% held\s+batch", rows["pod-a"]), rows["pod-a"]
    assert re.search(r"\s75%\s+strict\s+50%\s+batch", rows["pod-b"]), rows["pod-b"]
    assert re.search(r"\s10%\s+fair\s+60% UNHELD\s+batch", rows["pod-c"]), rows["pod-c"]
    assert "SHARE" in text and "MODE" in text and "COMPUTE" in text


def test_a_claims_series_carry_its_name_and_status_shows_it(tmp_path: Path) -> None:
    # DRA mode: a claim's booking, bound to its first pod, no container of its own.
    claim = container(tmp_path, "c-1", "server", container="", claim="llm-gpu")
    plain = container(tmp_path, "m-1", "worker")
    m = Metrics(source=lambda: node(claim, plain))
    s = scrape(m)
    assert value(s, "gpufrac_container_memory_limit_bytes", pod="server", claim="llm-gpu") == 24 * GiB
    assert value(s, "gpufrac_container_memory_limit_bytes", pod="worker", claim="") == 24 * GiB
    table = format_status(json.loads(json.dumps(node(claim, plain).to_dict())))
    (row,) = [line for line in table.splitlines() if "server" in line]
    assert "claim llm-gpu" in row
