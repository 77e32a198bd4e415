"""The kubelet emulator's records: pods as tests write them, what the device manager
keeps per resource and per allocation, and the kubelet's own checks and error texts."""

from __future__ import annotations

import asyncio
import re
import uuid as uuid_mod
from collections.abc import Iterable
from dataclasses import dataclass, field

import grpc

from gpufrac.proto import deviceplugin_pb2 as pb
from gpufrac.proto import deviceplugin_pb2_grpc as pb_grpc
from gpufrac.proto import podresources_pb2 as pr

SUPPORTED_VERSIONS = ["v1beta1"]
HEALTHY = "Healthy"
DIAL_TIMEOUT = 10.0
PRESTART_TIMEOUT = 30.0
ENDPOINT_STOP_GRACE = 300.0
CHECKPOINT = "kubelet_internal_checkpoint"
QUALIFIED = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)$")


def go_code(code: grpc.StatusCode) -> str:
    """grpc-go's name of a status code (InvalidArgument), as the kubelet prints it."""
    return "".join(p.title() for p in code.name.split("_")).replace("Ok", "OK")


def go_error(e: grpc.aio.AioRpcError) -> str:
    return f"rpc error: code = {go_code(e.code())} desc = {e.details()}"


def is_extended_resource_name(name: str) -> bool:
    """v1helper.IsExtendedResourceName: domain-prefixed, not kubernetes.io, not requests.*"""
    if "/" not in name or name.startswith("requests."):
        return False
    domain, _, short = name.partition("/")
    if domain == "kubernetes.io" or domain.endswith(".kubernetes.io") or not domain or not short:
        return False
    return len(short) <= 63 and bool(QUALIFIED.match(short)) and "." in domain


@dataclass
class Container:
    name: str
    # Extended resources from resources.limits (request == limit for them).
    resources: dict[str, int] = field(default_factory=dict)


@dataclass
class Pod:
    namespace: str
    name: str
    containers: list[Container]
    uid: str = field(default_factory=lambda: str(uuid_mod.uuid4()))
    annotations: dict[str, str] = field(default_factory=dict)
    priority: int = 0


class AdmissionError(Exception):
    """The kubelet rejected the pod at admission (pod phase Failed with this reason)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message


@dataclass
class Endpoint:
    resource: str
    socket: str
    channel: grpc.aio.Channel
    stub: pb_grpc.DevicePluginAsyncStub  # on an aio channel: the stub's calls are awaitable
    options: pb.DevicePluginOptions
    generation: int
    task: asyncio.Task[None] | None = None
    stopped_at: float | None = None


@dataclass
class Resource:
    endpoint: Endpoint | None = None
    snapshots: int = 0
    registrations: list[float] = field(default_factory=list)  # time.monotonic() of each

    # The last snapshot, decoded lazily: a Go kubelet digests 800 devices in microseconds,
    # Python would add milliseconds to the admissions the bench times. Topology (a list per
    # device) is read only for the devices asked about.
    _last: pb.ListAndWatchResponse | None = None
    _decoded: tuple[dict[str, str], dict[str, pb.Device], set[str]] | None = None
    _override: dict[str, str] | None = None

    def update(self, msg: pb.ListAndWatchResponse | None, devices: dict[str, str] | None = None) -> None:
        self._last, self._decoded, self._override = msg, None, devices

    def _decode(self) -> tuple[dict[str, str], dict[str, pb.Device], set[str]]:
        if self._decoded is None:
            devices: dict[str, str]
            msgs: dict[str, pb.Device]
            if self._override is not None:
                devices, msgs = self._override, {}
            elif self._last is None:
                devices, msgs = {}, {}
            else:
                msgs = {d.ID: d for d in self._last.devices}
                devices = {i: d.health for i, d in msgs.items()}
            self._decoded = (devices, msgs, {d for d, h in devices.items() if h == HEALTHY})
        return self._decoded

    @property
    def devices(self) -> dict[str, str]:
        return self._decode()[0]

    def numa_nodes(self, device_ids: Iterable[str]) -> list[int]:
        """The NUMA nodes the last snapshot gives these devices, sorted, each once."""
        msgs = self._decode()[1]
        return sorted({n.ID for d in device_ids if d in msgs for n in msgs[d].topology.nodes})

    @property
    def healthy(self) -> set[str]:
        return self._decode()[2]


@dataclass
class Allocated:
    resource: str
    device_ids: list[str]
    response: pb.ContainerAllocateResponse
    # Each device's NUMA nodes when allocated: the kubelet keeps them with its allocation record.
    numa_nodes: dict[str, list[int]] = field(default_factory=dict)
    # Time spent in the plugin's RPCs for this allocation (preferred + Allocate + PreStart).
    rpc_seconds: float = 0.0


@dataclass
class PodRecord:
    pod: Pod
    # container name -> resource -> allocation
    allocations: dict[str, dict[str, Allocated]] = field(default_factory=dict)
    start_errors: dict[str, str] = field(default_factory=dict)
    # Its pod-resources entry, built once per set of allocations: a Go kubelet answers List
    # in microseconds, Python building ~10 messages a pod would tax every admission the
    # bench times while the agent asks.
    listed: tuple[int, pr.PodResources] | None = None
