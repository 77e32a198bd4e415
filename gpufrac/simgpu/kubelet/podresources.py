"""The kubelet's v1.PodResourcesLister (List, GetAllocatableResources, Get), answered from
the emulator's own records and rate-limited like the kubelet's (100 QPS, burst 10).

Each device of a container is its own entry, once per NUMA node, as the kubelet lists them."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import grpc

from gpufrac.proto import podresources_pb2 as pr
from gpufrac.proto import podresources_pb2_grpc as pr_grpc
from gpufrac.simgpu.kubelet.model import PodRecord, Resource


def pod_resources(rec: PodRecord) -> pr.PodResources:
    """A pod's entry, built once per set of allocations (cached on the record)."""
    n = sum(len(per) for per in rec.allocations.values())
    if rec.listed is None or rec.listed[0] != n:
        rec.listed = (n, _build_pod_resources(rec))
    return rec.listed[1]


def _build_pod_resources(rec: PodRecord) -> pr.PodResources:
    out = pr.PodResources(name=rec.pod.name, namespace=rec.pod.namespace)
    for c in rec.pod.containers:
        cr = out.containers.add(name=c.name)
        for resource, alloc in rec.allocations.get(c.name, {}).items():
            # As the kubelet lists them: one entry per device and NUMA node, or one
            # without topology for a device that has none.
            for dev in alloc.device_ids:
                for n in alloc.numa_nodes.get(dev) or (None,):
                    cd = cr.devices.add(resource_name=resource, device_ids=[dev])
                    if n is not None:
                        cd.topology.nodes.add(ID=n)
    return out


class PodResourcesServer(pr_grpc.PodResourcesListerServicer):
    """Reads the emulator's live maps (pod uid -> record, resource name -> resource) on its
    loop; it never changes them."""

    def __init__(self, pods: Mapping[str, PodRecord], resources: Mapping[str, Resource]) -> None:
        self._pods = pods
        self._resources = resources
        self.lists = 0  # List calls answered (tests wait for the agent's next reconcile with it)
        self._tokens = 10.0
        self._last = time.monotonic()

    async def _limit(self, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        now = time.monotonic()
        self._tokens = min(10.0, self._tokens + (now - self._last) * 100.0)
        self._last = now
        if self._tokens < 1.0:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "rejected by rate limit")
        self._tokens -= 1.0

    async def List(
        self,
        request: pr.ListPodResourcesRequest,
        context: grpc.aio.ServicerContext[pr.ListPodResourcesRequest, pr.ListPodResourcesResponse],
    ) -> Any:
        await self._limit(context)
        self.lists += 1
        return pr.ListPodResourcesResponse(pod_resources=[pod_resources(r) for r in self._pods.values()])

    async def GetAllocatableResources(
        self,
        request: pr.AllocatableResourcesRequest,
        context: grpc.aio.ServicerContext[pr.AllocatableResourcesRequest, pr.AllocatableResourcesResponse],
    ) -> Any:
        await self._limit(context)
        resp = pr.AllocatableResourcesResponse()
        for name, res in sorted(self._resources.items()):
            for dev in sorted(res.healthy):
                cd = resp.devices.add(resource_name=name, device_ids=[dev])
                for n in res.numa_nodes([dev]):
                    cd.topology.nodes.add(ID=n)
        return resp

    async def Get(
        self,
        request: pr.GetPodResourcesRequest,
        context: grpc.aio.ServicerContext[pr.GetPodResourcesRequest, pr.GetPodResourcesResponse],
    ) -> Any:
        await self._limit(context)
        for r in self._pods.values():
            if r.pod.name == request.pod_name and r.pod.namespace == request.pod_namespace:
                return pr.GetPodResourcesResponse(pod_resources=pod_resources(r))
        await context.abort(
            grpc.StatusCode.UNKNOWN, f"pod {request.pod_name} in namespace {request.pod_namespace} not found"
        )
