"""/metrics, /healthz and /readyz of the real agent, scraped over HTTP during a simgpu scenario.

The kubelet emulator admits pods (annotations from kmock's apiserver), real workloads
allocate under the shim, and every value is checked against what happened: bytes
requested per GPU, each container's request/limit/usage, refusals, counts. Departed
containers' series must be gone; the exposition must pass `promtool check metrics`
and match deploy/daemonset/METRICS.md, which the Grafana dashboard is built on."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections import Counter
from typing import Any

import pynvml
import pytest

from gpufrac.agent.metrics import names
from gpufrac.core import slices
from gpufrac.core.native import REPO_ROOT
from gpufrac.core.slices import FRACTION, MEMORY
from gpufrac.simgpu import faults
from gpufrac.simgpu.kubelet import Pod
from tests.fixtures.kube import KubeServer
from tests.fixtures.metrics import (
    CTX,
    NODE,
    GiB,
    InprocNode,
    Scrape,
    finish,
    http_get,
    result,
    start_node,
)

METRICS_MD = REPO_ROOT / "deploy" / "daemonset" / "METRICS.md"
RESERVED = GiB  # the default reservedPerGpu


def gpu_uuid(node: InprocNode, pod: Pod) -> str:
    ((ids,),) = [list(per.values()) for per in node.kubelet.pod_devices(pod.uid).values()]
    return slices.parse(ids[0]).gpu_uuid


def nvml_total(uuid: str) -> int:
    return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByUUID(uuid)).total)


def expected_requested(node: InprocNode) -> Counter[str]:
    """Bytes requested per GPU from what the kubelet admitted: memory slices are 1Gi, a
    fraction slice 1 % of the GPU's allocatable memory (docs/design.md section 1)."""
    out: Counter[str] = Counter()
    for pod in node.kubelet.pods():
        for per in node.kubelet.pod_devices(pod.uid).values():
            for resource, ids in per.items():
                uuid = slices.parse(ids[0]).gpu_uuid
                if resource == MEMORY:
                    out[uuid] += len(ids) * GiB
                else:
                    out[uuid] += (nvml_total(uuid) - RESERVED) * len(ids) // 100
    return out


def expected_free(node: InprocNode, uuid: str, resource: str) -> int:
    """Slices of the GPU the kubelet may still hand out: healthy in its last ListAndWatch
    snapshot and not allocated to any pod."""
    allocated = {
        d
        for pod in node.kubelet.pods()
        for per in node.kubelet.pod_devices(pod.uid).values()
        for d in per.get(resource, [])
    }
    return sum(1 for d in node.kubelet.healthy(resource) if d.startswith(uuid + "::") and d not in allocated)


