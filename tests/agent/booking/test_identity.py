"""Pod identity end to end on the agent's parts: the real ledger writing real memguard config
files, the real kubernetes client watching kmock's apiserver emulator, real Events.

The pod-resources answer is given as the agent holds it (container key -> ContainerDevices);
tests/agent/booking/test_identity_kubelet.py drives the same through the kubelet emulator."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gpufrac.agent.booking.ledger import ContainerAlloc, Ledger
from gpufrac.agent.booking.pods import REASON_APPLIED, REASON_INVALID, PodIdentity
from gpufrac.agent.gpu.inventory import read_inventory
from gpufrac.agent.kube.client import make_api_client
from gpufrac.agent.kube.podcache import PodCache
from gpufrac.agent.kube.recorder import EventRecorder
from gpufrac.agent.metrics.registry import Metrics
from gpufrac.core.config import Config, load
from gpufrac.core.slices import MEMORY, ContainerDevices, device_id
from gpufrac.memguard.abi import (
    CLASS_INTERACTIVE,
    FLAG_POD_KNOWN,
    FLAG_PREEMPTIBLE,
    FLAG_SWAPPABLE,
    read_config,
)
from tests.fixtures.kube import KubeServer, pod_manifest
from tests.fixtures.polling import until_async

NODE = "node-a"
GiB = 1 << 30


@pytest.fixture
def node_config(tmp_path: Path) -> Config:
    return load(overrides={"nodeName": NODE, "paths": {"stateDir": str(tmp_path / "state")}})


@pytest.fixture
def ledger(in_process_nvml: Any, node_config: Config) -> Iterator[Ledger]:
    led = Ledger(node_config, read_inventory())
    yield led
    for alloc in led.containers():
        led.release(alloc.key)


class Scenario:
    def __init__(self, kube: KubeServer, ledger: Ledger, cfg: Config) -> None:
        self.kube, self.ledger, self.cfg = kube, ledger, cfg
        self.v1 = kube.core_v1()
        self.listing: dict[str, ContainerDevices] = {}
        self._next_slice = 0

    def allocate(self, gib: int, namespace: str, pod: str, container: str = "main") -> ContainerAlloc:
        """What Allocate books, plus what pod-resources then lists for it."""
        gpu = self.ledger.inventory.gpus[0].uuid
        ids = [device_id(gpu, MEMORY, self._next_slice + i) for i in range(gib)]
        self._next_slice += gib
        alloc = self.ledger.allocate(MEMORY, ids)
        self.listing[alloc.key] = ContainerDevices(namespace, pod, container, MEMORY, tuple(ids))
        return alloc

    async def run(self, body: Callable[[PodIdentity], Awaitable[None]]) -> None:
        api = make_api_client(host=self.kube.url)
        cache = PodCache(api, NODE)
        cache.start()
        ident = PodIdentity(self.cfg, self.ledger, cache, EventRecorder(api, NODE), metrics=Metrics())
        try:
            assert await cache.wait_synced(30)
            await body(ident)
        finally:
            await ident.close()


def events_on(kube: KubeServer, pod: str, reason: str) -> list[dict[str, Any]]:
    return [e for e in kube.events() if e["involvedObject"]["name"] == pod and e["reason"] == reason]


def test_limit_annotation_reaches_the_config_file(
    kube_server: KubeServer, ledger: Ledger, node_config: Config
) -> None:
    s = Scenario(kube_server, ledger, node_config)
    s.v1.create_namespaced_pod(
        "default",
        pod_manifest(
            "server",
            node=NODE,
            containers=("main",),
            priority=1000,
            annotations={
                "gpufrac.dev/gpu-memory-limit": "24Gi",
                "gpufrac.dev/workload-class": "interactive",
                "gpufrac.dev/swappable": "true",
                "gpufrac.dev/wait-timeout": "5s",
            },
        ),
    )
    alloc = s.allocate(8, "default", "server")
    before = read_config(alloc.directory)
    assert before.limit_bytes == 8 * GiB and not before.flags & FLAG_POD_KNOWN

    async def body(ident: PodIdentity) -> None:
        assert await ident.resolve(s.listing) == 1
        cfg = read_config(alloc.directory)
        uid = ident.pods.get("default", "server").uid  # type: ignore[union-attr]
        assert (cfg.request_bytes, cfg.limit_bytes) == (8 * GiB, 24 * GiB)
        assert cfg.flags == FLAG_POD_KNOWN | FLAG_PREEMPTIBLE | FLAG_SWAPPABLE
        assert (cfg.workload_class, cfg.priority, cfg.wait_timeout_ms) == (CLASS_INTERACTIVE, 1000, 5000)
        assert (cfg.namespace, cfg.pod, cfg.container, cfg.pod_uid) == ("default", "server", "main", uid)
        policy = ident.policy(alloc.key)
        assert (
            policy is not None and policy.workload_class == "interactive" and policy.limit_bytes == 24 * GiB
        )
        assert await ident.events.flush(30)  # type: ignore[union-attr]

        applied = events_on(kube_server, "server", REASON_APPLIED)
        assert len(applied) == 1
        ev = applied[0]
        assert ev["type"] == "Normal"
        assert ev["involvedObject"]["uid"] == uid and ev["involvedObject"]["kind"] == "Pod"
        assert "24Gi" in ev["message"] and "gpufrac.dev/gpu-memory-limit" in ev["message"]
        assert ev["source"] == {"component": "gpufrac-agent", "host": NODE}
        assert not events_on(kube_server, "server", REASON_INVALID)

        # Nothing changed: a second pass rewrites nothing and posts nothing.
        generation = ledger.get(alloc.key).config  # type: ignore[union-attr]
        assert await ident.resolve(s.listing) == 0
        assert ledger.get(alloc.key).config is generation  # type: ignore[union-attr]

        # The user edits the annotation: the watch delivers it and the new limit applies.
        patch = {"metadata": {"annotations": {"gpufrac.dev/gpu-memory-limit": "16Gi"}}}
        await asyncio.to_thread(s.v1.patch_namespaced_pod, "server", "default", patch)
        await until_async(lambda: read_config(alloc.directory).limit_bytes == 16 * GiB, what="the 16Gi limit")

        # The annotation goes away: back to no burst, and the user is told.
        patch = {"metadata": {"annotations": {"gpufrac.dev/gpu-memory-limit": None}}}
        await asyncio.to_thread(s.v1.patch_namespaced_pod, "server", "default", patch)
        await until_async(lambda: read_config(alloc.directory).limit_bytes == 8 * GiB, what="limit = request")
        assert await ident.events.flush(30)  # type: ignore[union-attr]
        messages = [e["message"] for e in events_on(kube_server, "server", REASON_APPLIED)]
        assert len(messages) == 3
        assert any("16Gi" in m for m in messages)
        assert any("8Gi (request 8Gi) = the request, no burst" in m for m in messages)

    asyncio.run(asyncio.wait_for(s.run(body), 120))


def test_bad_annotation_keeps_limit_at_request_and_posts_a_warning(
    kube_server: KubeServer, ledger: Ledger, node_config: Config
) -> None:
    s = Scenario(kube_server, ledger, node_config)
    s.v1.create_namespaced_pod(
        "ml",
        pod_manifest(
            "trainer",
            node=NODE,
            namespace="ml",
            containers=("worker",),
            annotations={"gpufrac.dev/gpu-memory-limit": "lots", "gpufrac.dev/preemptible": "maybe"},
        ),
    )
    alloc = s.allocate(4, "ml", "trainer", "worker")

    async def body(ident: PodIdentity) -> None:
        await ident.resolve(s.listing)
        cfg = read_config(alloc.directory)
        assert cfg.limit_bytes == 4 * GiB  # never loosened
        assert cfg.flags == FLAG_POD_KNOWN | FLAG_PREEMPTIBLE  # the safe defaults
        assert ident.annotation_problems == 2
        assert await ident.events.flush(30)  # type: ignore[union-attr]

    asyncio.run(asyncio.wait_for(s.run(body), 120))
    warnings = events_on(kube_server, "trainer", REASON_INVALID)
    by_key = {k: e for e in warnings for k in ("gpu-memory-limit", "preemptible") if k in e["message"]}
    assert set(by_key) == {"gpu-memory-limit", "preemptible"}
    mem = by_key["gpu-memory-limit"]
    assert mem["type"] == "Warning" and mem["metadata"]["namespace"] == "ml"
    assert mem["involvedObject"]["namespace"] == "ml" and mem["involvedObject"]["name"] == "trainer"
    assert mem["involvedObject"]["fieldPath"] == "spec.containers{worker}"
    assert 'gpufrac.dev/gpu-memory-limit="lots"' in mem["message"]
    assert "not a quantity" in mem["message"] and "limit = request (4Gi)" in mem["message"]
    assert 'gpufrac.dev/preemptible="maybe"' in by_key["preemptible"]["message"]
    assert not events_on(kube_server, "trainer", REASON_APPLIED)


def test_unknown_pod_stays_safe_until_it_appears(
    kube_server: KubeServer, ledger: Ledger, node_config: Config
) -> None:
    s = Scenario(kube_server, ledger, node_config)
    alloc = s.allocate(2, "default", "late")

    async def body(ident: PodIdentity) -> None:
        assert await ident.resolve(s.listing) == 0
        cfg = read_config(alloc.directory)
        assert cfg.limit_bytes == 2 * GiB and not cfg.flags & FLAG_POD_KNOWN
        assert (cfg.namespace, cfg.pod, cfg.container) == (
            "default",
            "late",
            "main",
        )  # names from pod-resources
        safe = ident.policy(alloc.key)
        assert safe is not None and not safe.pod_known and safe.limit_bytes == 2 * GiB

        # The pod shows up in the apiserver: the watch event triggers resolution by itself.
        manifest = pod_manifest("late", node=NODE, annotations={"gpufrac.dev/gpu-fraction-limit": "10"})
        await asyncio.to_thread(s.v1.create_namespaced_pod, "default", manifest)
        allocatable = ledger.geometry[alloc.gpus[0]].allocatable
        await until_async(
            lambda: read_config(alloc.directory).limit_bytes == allocatable // 10, what="the fraction limit"
        )
        assert read_config(alloc.directory).flags & FLAG_POD_KNOWN

    asyncio.run(asyncio.wait_for(s.run(body), 120))


def test_released_container_forgets_its_policy(
    kube_server: KubeServer, ledger: Ledger, node_config: Config
) -> None:
    s = Scenario(kube_server, ledger, node_config)
    s.v1.create_namespaced_pod("default", pod_manifest("gone", node=NODE))
    alloc = s.allocate(1, "default", "gone")

    async def body(ident: PodIdentity) -> None:
        await ident.resolve(s.listing)
        assert ident.policy(alloc.key) is not None and ident.policy(alloc.key).pod_known  # type: ignore[union-attr]
        ledger.release(alloc.key)
        await ident.resolve({})
        assert ident.policy(alloc.key) is None

    asyncio.run(asyncio.wait_for(s.run(body), 120))


def _web0(limit: str, priority: int) -> dict[str, Any]:
    return pod_manifest(
        "web-0", node=NODE, annotations={"gpufrac.dev/gpu-memory-limit": limit}, priority=priority
    )


def test_a_booking_keeps_its_pod_when_a_new_pod_takes_its_name(
    kube_server: KubeServer, ledger: Ledger, node_config: Config
) -> None:
    """A StatefulSet pod force-deleted while its container runs, and created again. Pod-resources
    still lists the old container under the name (it carries no uid) and the apiserver's pod
    of that name is the successor: the old container keeps its own pod's limit and priority."""
    s = Scenario(kube_server, ledger, node_config)
    old = s.v1.create_namespaced_pod("default", _web0("3Gi", 10)).metadata.uid
    alloc = s.allocate(2, "default", "web-0")

    async def body(ident: PodIdentity) -> None:
        assert await ident.resolve(s.listing) == 1
        cfg = read_config(alloc.directory)
        assert (cfg.pod_uid, cfg.limit_bytes, cfg.priority) == (old, 3 * GiB, 10)

        await asyncio.to_thread(s.v1.delete_namespaced_pod, "web-0", "default")
        new = (await asyncio.to_thread(s.v1.create_namespaced_pod, "default", _web0("4Gi", 200))).metadata.uid
        cache = ident.pods
        assert cache is not None
        successor = lambda: getattr(cache.get("default", "web-0"), "uid", None) == new  # noqa: E731
        await until_async(successor, what="the successor in the cache")

        assert await ident.resolve(s.listing) == 0
        cfg = read_config(alloc.directory)
        assert (cfg.pod_uid, cfg.limit_bytes, cfg.priority) == (old, 3 * GiB, 10)
        policy = ident.policy(alloc.key)
        assert policy is not None and policy.limit_bytes == 3 * GiB and policy.priority == 10

    asyncio.run(asyncio.wait_for(s.run(body), 120))


