"""Client of the kubelet's pod-resources API (v1.PodResourcesLister).

The kubelet's answer is the truth about which device IDs belong to which
pod/container: the agent uses it to release allocations of containers that are
gone (there is no deallocate call) and to find the pod behind an allocation.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from gpufrac.proto import podresources_pb2 as pr
from gpufrac.proto import podresources_pb2_grpc as pr_grpc


@dataclass(frozen=True)
class ContainerDevices:
    """One container's devices of one resource, as the kubelet lists them."""

    namespace: str
    pod: str
    container: str
    resource: str
    device_ids: tuple[str, ...]


class PodResourcesClient:
    def __init__(self, socket_path: str, timeout: float = 5.0) -> None:
        self.socket_path = socket_path
        self.timeout = timeout
        self._channel: grpc.aio.Channel | None = None
        self._stub: pr_grpc.PodResourcesListerStub | None = None

    def _lister(self) -> pr_grpc.PodResourcesListerStub:
        # One channel, reused (Allocate may ask on its critical path); its reconnect
        # backoff is kept short because the kubelet restarts and re-creates the socket.
        if self._stub is None:
            self._channel = grpc.aio.insecure_channel(
                f"unix://{self.socket_path}",
                options=[("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 1000)],
            )
            self._stub = pr_grpc.PodResourcesListerStub(self._channel)
        return self._stub

    async def _call(self, method: str, request: object) -> object:
        try:
            return await getattr(self._lister(), method)(request, timeout=self.timeout)
        except grpc.aio.AioRpcError:
            await self.close()  # start over with a fresh connection next time
            raise

    async def close(self) -> None:
        channel, self._channel, self._stub = self._channel, None, None
        if channel is not None:
            await channel.close()

    async def list(self, resources: tuple[str, ...] | None = None) -> list[ContainerDevices]:
        """All containers' devices (optionally only of `resources`). Raises grpc.aio.AioRpcError."""
        resp = await self._call("List", pr.ListPodResourcesRequest())
        assert isinstance(resp, pr.ListPodResourcesResponse)
        out = []
        for pod in resp.pod_resources:
            for c in pod.containers:
                for d in c.devices:
                    if resources is None or d.resource_name in resources:
                        out.append(
                            ContainerDevices(
                                pod.namespace, pod.name, c.name, d.resource_name, tuple(d.device_ids)
                            )
                        )
        return out

    async def allocatable(self) -> dict[str, list[str]]:
        """Healthy device IDs per resource, as the kubelet counts them allocatable."""
        resp = await self._call("GetAllocatableResources", pr.AllocatableResourcesRequest())
        assert isinstance(resp, pr.AllocatableResourcesResponse)
        out: dict[str, list[str]] = {}
        for d in resp.devices:
            out.setdefault(d.resource_name, []).extend(d.device_ids)
        return out