@pytest.mark.tools  # promtool
def test_scrape_matches_the_scenario(node: InprocNode) -> None:
    server = node.admit("server", MEMORY, 8, {"gpufrac.dev/gpu-memory-limit": "24Gi"})
    frac = node.admit("notebook", FRACTION, 25)
    bad = node.admit("trainer", MEMORY, 4, {"gpufrac.dev/gpu-memory-limit": "4 GB please"})
    node.wait_scrape(
        lambda s: (
            s.get("gpufrac_container_memory_limit_bytes", pod="server") == 24 * GiB
            and s.get("gpufrac_container_memory_request_bytes", pod="trainer") == 4 * GiB
            and s.get("gpufrac_container_memory_request_bytes", pod="notebook") is not None
        ),
        "all three containers with their limits",
    )
    s = node.wait_scrape(
        lambda s: s.get("gpufrac_annotation_errors_total", key="gpufrac.dev/gpu-memory-limit") == 1,
        "the refused annotation counted",
    )

    # Per GPU: what the kubelet admitted, in bytes; labels from NVML.
    want = expected_requested(node)
    assert sum(want.values()) > 0
    for i in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        uuid = pynvml.nvmlDeviceGetUUID(h)
        total = int(pynvml.nvmlDeviceGetMemoryInfo(h).total)
        labels = {
            "uuid": uuid,
            "index": str(i),
            "model": pynvml.nvmlDeviceGetName(h),
            "pci_bus_id": pynvml.nvmlDeviceGetPciInfo(h).busId,
        }
        assert s.get("gpufrac_gpu_memory_total_bytes", **labels) == total
        assert s.get("gpufrac_gpu_memory_allocatable_bytes", uuid=uuid) == total - RESERVED
        assert s.get("gpufrac_gpu_memory_requested_bytes", uuid=uuid) == want[uuid], f"GPU {i}"
        assert s.get("gpufrac_gpu_healthy", uuid=uuid) == 1
        peers = s.series("gpufrac_gpu_nvlink_links", uuid=uuid)
        assert len(peers) == pynvml.nvmlDeviceGetCount() - 1  # dgx-h100: NVSwitch to every peer
        assert all(s.get("gpufrac_gpu_nvlink_links", uuid=uuid, peer_uuid=p["peer_uuid"]) > 0 for p in peers)
    # Free slices: what the kubelet may still admit on each GPU (its own view, polled until in step).
    for pod in (server, frac):
        uuid = gpu_uuid(node, pod)
        for resource in slices.RESOURCES:
            node.wait_scrape(
                lambda s, u=uuid, r=resource: (
                    s.get("gpufrac_gpu_free_slices", uuid=u, resource=r) == expected_free(node, u, r)
                ),
                f"free {resource} slices of {uuid}",
            )

    # Per container: request and limit as the pods asked (the bad limit fell back to the request).
    frac_uuid = gpu_uuid(node, frac)
    frac_bytes = (nvml_total(frac_uuid) - RESERVED) * 25 // 100
    for pod, request, limit in (
        (server, 8 * GiB, 24 * GiB),
        (frac, frac_bytes, frac_bytes),
        (bad, 4 * GiB, 4 * GiB),
    ):
        labels = {"namespace": "default", "pod": pod.name, "container": "main", "uuid": gpu_uuid(node, pod)}
        assert s.get("gpufrac_container_memory_request_bytes", **labels) == request
        assert s.get("gpufrac_container_memory_limit_bytes", **labels) == limit
    assert {r: s.get("gpufrac_registrations_total", resource=r) for r in slices.RESOURCES} == {
        r: len(node.kubelet.registrations(r)) for r in slices.RESOURCES
    }

    # Real workloads: 3 GiB in the server (and its process's context); the trainer tries
    # 5 GiB past its 4 GiB limit.
    # One after the other: the shim measures a context as the GPU's used memory around its
    # creation, so a neighbour allocating meanwhile would be charged to it (memguard/native/
    # mg_ctx.c); on a quiet GPU each container is charged exactly its own.
    w1 = node.workload(server, "alloc", 3 * GiB, "hold")
    w2 = None
    try:
        assert result(w1, "alloc") == 0 and result(w1, "hold") == 0
        w2 = node.workload(bad, "alloc", 5 * GiB, "hold")
        assert result(w2, "alloc") == 2  # CUDA_ERROR_OUT_OF_MEMORY
        assert result(w2, "hold") == 0
        uuid = gpu_uuid(node, server)
        s = node.wait_scrape(
            lambda s: (
                s.get("gpufrac_container_memory_used_bytes", pod="server") == 3 * GiB + CTX
                and s.get("gpufrac_container_oom_refusals_total", pod="trainer") == 1
            ),
            "the server's 3 GiB and the trainer's refusal",
        )
        nvml_used = int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByUUID(uuid)).used)
        assert nvml_used >= 3 * GiB + CTX
        assert s.get("gpufrac_gpu_memory_used_bytes", uuid=uuid) == nvml_used
        assert s.get("gpufrac_container_oom_refusals_total", pod="server") == 0
    finally:
        finish(w1)
        if w2 is not None:
            finish(w2)
    # The trainer's process is gone, its usage slot cleared: the counter does not go back.
    node.wait_scrape(
        lambda s: s.get("gpufrac_container_memory_used_bytes", pod="server") == 0, "the server freed"
    )
    assert node.scrape().get("gpufrac_container_oom_refusals_total", pod="trainer") == 1

    # Utilisation as NVML reports it.
    index = next(
        i for i in range(8) if pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i)) == uuid
    )
    faults.set_utilisation(node.state, index, 37)
    node.wait_scrape(lambda s: s.get("gpufrac_gpu_utilization_ratio", uuid=uuid) == 0.37, "37 % utilisation")

    # What the arbiter, swap and reaper count through the agent's Metrics lands on the container's series.
    alloc = node.alloc_of(server)
    metrics = node.agent.metrics

    async def count() -> None:
        metrics.count_wait(alloc, 0.3)
        metrics.count_wait(alloc.key, 7.0)
        metrics.count_eviction(alloc)
        metrics.count_swap(alloc, "out")
        metrics.count_arbiter_request("burst", "granted")

    node.thread.call(count)
    s = node.scrape()
    who = {"pod": "server", "uuid": uuid}
    assert s.get("gpufrac_container_wait_seconds_count", **who) == 2
    assert s.get("gpufrac_container_wait_seconds_sum", **who) == 7.3
    assert s.get("gpufrac_container_wait_seconds_bucket", le="0.5", **who) == 1
    assert s.get("gpufrac_container_wait_seconds_bucket", le="10.0", **who) == 2
    assert s.get("gpufrac_container_evictions_total", **who) == 1
    assert s.get("gpufrac_container_swaps_total", direction="out", **who) == 1
    assert s.get("gpufrac_arbiter_requests_total", kind="burst", outcome="granted") == 1

    check_promtool(s)
    check_documented(s)