def test_a_new_booking_is_its_new_pods_while_the_watch_still_shows_the_old_one(
    kube_server: KubeServer, ledger: Ledger, node_config: Config
) -> None:
    """The kubelet admits the successor of a pod of the same name before the agent's watch has
    delivered the change: the booking gets the successor's policy, never the old pod's, and
    keeps it once the watch catches up."""
    s = Scenario(kube_server, ledger, node_config)
    old = s.v1.create_namespaced_pod("default", _web0("3Gi", 10)).metadata.uid

    async def body(ident: PodIdentity) -> None:
        cache = ident.pods
        assert cache is not None
        await until_async(lambda: cache.get("default", "web-0") is not None, what="web-0 in the cache")
        with kube_server.hold_watches():
            await asyncio.to_thread(s.v1.delete_namespaced_pod, "web-0", "default")
            created = await asyncio.to_thread(s.v1.create_namespaced_pod, "default", _web0("4Gi", 200))
            new = created.metadata.uid
            alloc = s.allocate(2, "default", "web-0")  # the successor's Allocate
            assert cache.get("default", "web-0").uid == old  # type: ignore[union-attr]  # the watch lags
            assert await ident.resolve(s.listing) == 1
            cfg = read_config(alloc.directory)
            assert (cfg.pod_uid, cfg.limit_bytes, cfg.priority) == (new, 4 * GiB, 200)

        # The watch catches up (a pod created after the held events arrives after them).
        await asyncio.to_thread(s.v1.create_namespaced_pod, "default", pod_manifest("marker", node=NODE))
        await until_async(lambda: cache.get("default", "marker") is not None, what="the watch caught up")
        await ident.resolve(s.listing)
        cfg = read_config(alloc.directory)
        assert (cfg.pod_uid, cfg.limit_bytes, cfg.priority) == (new, 4 * GiB, 200)

    asyncio.run(asyncio.wait_for(s.run(body), 120))
