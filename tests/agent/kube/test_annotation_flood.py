"""Thousands of annotation keys cost a few Events and log lines, and never a neighbour's Event.

A pod's author writes its annotations: some 12,000 keys fit in the 256 KiB the apiserver
allows. Unknown gpufrac.dev/ keys are told as one refusal (gpufrac.core.annotations), and
the Event queue is shared fairly between the objects Events are about
(gpufrac.agent.kube.recorder): one pod cannot push a neighbour's Events out of it, or hold
them up behind its own. Real pods and Events on kmock's apiserver.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

import pytest

from gpufrac.agent.kube.client import make_api_client
from gpufrac.agent.kube.objref import ObjectRef
from gpufrac.agent.kube.podcache import PodInfo
from gpufrac.agent.kube.recorder import EventRecorder
from gpufrac.core import annotations as ann
from tests.fixtures.arbiter_harness import ArbiterNode
from tests.fixtures.kube import KubeServer, pod_manifest
from tests.fixtures.polling import until

pytestmark = pytest.mark.security

NODE = "node-a"


def test_a_pod_with_10000_unknown_keys_gets_one_event_and_its_neighbour_keeps_its_own(
    make_node: Callable[..., ArbiterNode], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    node = make_node()
    a = node.add("a", 2, start=False)
    b = node.add("b", 2, start=False)
    flood = {f"{ann.PREFIX}typo-{i:05d}": "x" for i in range(10_000)}
    node.v1.patch_namespaced_pod("a", "default", {"metadata": {"annotations": flood}})
    # The neighbour's refusal is told right behind the flood (the watch delivers in order).
    node.v1.patch_namespaced_pod("b", "default", {"metadata": {"annotations": {ann.MEMORY_LIMIT: "1e400"}}})

    def seen() -> bool:
        pa, pb = (node.identity.pods.by_uid(x.uid) for x in (a, b))  # type: ignore[union-attr]
        return bool(pa and pb and len(pa.annotations) > 10_000 and ann.MEMORY_LIMIT in pb.annotations)

    node.until(seen, what="both changes in the pod cache")
    node.on_loop(lambda: node.identity.resolve(node.listing))

    def events(pod: str) -> list[Any]:
        return [
            e
            for e in node.v1.list_namespaced_event("default").items
            if e.involved_object.name == pod and e.reason == "InvalidAnnotation"
        ]

    (mine,) = until(lambda: events("b"), what="the neighbour's InvalidAnnotation Event")
    assert ann.MEMORY_LIMIT in mine.message and "1e400" in mine.message
    assert node.on_loop(lambda: node.identity.events.flush(60))  # type: ignore[union-attr]
    (told,) = events("a")  # one Event for the 10,000 keys, naming how many and the first
    assert f"{ann.PREFIX}typo-00000" in told.message and "10000 such keys" in told.message, told.message
    lines = [r.getMessage() for r in caplog.records if "typo-" in r.getMessage()]
    assert len(lines) == 1, lines[:3]
    assert node.identity.events.dropped == 0  # type: ignore[union-attr]


def make_pod(kube: KubeServer, name: str) -> PodInfo:
    raw = kube.core_v1().create_namespaced_pod(
        "default", pod_manifest(name, node=NODE), _preload_content=False
    )
    return PodInfo.from_dict(json.loads(raw.data))


@pytest.mark.parametrize("flooders", [1, 20])
def test_pods_flooding_the_event_queue_neither_drop_nor_delay_a_neighbours_event(
    kube_server: KubeServer, caplog: pytest.LogCaptureFixture, flooders: int
) -> None:
    caplog.set_level(logging.WARNING)
    pods = [make_pod(kube_server, f"flood-{i}") for i in range(flooders)]
    neighbour = make_pod(kube_server, "neighbour")

    async def scenario() -> EventRecorder:
        # A queue of 128 (a node's is 1024): what is sent stays quick to send.
        rec = EventRecorder(make_api_client(host=kube_server.url), NODE, max_pending=128)
        # No await in between: nothing is sent before the neighbour's Event is queued.
        for i in range(2000 // flooders):
            for pod in pods:
                rec.warning(ObjectRef.pod(pod), "InvalidAnnotation", f"m{i}")
        rec.warning(ObjectRef.pod(neighbour), "Evicted", "the neighbour's own")
        assert await rec.flush(120)
        await rec.close()
        return rec

    rec = asyncio.run(scenario())
    events = kube_server.events("default")
    (mine,) = [e for e in events if e["involvedObject"]["name"] == "neighbour"]
    assert mine["reason"] == "Evicted"

    def sent_at(event: dict[str, Any]) -> int:  # Event names end in strictly increasing ns
        return int(event["metadata"]["name"].rsplit(".", 1)[1], 16)

    # Sent in its turn: at most one Event of each flooder went before it.
    for pod in pods:
        before = [e for e in events if e["involvedObject"]["name"] == pod.name and sent_at(e) < sent_at(mine)]
        assert len(before) <= 1, (pod.name, len(before))
    assert rec.dropped > 0 and rec.errors == 0
    drop_lines = [r for r in caplog.records if "dropped" in r.getMessage()]
    assert len(drop_lines) <= 2, len(drop_lines)  # the first drop, and the count at close
