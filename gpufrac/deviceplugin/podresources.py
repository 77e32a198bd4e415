"""Client of the kubelet's pod-resources API (v1.PodResourcesLister).

The kubelet's answer is the truth about which device IDs belong to which
pod/container: the agent uses it to release allocations of containers that are
gone (there is no deallocate call) and to find the pod behind an allocation.
"""

from __future__ import annotations

import builtins
from dataclasses import dataclass

import grpc

from gpufrac.core.slices import ContainerDevices
from gpufrac.proto import podresources_pb2 as pr
from gpufrac.proto import podresources_pb2_grpc as pr_grpc


def grouped(resp: pr.ListPodResourcesResponse, resources: tuple[str, ...] | None) -> list[ContainerDevices]:
    """A List answer as one entry per container and resource. The kubelet lists a container's
    devices one ID per entry (and an ID once per NUMA node it sits on), not as the set its
    Allocate got: the set is the union, each ID once, in the order listed."""
    out: list[ContainerDevices] = []
    for pod in resp.pod_resources:
        for c in pod.containers:
            ids: dict[str, dict[str, None]] = {}  # resource -> IDs (a dict keeps order, drops repeats)
            for d in c.devices:
                if resources is None or d.resource_name in resources:
                    ids.setdefault(d.resource_name, {}).update(dict.fromkeys(d.device_ids))
            out.extend(
                ContainerDevices(pod.namespace, pod.name, c.name, resource, tuple(devs))
                for resource, devs in ids.items()
            )
    return out


# Errors after which the next call dials afresh: the kubelet went away or re-created its
# socket. A refusal (its rate limit's RESOURCE_EXHAUSTED, say) keeps the connection.
_REDIAL = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


@dataclass
class _Connection:
    channel: grpc.aio.Channel
    stub: pr_grpc.PodResourcesListerStub
    calls: int = 0  # in flight
    retired: bool = False  # closed when the last call in flight ends


class PodResourcesClient:
    def __init__(self, socket_path: str, timeout: float = 5.0) -> None:
        self.socket_path = socket_path
        self.timeout = timeout
        self._conn: _Connection | None = None

    def _connection(self) -> _Connection:
        # One channel, reused (Allocate may ask on its critical path); its reconnect
        # backoff is kept short because the kubelet restarts and re-creates the socket.
        if self._conn is None:
            channel = grpc.aio.insecure_channel(
                f"unix://{self.socket_path}",
                options=[("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 1000)],
            )
            self._conn = _Connection(channel, pr_grpc.PodResourcesListerStub(channel))
        return self._conn

    async def _call(self, method: str, request: object) -> object:
        # Calls overlap (Allocate, the reconcile loop, identity): one call's failure must not
        # close the channel under the others, which would cancel them (an Allocate handler
        # cancelled that way never answers the kubelet). A broken connection is retired:
        # new calls dial afresh, and it closes once its last call ends.
        conn = self._connection()
        conn.calls += 1
        try:
            return await getattr(conn.stub, method)(request, timeout=self.timeout)
        except grpc.aio.AioRpcError as e:
            if e.code() in _REDIAL and self._conn is conn:
                self._conn = None
                conn.retired = True
            raise
        finally:
            conn.calls -= 1
            if conn.retired and conn.calls == 0:
                await conn.channel.close(None)

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            await conn.channel.close(None)

    async def list(self, resources: tuple[str, ...] | None = None) -> builtins.list[ContainerDevices]:
        """All containers' devices (optionally only of `resources`), one entry per container
        and resource. Raises grpc.aio.AioRpcError."""
        resp = await self._call("List", pr.ListPodResourcesRequest())
        assert isinstance(resp, pr.ListPodResourcesResponse)
        return grouped(resp, resources)

    async def allocatable(self) -> dict[str, builtins.list[str]]:
        """Healthy device IDs per resource, as the kubelet counts them allocatable."""
        resp = await self._call("GetAllocatableResources", pr.AllocatableResourcesRequest())
        assert isinstance(resp, pr.AllocatableResourcesResponse)
        out: dict[str, builtins.list[str]] = {}
        for d in resp.devices:
            out.setdefault(d.resource_name, []).extend(d.device_ids)
        return out
