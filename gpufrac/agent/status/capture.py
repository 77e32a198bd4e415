"""A copy of the agent's state into the status model, taken on the agent's loop.

capture() does no I/O and must run on the loop that owns the ledger; capture_threadsafe()
asks the loop for one from another thread (the HTTP servers' threads). What it reads of the
agent is `Observed` below: gpufrac.agent.main.Agent satisfies it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

import gpufrac
from gpufrac.agent.status.model import ContainerStatus, GpuStatus, NodeStatus
from gpufrac.core import slices
from gpufrac.core.gpus import mig_to_dict
from gpufrac.memguard import abi

if TYPE_CHECKING:
    from gpufrac.agent.booking.ledger import ContainerAlloc
    from gpufrac.agent.compute.loop import ComputeFigures
    from gpufrac.core.config import Config
    from gpufrac.core.gpus import GpuHealth, Inventory
    from gpufrac.core.slices import GpuGeometry

# How long a reader in another thread waits for the loop to take a snapshot.
CAPTURE_TIMEOUT = 10.0


class Flag(Protocol):
    """A one-way switch (an asyncio.Event): set once something has happened."""

    def is_set(self) -> bool: ...


class Registration(Protocol):
    """One resource's device-plugin server, as the kubelet sees it."""

    @property
    def registered(self) -> Flag: ...

    @property
    def registrations(self) -> int: ...  # registrations with the kubelet so far


class LedgerView(Protocol):
    """The bookings, read-only (gpufrac.agent.booking.ledger.Ledger)."""

    @property
    def geometry(self) -> Mapping[str, GpuGeometry]: ...

    def containers(self) -> Sequence[ContainerAlloc]: ...

    def devices(self, resource: str) -> Sequence[tuple[str, bool, int | None]]: ...

    def owner(self, device_id: str) -> object | None: ...

    def requested(self, gpu_uuid: str) -> int: ...

    def healthy(self, gpu_uuid: str) -> bool: ...


class HealthView(Protocol):
    """The GPU health monitor's findings (gpufrac.agent.gpu.health.HealthMonitor)."""

    def current(self) -> Mapping[str, GpuHealth]: ...

    def xid_counts(self) -> Mapping[tuple[str, int], int]: ...


class IdleClock(Protocol):
    """Seconds since a container's last GPU work (gpufrac.agent.gpu.activity.ActivityTracker)."""

    def idle_seconds(self, key: str) -> float | None: ...


class ComputeView(Protocol):
    """Each container's compute share as measured and held (compute/loop.py ComputeLoop)."""

    def figures(self, key: str) -> ComputeFigures | None: ...


class Observed(Protocol):
    """What the status model reads of the agent. `inventory` and `ledger` are None until the
    GPUs are read; `health` and `activity` None while those parts are not running."""

    @property
    def config(self) -> Config: ...

    @property
    def inventory(self) -> Inventory | None: ...

    @property
    def ledger(self) -> LedgerView | None: ...

    @property
    def health(self) -> HealthView | None: ...

    @property
    def activity(self) -> IdleClock | None: ...

    @property
    def compute(self) -> ComputeView | None: ...

    @property
    def servers(self) -> Mapping[str, Registration]: ...  # by resource name

    @property
    def started(self) -> Flag: ...


def _front_ends(agent: Observed) -> list[str]:
    """What registers with the kubelet: both resources' device plugins, or the DRA driver."""
    return list(agent.servers) or list(slices.RESOURCES)


def readiness(agent: Observed) -> tuple[bool, str]:
    """Ready = inventory read and the front ends registered with the kubelet (both resources'
    device plugins, or the DRA driver)."""
    if agent.inventory is None or agent.ledger is None:
        return False, "reading the GPU inventory"
    if not agent.started.is_set():
        return False, "starting"
    missing = [r for r in _front_ends(agent) if not _registered(agent, r)]
    if missing:
        return False, "not registered with the kubelet: " + ", ".join(missing)
    return True, "ok"


def _registered(agent: Observed, resource: str) -> bool:
    server = agent.servers.get(resource)
    return server is not None and server.registered.is_set()


