"""The status documents: plain dataclasses, copied from the agent's state (capture.py) and
completed with NVML and usage-file figures (enrich.py). NodeStatus.to_dict() is the JSON the
status socket serves."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class GpuStatus:
    index: int
    uuid: str
    model: str
    pci_bus_id: str
    numa_node: int | None
    memory_total_bytes: int
    memory_allocatable_bytes: int
    memory_requested_bytes: int
    memory_burst_granted_bytes: int
    healthy: bool
    health_reason: str = ""
    # resource -> {"total", "allocated", "free"}: free = unallocated slices the kubelet may still admit
    slices: dict[str, dict[str, int]] = field(default_factory=dict)
    nvlinks: dict[str, int] = field(default_factory=dict)  # peer UUID -> active NVLink links
    xid_errors: dict[int, int] = field(default_factory=dict)  # XID -> count since agent start
    # From NVML (enrich); None when the GPU did not answer.
    memory_used_bytes: int | None = None
    utilization_ratio: float | None = None


@dataclass
class ContainerStatus:
    key: str
    resource: str
    namespace: str
    pod: str
    container: str
    gpus: list[str]
    slices: int
    whole_gpu: bool
    request_bytes: int  # per GPU
    limit_bytes: int
    burst_granted_bytes: int
    workload_class: str
    priority: int
    created: float  # wall clock
    directory: str
    # From the container's usage file (enrich); None when it could not be read.
    used_bytes: int | None = None
    processes: int = 0
    idle_seconds: float | None = None
    oom_refusals: int = 0
    swapped_bytes: int = 0
    # A DRA claim's booking: the ResourceClaim's name (in `namespace`); "" for a container.
    claim: str = ""
    # Its compute share (gpufrac.agent.compute, docs/compute.md); None while compute shares are
    # off, and for whole GPUs (their containers' own).
    compute_share: float | None = None  # of its GPU, 0..1
    compute_mode: str = ""  # fair or strict
    compute_used: float | None = None  # measured use of its GPU by the driver, about the last second
    compute_target: float | None = None  # what it may use now
    compute_paced: bool = False  # its launches are held back now
    compute_throttled_seconds: float = 0.0  # time its launches were paced since the agent started
    compute_unheld: bool = False  # over what it may use though paced to the slowest

    @property
    def known(self) -> bool:
        return bool(self.pod)


@dataclass
class NodeStatus:
    node: str
    version: str
    time: float
    ready: bool
    ready_reason: str
    registered: dict[str, bool]
    registrations: dict[str, int]
    driver_version: str = ""
    gpus: list[GpuStatus] = field(default_factory=list)
    containers: list[ContainerStatus] = field(default_factory=list)
    unreachable: dict[int, str] = field(default_factory=dict)
    # GPUs in MIG mode, left to the MIG-aware plugin (gpufrac.core.gpus.mig_to_dict).
    mig: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class UsageView:
    """What a container's usage file says, in the units the views want."""

    used_bytes: int
    processes: int
    idle_seconds: float
    oom_refusals: int
    swapped_bytes: int
    # (pid, start_time) -> oom_refusals of each live slot (metrics keeps refusals monotonic)
    slot_refusals: dict[tuple[int, int], int]