def test_departed_containers_series_disappear(node: InprocNode) -> None:
    stay = node.admit("stays", MEMORY, 10)
    leave = node.admit("leaves", MEMORY, 20)
    node.wait_scrape(
        lambda s: (
            s.get("gpufrac_container_memory_request_bytes", pod="leaves") == 20 * GiB
            and s.get("gpufrac_container_memory_request_bytes", pod="stays") == 10 * GiB
        ),
        "both containers",
    )
    alloc = node.alloc_of(leave)
    node.thread.call(lambda: _count_eviction(node, alloc))
    assert node.scrape().get("gpufrac_container_evictions_total", pod="leaves") == 1
    uuid = gpu_uuid(node, leave)

    node.kube.core_v1().delete_namespaced_pod("leaves", "default")
    node.kubelet.delete(leave)  # the kubelet forgets the pod; the agent notices through pod-resources
    s = node.wait_scrape(lambda s: not _series_of(s, "leaves"), "the departed pod's series to go")
    assert s.get("gpufrac_container_memory_request_bytes", pod="stays") == 10 * GiB
    assert s.get("gpufrac_gpu_memory_requested_bytes", uuid=uuid) == expected_requested(node)[uuid]
    # Counts of the departed container are gone for good: a new pod on the same devices starts at 0.
    again = node.admit("leaves", MEMORY, 20)
    s = node.wait_scrape(
        lambda s: s.get("gpufrac_container_memory_request_bytes", pod="leaves") == 20 * GiB, "the new pod"
    )
    assert s.get("gpufrac_container_evictions_total", pod="leaves") == 0
    assert {stay.name, again.name} == {p.name for p in node.kubelet.pods()}


