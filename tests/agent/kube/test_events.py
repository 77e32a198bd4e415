"""EventRecorder: core/v1 Events through the real kubernetes client into kmock's apiserver emulator."""

from __future__ import annotations

import asyncio
import datetime
import json

from gpufrac.agent.kube.client import make_api_client
from gpufrac.agent.kube.objref import ObjectRef
from gpufrac.agent.kube.podcache import PodInfo
from gpufrac.agent.kube.recorder import EventRecorder
from tests.fixtures.kube import KubeServer, pod_manifest

NODE = "node-a"


class Clock:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


def instant(rfc3339: str) -> float:
    return datetime.datetime.fromisoformat(rfc3339).timestamp()


def make_pod(kube: KubeServer, name: str = "web", namespace: str = "default") -> PodInfo:
    raw = kube.core_v1().create_namespaced_pod(
        namespace, pod_manifest(name, node=NODE, namespace=namespace), _preload_content=False
    )
    return PodInfo.from_dict(json.loads(raw.data))


def test_event_names_the_pod_reason_and_source(kube_server: KubeServer) -> None:
    pod = make_pod(kube_server, namespace="team")

    async def scenario() -> EventRecorder:
        rec = EventRecorder(make_api_client(host=kube_server.url), NODE, clock=Clock())
        rec.warning(ObjectRef.pod(pod, "main"), "InvalidAnnotation", 'gpufrac.dev/x="y" ignored')
        assert await rec.flush(30)
        await rec.close()
        return rec

    rec = asyncio.run(scenario())
    assert (rec.created, rec.errors) == (1, 0)
    (ev,) = kube_server.events("team")
    assert ev["metadata"]["name"].startswith("web.")
    assert ev["involvedObject"] == {
        "apiVersion": "v1",
        "kind": "Pod",
        "name": "web",
        "namespace": "team",
        "uid": pod.uid,
        "fieldPath": "spec.containers{main}",
    }
    assert (ev["type"], ev["reason"], ev["message"]) == (
        "Warning",
        "InvalidAnnotation",
        'gpufrac.dev/x="y" ignored',
    )
    assert ev["count"] == 1
    assert instant(ev["firstTimestamp"]) == instant(ev["lastTimestamp"]) == Clock().now
    assert ev["source"] == {"component": "gpufrac-agent", "host": NODE}
    assert (ev["reportingComponent"], ev["reportingInstance"]) == ("gpufrac-agent", NODE)


def test_repeats_are_aggregated_into_one_event(kube_server: KubeServer) -> None:
    pod = make_pod(kube_server)
    clock = Clock()

    async def scenario() -> EventRecorder:
        rec = EventRecorder(make_api_client(host=kube_server.url), NODE, clock=clock)
        ref = ObjectRef.pod(pod)
        for _ in range(3):
            rec.normal(ref, "GpuLimitApplied", "limit 24Gi")
            assert await rec.flush(30)
            clock.now += 60
        rec.normal(ref, "GpuLimitApplied", "limit 16Gi")  # another message: another Event
        rec.warning(ref, "InvalidAnnotation", "limit 24Gi")  # another reason: another Event
        assert await rec.flush(30)
        await rec.close()
        return rec

    rec = asyncio.run(scenario())
    assert (rec.created, rec.aggregated, rec.errors) == (3, 2, 0)
    events = kube_server.events("default")
    by_msg = {(e["reason"], e["message"]): e for e in events}
    assert len(events) == 3
    first = by_msg[("GpuLimitApplied", "limit 24Gi")]
    assert first["count"] == 3
    assert instant(first["firstTimestamp"]) == Clock().now
    assert instant(first["lastTimestamp"]) == Clock().now + 120
    assert by_msg[("GpuLimitApplied", "limit 16Gi")]["count"] == 1
    assert by_msg[("InvalidAnnotation", "limit 24Gi")]["count"] == 1


def test_expired_event_is_created_anew(kube_server: KubeServer) -> None:
    pod = make_pod(kube_server)

    async def scenario() -> EventRecorder:
        rec = EventRecorder(make_api_client(host=kube_server.url), NODE, clock=Clock())
        ref = ObjectRef.pod(pod)
        rec.warning(ref, "InvalidAnnotation", "bad")
        assert await rec.flush(30)
        (ev,) = await asyncio.to_thread(kube_server.events)
        # The apiserver's event TTL passes: the Event is gone.
        await asyncio.to_thread(
            kube_server.core_v1().delete_namespaced_event, ev["metadata"]["name"], "default"
        )
        rec.warning(ref, "InvalidAnnotation", "bad")
        assert await rec.flush(30)
        await rec.close()
        return rec

    rec = asyncio.run(scenario())
    assert (rec.created, rec.errors) == (2, 0)
    (ev,) = kube_server.events()
    assert ev["count"] == 1 and ev["message"] == "bad"


def test_apiserver_failures_never_reach_the_caller() -> None:
    pod = PodInfo(namespace="default", name="p", uid="u1", node_name=NODE)

    async def scenario() -> EventRecorder:
        rec = EventRecorder(make_api_client(host="http://127.0.0.1:9"), NODE, request_timeout=5)
        for i in range(3):
            rec.warning(ObjectRef.pod(pod), "InvalidAnnotation", f"message {i}")
        assert await rec.flush(60)
        await rec.close()
        return rec

    rec = asyncio.run(scenario())
    assert (rec.created, rec.errors) == (0, 3)


def test_a_flood_is_bounded_not_queued_forever(kube_server: KubeServer) -> None:
    pod = make_pod(kube_server)

    async def scenario() -> EventRecorder:
        rec = EventRecorder(make_api_client(host=kube_server.url), NODE, max_pending=2)
        for i in range(5):  # no await in between: the worker has not sent anything yet
            rec.normal(ObjectRef.pod(pod), "Test", f"m{i}")
        assert await rec.flush(30)
        await rec.close()
        return rec

    rec = asyncio.run(scenario())
    assert (rec.dropped, rec.created) == (3, 2)
    assert sorted(e["message"] for e in kube_server.events()) == ["m0", "m1"]


def test_long_messages_are_cut_to_the_apiserver_limit(kube_server: KubeServer) -> None:
    pod = make_pod(kube_server)

    async def scenario() -> None:
        rec = EventRecorder(make_api_client(host=kube_server.url), NODE)
        rec.warning(ObjectRef.pod(pod), "InvalidAnnotation", "x" * 5000)
        assert await rec.flush(30)
        await rec.close()

    asyncio.run(scenario())
    (ev,) = kube_server.events()
    assert len(ev["message"]) == 1024 and ev["message"].endswith("...")
