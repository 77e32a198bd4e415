"""GPU inventory types: what the agent knows about each GPU on the node.

The inventory is read through nvidia-ml-py (gpufrac/agent/gpu/inventory.py), the same
code on simgpu and on a real node. Everything else in the agent consumes these
types, never NVML directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

# How a GPU in MIG mode is described wherever it is listed (log, `gpufrac gpus`, status).
MIG_REASON = "MIG enabled: not shared by gpufrac, left to the MIG-aware device plugin"


class PcieLink(str, Enum):
    """How two GPUs reach each other over PCIe, best first (nvidia-smi topo -m names)."""

    SELF = "X"
    BOARD = "PIX"  # same board / single PCIe switch
    SWITCH = "PXB"  # several PCIe switches, no host bridge
    HOST_BRIDGE = "PHB"  # through one CPU's host bridge
    NUMA = "NODE"  # across host bridges within one NUMA node
    SYSTEM = "SYS"  # across the inter-socket link

    @property
    def rank(self) -> int:
        return list(PcieLink).index(self)


@dataclass(frozen=True)
class Gpu:
    index: int
    uuid: str
    model: str
    memory_total: int  # bytes, as NVML reports
    pci_bus_id: str
    numa_node: int | None
    cpu_affinity: tuple[int, ...]
    minor: int
    compute_capability: str = ""  # "9.0"; empty where the driver does not say


@dataclass(frozen=True)
class Link:
    nvlinks: int  # active NVLink links between the pair (0 = none)
    pcie: PcieLink


@dataclass
class GpuHealth:
    healthy: bool = True
    reason: str = ""  # e.g. "XID 79 at 2026-11-23T07:30:00Z", "fell off the bus"
    since: float = 0.0  # time.time() of the last change


@dataclass
class Inventory:
    gpus: list[Gpu]
    # links[(a, b)] for every ordered pair of GPU indices a != b
    links: dict[tuple[int, int], Link] = field(default_factory=dict)
    driver_version: str = ""
    cuda_driver_version: int = 0
    # NVML indices of GPUs that did not answer (fell off the bus) -> why; not in `gpus`.
    unreachable: dict[int, str] = field(default_factory=dict)
    # GPUs in MIG mode: not in `gpus` (never advertised, never in the topology). Their
    # instances belong to a MIG-aware device plugin; sharing the parent GPU would hand
    # the same memory out twice.
    mig: list[Gpu] = field(default_factory=list)

    def by_uuid(self, uuid: str) -> Gpu | None:
        return next((g for g in self.gpus if g.uuid == uuid), None)

    def link(self, a: int, b: int) -> Link:
        return Link(0, PcieLink.SELF) if a == b else self.links[(a, b)]


def mig_to_dict(g: Gpu, used: int | None = None) -> dict[str, Any]:
    """A GPU in MIG mode, as `gpufrac gpus` and `gpufrac status` list it (not shared)."""
    return {
        "index": g.index,
        "uuid": g.uuid,
        "model": g.model,
        "memory_total": g.memory_total,
        "memory_used": used,
        "pci_bus_id": g.pci_bus_id,
        "numa_node": g.numa_node,
        "reason": MIG_REASON,
    }