def capture(agent: Observed) -> NodeStatus:
    """A copy of the agent's state. Call on the agent's loop (the ledger's owner)."""
    ready, why = readiness(agent)
    servers = agent.servers
    status = NodeStatus(
        node=agent.config.node_name,
        version=gpufrac.__version__,
        time=time.time(),
        ready=ready,
        ready_reason=why,
        registered={r: _registered(agent, r) for r in _front_ends(agent)},
        registrations={r: (servers[r].registrations if r in servers else 0) for r in _front_ends(agent)},
    )
    inv, ledger, health = agent.inventory, agent.ledger, agent.health
    if inv is None or ledger is None:
        return status
    status.driver_version = inv.driver_version
    status.unreachable = dict(inv.unreachable)
    status.mig = [mig_to_dict(g) for g in inv.mig]
    gpu_health = health.current() if health is not None else {}
    xids = health.xid_counts() if health is not None else {}
    allocs = ledger.containers()
    granted: dict[str, int] = {}
    for a in allocs:
        for u in a.gpus:
            granted[u] = granted.get(u, 0) + a.config.grant_bytes
    per_resource = {r: ledger.devices(r) for r in slices.RESOURCES}
    for g in inv.gpus:
        geo = ledger.geometry[g.uuid]
        prefix = g.uuid + "::"
        counts: dict[str, dict[str, int]] = {}
        for r, devices in per_resource.items():
            mine = [(d, ok) for d, ok, _ in devices if d.startswith(prefix)]
            allocated = sum(1 for d, _ in mine if ledger.owner(d) is not None)
            free = sum(1 for d, ok in mine if ok and ledger.owner(d) is None)
            counts[r] = {"total": geo.slices(r), "allocated": allocated, "free": free}
        h = gpu_health.get(g.uuid)
        status.gpus.append(
            GpuStatus(
                index=g.index,
                uuid=g.uuid,
                model=g.model,
                pci_bus_id=g.pci_bus_id,
                numa_node=g.numa_node,
                memory_total_bytes=g.memory_total,
                memory_allocatable_bytes=geo.allocatable,
                memory_requested_bytes=ledger.requested(g.uuid),
                memory_burst_granted_bytes=granted.get(g.uuid, 0),
                healthy=ledger.healthy(g.uuid),
                health_reason="" if h is None or h.healthy else h.reason,
                slices=counts,
                nvlinks={
                    p.uuid: inv.link(g.index, p.index).nvlinks
                    for p in inv.gpus
                    if p.index != g.index and (g.index, p.index) in inv.links
                },
                xid_errors={x: n for (u, x), n in xids.items() if u == g.uuid},
            )
        )
    activity = agent.activity  # launches + NVML, tracked on the loop
    compute = agent.compute
    for a in allocs:
        c = a.config
        shares = compute.figures(a.key) if compute is not None else None
        cs = ContainerStatus(
            key=a.key,
            resource=a.resource,
            namespace=a.namespace or "",
            pod=a.pod or "",
            container=a.container or "",
            gpus=list(a.gpus),
            slices=a.slice_count,
            whole_gpu=a.whole_gpu,
            request_bytes=a.request_bytes,
            limit_bytes=c.limit_bytes,
            burst_granted_bytes=c.grant_bytes,
            workload_class=abi.CLASS_BY_NUMBER.get(c.workload_class, str(c.workload_class)),
            priority=c.priority,
            created=a.created,
            directory=a.directory,
            idle_seconds=activity.idle_seconds(a.key) if activity is not None else None,
            claim=a.claim.name if a.claim is not None else "",
        )
        if shares is not None:
            _set_compute(cs, shares)
        status.containers.append(cs)
    return status


def _set_compute(cs: ContainerStatus, f: ComputeFigures) -> None:
    cs.compute_share = f.share
    cs.compute_mode = f.mode
    cs.compute_used = round(f.used, 4)
    cs.compute_target = round(f.target, 4)
    cs.compute_paced = f.pace_ns > 0
    cs.compute_throttled_seconds = round(f.throttled_s, 3)
    cs.compute_unheld = f.unheld


def capture_threadsafe(
    agent: Observed, loop: asyncio.AbstractEventLoop, timeout: float = CAPTURE_TIMEOUT
) -> NodeStatus:
    """capture() run on the agent's loop, waited for from another thread (an HTTP server's)."""

    async def run() -> NodeStatus:
        return capture(agent)

    return asyncio.run_coroutine_threadsafe(run(), loop).result(timeout)