def test_gpu_health_in_metrics_and_on_the_node(node: InprocNode) -> None:
    pod = node.admit("server", MEMORY, 8)
    node.wait_scrape(
        lambda s: s.get("gpufrac_container_memory_request_bytes", pod="server") is not None, "pod"
    )
    used = gpu_uuid(node, pod)
    index = next(
        i for i in range(8) if pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i)) != used
    )
    bad = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(index))
    faults.inject_xid(node.state, index, 48)  # double-bit ECC error: the GPU is Unhealthy
    s = node.wait_scrape(lambda s: s.get("gpufrac_gpu_healthy", uuid=bad) == 0, "the GPU Unhealthy")
    assert s.get("gpufrac_gpu_xid_errors_total", uuid=bad, xid="48") == 1
    assert all(s.get("gpufrac_gpu_free_slices", uuid=bad, resource=r) == 0 for r in slices.RESOURCES)
    assert s.get("gpufrac_gpu_healthy", uuid=used) == 1

    def node_event() -> list[dict[str, Any]]:
        return [
            e
            for e in node.kube.events("default")
            if e["reason"] == "GpuUnhealthy"
            and {k: e["involvedObject"].get(k) for k in ("kind", "name", "uid")}
            == {"kind": "Node", "name": NODE, "uid": NODE}
        ]

    (event,) = node.wait(node_event, "the GpuUnhealthy Event on the Node")
    assert event["type"] == "Warning" and bad in event["message"] and "XID 48" in event["message"]


async def _count_eviction(node: InprocNode, alloc: Any) -> None:
    node.agent.metrics.count_eviction(alloc)


def _series_of(s: Scrape, pod: str) -> list[tuple[str, frozenset[tuple[str, str]]]]:
    return [k for k in s.samples if ("pod", pod) in k[1]]


def test_probes_follow_kubelet_registration(in_process_nvml: Any, kube_server: KubeServer) -> None:
    node, stop = start_node(in_process_nvml, kube_server, kubelet=False)
    try:
        node.wait(lambda: http_get(node.url + "/healthz")[0] == 200, "/healthz")
        code, body = http_get(node.url + "/readyz")
        assert code == 503 and "not registered with the kubelet" in body
        assert node.scrape().get("gpufrac_ready") == 0
        node.kubelet.start()  # the kubelet comes up: the agent registers both resources
        node.wait(lambda: http_get(node.url + "/readyz") == (200, "ok\n"), "/readyz to turn ready")
        assert node.scrape().get("gpufrac_ready") == 1
        assert http_get(node.url + "/healthz") == (200, "ok\n")
        assert http_get(node.url + "/nothing-here")[0] == 404
    finally:
        stop()


# -- exposition checks ---------------------------------------------------------------------------


def check_promtool(s: Scrape) -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: run `make tools` (Debian package prometheus)"
    p = subprocess.run(
        [promtool, "check", "metrics"], input=s.text, capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 0 and not p.stdout.strip() and not p.stderr.strip(), p.stdout + p.stderr


def documented() -> dict[str, str]:
    """METRICS.md's table rows: name -> type."""
    rows = re.findall(r"^\| `(gpufrac_\w+)` \| (\w+) \|", METRICS_MD.read_text(), re.MULTILINE)
    assert rows, f"no metric rows in {METRICS_MD}"
    return dict(rows)


def check_documented(s: Scrape) -> None:
    """Every gpufrac_ family exposed is documented with its type, and every documented one exposed."""
    exposed = {}
    for family, type_ in s.types.items():
        if family.startswith("gpufrac_"):
            exposed[family + "_total" if type_ == "counter" else family] = type_
    docs = documented()
    # Families that appear only once their subsystem reports (the watchdog's first scan).
    optional = {n for n in docs if n.startswith("gpufrac_watchdog_unowned")}
    assert set(exposed) <= set(docs), f"undocumented: {sorted(set(exposed) - set(docs))}"
    assert {n: docs[n] for n in exposed} == exposed, "types differ from METRICS.md"
    assert set(docs) - optional <= set(exposed), (
        f"documented, not exposed: {sorted(set(docs) - set(exposed))}"
    )
    # ...and metrics/names.py, where the code takes every name from, holds exactly those.
    assert set(docs) == names.EXPORTED, (
        f"names.py and METRICS.md differ: {sorted(names.EXPORTED ^ set(docs))}"
    )
