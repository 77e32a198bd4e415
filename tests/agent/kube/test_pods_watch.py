"""PodCache against the apiserver emulator through the real kubernetes client."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import yaml
from kubernetes import client, watch

from gpufrac.agent.kube.client import KubeConfigError, make_api_client
from gpufrac.agent.kube.podcache import PodCache, PodInfo
from tests.fixtures.kube import PODS, KubeServer, pod_manifest
from tests.fixtures.polling import until_async

NODE = "node-a"


def names(cache: PodCache) -> set[str]:
    return {p.name for p in cache.pods()}


def test_watch_delivers_this_nodes_pods_only(kube_server: KubeServer) -> None:
    v1 = kube_server.core_v1()
    v1.create_namespaced_pod("default", pod_manifest("a1", node=NODE, priority=100))
    v1.create_namespaced_pod("default", pod_manifest("b1", node="node-b"))
    seen: list[tuple[str, str]] = []

    async def scenario() -> None:
        cache = PodCache(make_api_client(host=kube_server.url), NODE)
        cache.subscribe(lambda kind, pod: seen.append((kind, pod.name)))
        cache.start()
        try:
            assert await cache.wait_synced(30)
            assert names(cache) == {"a1"}
            a1 = cache.get("default", "a1")
            assert a1 is not None and a1.priority == 100 and a1.node_name == NODE
            assert cache.by_uid(a1.uid) == a1

            # Pods that arrive while watching: only this node's show up.
            await asyncio.to_thread(
                v1.create_namespaced_pod, "team", pod_manifest("b2", node="node-b", namespace="team")
            )
            await asyncio.to_thread(
                v1.create_namespaced_pod,
                "team",
                pod_manifest("a2", node=NODE, namespace="team", containers=("x", "y")),
            )
            await until_async(lambda: "a2" in names(cache), what="a2 in the cache")
            assert names(cache) == {"a1", "a2"}
            a2 = cache.get("team", "a2")
            assert a2 is not None and a2.containers == ("x", "y")

            # An annotation change arrives as MODIFIED with the new annotations.
            patch = {"metadata": {"annotations": {"gpufrac.dev/gpu-memory-limit": "24Gi"}}}
            await asyncio.to_thread(v1.patch_namespaced_pod, "a1", "default", patch)
            await until_async(
                lambda: "gpufrac.dev/gpu-memory-limit" in (cache.get("default", "a1") or a1).annotations,
                what="the new annotation",
            )
            assert ("MODIFIED", "a1") in seen

            await asyncio.to_thread(v1.delete_namespaced_pod, "a1", "default")
            await until_async(lambda: cache.get("default", "a1") is None, what="a1 deleted")
            assert cache.by_uid(a1.uid) is None
            assert ("DELETED", "a1") in seen
            assert not any(name.startswith("b") for _, name in seen)
        finally:
            await cache.stop()

    asyncio.run(asyncio.wait_for(scenario(), 120))
    # The apiserver does the filtering: every list and watch asked for this node only.
    pod_reads = [q for m, path, q in kube_server.requests() if m == "GET" and path == "/api/v1/pods"]
    assert pod_reads and all(q.get("fieldSelector") == f"spec.nodeName={NODE}" for q in pod_reads)


def test_expired_watch_relists_and_sees_missed_deletions(kube_server: KubeServer) -> None:
    v1 = kube_server.core_v1()
    for name in ("p1", "p2"):
        v1.create_namespaced_pod("default", pod_manifest(name, node=NODE))
    seen: list[tuple[str, str]] = []

    async def scenario() -> None:
        cache = PodCache(make_api_client(host=kube_server.url), NODE)
        cache.subscribe(lambda kind, pod: seen.append((kind, pod.name)))
        cache.start()
        try:
            assert await cache.wait_synced(30)
            await until_async(lambda: cache.watches >= 1, what="the watch to start")
            assert names(cache) == {"p1", "p2"}
            # p2 goes while the watch is "down" (no event), then the apiserver compacts.
            await asyncio.to_thread(kube_server.delete_silently, PODS, "default", "p2")
            await asyncio.to_thread(kube_server.expire_watches)
            await until_async(lambda: names(cache) == {"p1"}, what="the relist to drop p2")
            assert ("DELETED", "p2") in seen
            # And it keeps watching after the relist.
            await asyncio.to_thread(v1.create_namespaced_pod, "default", pod_manifest("p3", node=NODE))
            await until_async(lambda: "p3" in names(cache), what="p3 after the relist")
            assert cache.relists == 2  # one relist for one expiry, not a relist loop
        finally:
            await cache.stop()

    asyncio.run(asyncio.wait_for(scenario(), 120))


def test_watch_resumes_after_the_server_ends_it(kube_server: KubeServer) -> None:
    async def scenario() -> None:
        cache = PodCache(make_api_client(host=kube_server.url), NODE, watch_timeout=1)
        cache.start()
        try:
            assert await cache.wait_synced(30)
            await until_async(lambda: cache.watches >= 3, what="the watch to be renewed")
            v1 = kube_server.core_v1()
            await asyncio.to_thread(v1.create_namespaced_pod, "default", pod_manifest("late", node=NODE))
            await until_async(lambda: "late" in names(cache), what="a pod after renewals")
            assert cache.errors == 0
        finally:
            await cache.stop()

    asyncio.run(asyncio.wait_for(scenario(), 120))


def test_fetch_reads_a_pod_directly(kube_server: KubeServer) -> None:
    v1 = kube_server.core_v1()
    v1.create_namespaced_pod(
        "ns1", pod_manifest("direct", node=NODE, namespace="ns1", annotations={"a": "b"})
    )

    async def scenario() -> None:
        cache = PodCache(make_api_client(host=kube_server.url), NODE)
        cache.start()  # the loop is needed; the watch may or may not have delivered yet
        try:
            pod = await cache.fetch("ns1", "direct")
            assert isinstance(pod, PodInfo) and pod.annotations == {"a": "b"} and pod.uid
            assert cache.get("ns1", "direct") == pod
            assert await cache.fetch("ns1", "missing") is None
        finally:
            await cache.stop()

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_unreachable_apiserver_is_counted_not_fatal() -> None:
    async def scenario() -> None:
        # Port 9 on loopback: nothing listens, connections are refused at once.
        cache = PodCache(make_api_client(host="http://127.0.0.1:9"), NODE, backoff=(0.05, 0.2))
        cache.start()
        try:
            await until_async(lambda: cache.errors >= 3, what="retries with back-off")
            assert not cache.synced
            assert await cache.fetch("default", "x") is None
        finally:
            await cache.stop()

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_client_from_a_kubeconfig_reaches_the_apiserver(kube_server: KubeServer, tmp_path: Path) -> None:
    kubeconfig = tmp_path / "config"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "sim", "cluster": {"server": kube_server.url}}],
                "users": [{"name": "agent", "user": {"token": "t0ken"}}],
                "contexts": [{"name": "sim", "context": {"cluster": "sim", "user": "agent"}}],
                "current-context": "sim",
            }
        )
    )
    kube_server.core_v1().create_namespaced_pod("default", pod_manifest("k", node=NODE))
    api = make_api_client(kubeconfig=str(kubeconfig))
    pods = client.CoreV1Api(api).list_pod_for_all_namespaces(field_selector=f"spec.nodeName={NODE}")
    assert [p.metadata.name for p in pods.items] == ["k"]


def test_no_apiserver_configured_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(KubeConfigError, match="not in a cluster and no usable kubeconfig"):
        make_api_client(kubeconfig=str(tmp_path / "missing"))


def test_a_watch_resumed_from_a_version_replays_what_changed_since(kube_server: KubeServer) -> None:
    # What the agent relies on when its watch reconnects: nothing written between its list
    # (or its last event) and the new watch is lost, deletions included.
    v1 = kube_server.core_v1()
    v1.create_namespaced_pod("default", pod_manifest("old", node=NODE))
    v1.create_namespaced_pod("default", pod_manifest("goes", node=NODE))
    rv = v1.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={NODE}").metadata.resource_version
    v1.create_namespaced_pod("default", pod_manifest("new", node=NODE))
    v1.create_namespaced_pod("default", pod_manifest("elsewhere", node="node-b"))
    v1.delete_namespaced_pod("goes", "default")

    w = watch.Watch(return_type="object")
    got = [
        (e["type"], e["raw_object"]["metadata"]["name"], int(e["raw_object"]["metadata"]["resourceVersion"]))
        for e in w.stream(
            v1.list_pod_for_all_namespaces,
            field_selector=f"spec.nodeName={NODE}",
            resource_version=rv,
            timeout_seconds=1,
        )
    ]
    assert [(t, n) for t, n, _ in got] == [("ADDED", "new"), ("DELETED", "goes")]
    # The deletion carries the version it happened at, so resuming after it does not replay it.
    assert got[1][2] > got[0][2] > int(rv)


def test_a_pod_deleted_while_fetched_does_not_come_back(kube_server: KubeServer) -> None:
    """fetch() GETs a pod; the watch delivers its deletion before the answer is read. The
    stale answer must not put the pod back in the cache (nothing would take it out again
    until a relist)."""
    v1 = kube_server.core_v1()
    v1.create_namespaced_pod("ns1", pod_manifest("brief", node=NODE, namespace="ns1"))

    async def scenario() -> None:
        cache = PodCache(make_api_client(host=kube_server.url), NODE)
        cache.start()
        try:
            assert await cache.wait_synced(30)
            await until_async(lambda: cache.get("ns1", "brief") is not None, what="brief in the cache")
            real = cache._v1.read_namespaced_pod
            loop = asyncio.get_running_loop()

            def get_then_lose_the_race(*args: object, **kw: object) -> object:
                answer = real(*args, **kw)  # read before the deletion ...
                v1.delete_namespaced_pod("brief", "ns1")
                asyncio.run_coroutine_threadsafe(
                    until_async(lambda: cache.get("ns1", "brief") is None, what="the DELETED event"), loop
                ).result(30)
                return answer  # ... and handed over after the watch saw it go

            cache._v1.read_namespaced_pod = get_then_lose_the_race  # type: ignore[method-assign]
            pod = await cache.fetch("ns1", "brief")
            assert pod is not None and pod.name == "brief"  # the caller still gets what was read
            assert cache.get("ns1", "brief") is None
        finally:
            await cache.stop()

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_a_fetched_successor_is_not_undone_by_its_predecessors_late_events(kube_server: KubeServer) -> None:
    """A pod is deleted and one of the same name created while the watch lags; fetch() reads
    the successor. The predecessor's events, delivered after, are older than what the cache
    holds: the successor stays, and no listener hears it deleted or the old pod back."""
    v1 = kube_server.core_v1()
    old = v1.create_namespaced_pod("ns1", pod_manifest("web-0", node=NODE, namespace="ns1")).metadata.uid
    seen: list[tuple[str, str]] = []

    async def scenario() -> None:
        cache = PodCache(make_api_client(host=kube_server.url), NODE)
        cache.start()
        try:
            assert await cache.wait_synced(30)
            await until_async(lambda: cache.get("ns1", "web-0") is not None, what="web-0 in the cache")
            with kube_server.hold_watches():
                patch = {"metadata": {"annotations": {"late": "yes"}}}
                await asyncio.to_thread(v1.patch_namespaced_pod, "web-0", "ns1", patch)
                await asyncio.to_thread(v1.delete_namespaced_pod, "web-0", "ns1")
                manifest = pod_manifest("web-0", node=NODE, namespace="ns1")
                new = (await asyncio.to_thread(v1.create_namespaced_pod, "ns1", manifest)).metadata.uid
                fetched = await cache.fetch("ns1", "web-0")
                assert fetched is not None and fetched.uid == new
                assert cache.get("ns1", "web-0") == fetched and cache.by_uid(old) is None
                cache.subscribe(lambda kind, pod: seen.append((kind, pod.uid)))
            # Every held event is delivered before this pod's.
            await asyncio.to_thread(
                v1.create_namespaced_pod, "ns1", pod_manifest("marker", node=NODE, namespace="ns1")
            )
            await until_async(lambda: cache.get("ns1", "marker") is not None, what="the watch caught up")
            now = cache.get("ns1", "web-0")
            assert now is not None and now.uid == new
            assert [s for s in seen if s[1] in (old, new)] == [], seen
        finally:
            await cache.stop()

    asyncio.run(asyncio.wait_for(scenario(), 60))
