"""A collision eviction kills the victim's processes (as an OOM kill would; it is not the
Eviction API) and marks its pod the way Kubernetes marks a pod it disrupts: the
DisruptionTarget condition, set through pods/status, next to the Warning Event."""

from __future__ import annotations

from collections.abc import Callable

from gpufrac.agent.arbiter.resolvers import REASON_EVICTED
from gpufrac.agent.kube.events import CONDITION_GPU_MEMORY_RECLAIMED
from gpufrac.agent.kube.recorder import DISRUPTION_TARGET
from tests.fixtures.arbiter_harness import ArbiterNode, GiB
from tests.fixtures.kube import KubeServer

Make = Callable[..., ArbiterNode]


def _conditions(kube: KubeServer, name: str) -> dict[str, dict[str, str]]:
    pod = kube.core_v1().read_namespaced_pod_status(name, "default")
    return {c.type: c.to_dict() for c in pod.status.conditions or []}


def test_an_evicted_pod_gets_the_disruption_target_condition(
    make_node: Make, kube_server: KubeServer
) -> None:
    node = make_node(resolvers=["evict", "wait"])
    low = node.add("low", 30, "78Gi", priority=0)
    high = node.add("high", 30, "60Gi", priority=1000, wait_timeout="30s")
    # The kubelet's own conditions are there before: the patch must merge, not replace.
    for name in ("low", "high"):
        kube_server.core_v1().patch_namespaced_pod_status(
            name, "default", {"status": {"conditions": [{"type": "Ready", "status": "True"}]}}
        )
    wl, wh = low.workload, high.workload
    assert wl is not None and wh is not None and low.container is not None
    assert wl.do(f"alloc {30 * GiB}") == "fast"
    free = node.on_loop(lambda: node.arbiter.grantable(low.alloc))
    assert wl.do(f"alloc {free}") == "granted"
    assert wh.do(f"alloc {30 * GiB}") == "fast"
    assert wh.do(f"alloc {4 * GiB}") == "granted"
    assert low.container.proc.wait(30) == -9
    node.on_loop(lambda: node.identity.events.flush(30))  # type: ignore[union-attr]

    (event,) = [e for e in kube_server.events() if e["reason"] == REASON_EVICTED]
    conds = _conditions(kube_server, "low")
    assert conds["Ready"]["status"] == "True"  # kept
    target = conds[DISRUPTION_TARGET]
    assert target["status"] == "True"
    assert target["reason"] == CONDITION_GPU_MEMORY_RECLAIMED
    assert target["message"] == event["message"]
    assert target["last_transition_time"] is not None
    # The requester was not disrupted.
    assert DISRUPTION_TARGET not in _conditions(kube_server, "high")
    assert node.identity.events.conditions == 1  # type: ignore[union-attr]


def test_a_new_pod_of_the_same_name_is_not_marked(kube_server: KubeServer) -> None:
    import asyncio

    from gpufrac.agent.kube.objref import ObjectRef
    from gpufrac.agent.kube.recorder import EventRecorder
    from tests.fixtures.kube import pod_manifest

    v1 = kube_server.core_v1()
    old = v1.create_namespaced_pod("default", pod_manifest("job-0", node="n"))
    v1.delete_namespaced_pod("job-0", "default")
    v1.create_namespaced_pod("default", pod_manifest("job-0", node="n"))

    async def mark() -> EventRecorder:
        rec = EventRecorder(kube_server.api_client(), "n")
        rec.disruption(ObjectRef.pod_named("default", "job-0", old.metadata.uid), "GpuMemoryReclaimed", "x")
        await rec.close(30)
        return rec

    rec = asyncio.run(mark())
    assert (rec.conditions, rec.errors) == (0, 1)  # 409: the uid precondition failed
    assert DISRUPTION_TARGET not in _conditions(kube_server, "job-0")
