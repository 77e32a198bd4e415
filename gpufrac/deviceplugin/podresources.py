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

    def _channel(self) -> grpc.aio.Channel:
        # A channel per call: the kubelet restarts and its socket is re-created;
        # a fresh unix-socket connection costs little and never waits in a
        # long reconnect backoff.
        return grpc.aio.insecure_channel(f"unix://{self.socket_path}")

    async def list(self, resources: tuple[str, ...] | None = None) -> list[ContainerDevices]:
        """All containers' devices (optionally only of `resources`). Raises grpc.aio.AioRpcError."""
        async with self._channel() as ch:
            resp = await pr_grpc.PodResourcesListerStub(ch).List(
                pr.ListPodResourcesRequest(), timeout=self.timeout
            )
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
        async with self._channel() as ch:
            resp = await pr_grpc.PodResourcesListerStub(ch).GetAllocatableResources(
                pr.AllocatableResourcesRequest(), timeout=self.timeout
            )
        out: dict[str, list[str]] = {}
        for d in resp.devices:
            out.setdefault(d.resource_name, []).extend(d.device_ids)
        return out
