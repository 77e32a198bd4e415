"""A device plugin that does nothing: the floor under the agent's admission latency.

`python -m bench._floor_plugin DEVICE_PLUGIN_DIR` serves the DevicePlugin service the way the
agent does (grpc.aio on the agent's event loop, over a unix socket in the kubelet's directory),
registers FLOOR_RESOURCE with as many healthy devices as the agent's gpu-fraction lists on a
dgx-h100, with IDs of the same shape (the kubelet sends every available ID with each
GetPreferredAllocation, so the size of that request is part of the floor), and answers each call
with the least a kubelet accepts: the first IDs offered, an Allocate response with one variable, an
empty PreStartContainer. bench/agent.py admits pods against it with the same kubelet emulator, so
what the agent adds to gRPC and the emulator reads as the difference within one run.
"""

from __future__ import annotations

import asyncio
import os
import sys
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc

from gpufrac.core import eventloop
from gpufrac.core.slices import FRACTION, FRACTION_SLICES, device_id
from gpufrac.deviceplugin.server import API_VERSION, HEALTHY
from gpufrac.proto import deviceplugin_pb2 as pb
from gpufrac.proto import deviceplugin_pb2_grpc as pb_grpc

FLOOR_RESOURCE = "bench.gpufrac.dev/floor"
GPUS, NUMA_NODES = 8, 2  # a dgx-h100
DEVICES = [
    pb.Device(
        ID=device_id(f"GPU-{uuid.UUID(int=g)}", FRACTION, n),
        health=HEALTHY,
        topology=pb.TopologyInfo(nodes=[pb.NUMANode(ID=g * NUMA_NODES // GPUS)]),
    )
    for g in range(GPUS)
    for n in range(FRACTION_SLICES)
]
SOCKET = "gpufrac-bench-floor.sock"


class FloorPlugin(pb_grpc.DevicePluginServicer):
    async def GetDevicePluginOptions(self, request: pb.Empty, context: Any) -> pb.DevicePluginOptions:
        return pb.DevicePluginOptions(pre_start_required=True, get_preferred_allocation_available=True)

    async def ListAndWatch(self, request: pb.Empty, context: Any) -> AsyncIterator[pb.ListAndWatchResponse]:
        yield pb.ListAndWatchResponse(devices=DEVICES)
        await asyncio.Event().wait()  # the list never changes

    async def GetPreferredAllocation(
        self, request: pb.PreferredAllocationRequest, context: Any
    ) -> pb.PreferredAllocationResponse:
        resp = pb.PreferredAllocationResponse()
        for creq in request.container_requests:
            ids = list(creq.available_deviceIDs)  # read whole, as the agent does
            resp.container_responses.add(deviceIDs=ids[: creq.allocation_size])
        return resp

    async def Allocate(self, request: pb.AllocateRequest, context: Any) -> pb.AllocateResponse:
        resp = pb.AllocateResponse()
        for _ in request.container_requests:
            resp.container_responses.add(envs={"BENCH_FLOOR": "1"})
        return resp

    async def PreStartContainer(
        self, request: pb.PreStartContainerRequest, context: Any
    ) -> pb.PreStartContainerResponse:
        return pb.PreStartContainerResponse()


async def serve(device_plugin_dir: str) -> None:
    path = os.path.join(device_plugin_dir, SOCKET)
    server = grpc.aio.server()
    pb_grpc.add_DevicePluginServicer_to_server(FloorPlugin(), server)
    server.add_insecure_port(f"unix://{path}")
    await server.start()
    req = pb.RegisterRequest(
        version=API_VERSION,
        endpoint=SOCKET,
        resource_name=FLOOR_RESOURCE,
        options=pb.DevicePluginOptions(pre_start_required=True, get_preferred_allocation_available=True),
    )
    async with grpc.aio.insecure_channel(f"unix://{os.path.join(device_plugin_dir, 'kubelet.sock')}") as ch:
        await pb_grpc.RegistrationStub(ch).Register(req, timeout=30)
    await server.wait_for_termination()


if __name__ == "__main__":
    eventloop.run(serve(sys.argv[1]))
