"""The agent's allocation service: what the kubelet's device-plugin calls do to the ledger.

The device-plugin servers (gpufrac.deviceplugin.server) are a thin gRPC front end over
this (their Backend): the device lists per GPU, the preferred slices, Allocate (book,
write the container's directory, start admission) and PreStartContainer (find the
booking, rebuilt from pod-resources if the agent lost it, and await admission).
Everything here runs on the agent's event loop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Container, Hashable, Iterable, Mapping, Sequence
from typing import Protocol

from gpufrac.agent.booking import placement as preferred_mod
from gpufrac.agent.booking.claims import DeviceHealth, PrepareResult
from gpufrac.agent.booking.ledger import ContainerAlloc
from gpufrac.core.claims import ClaimRef
from gpufrac.core.config import Config
from gpufrac.core.errors import AllocationError, ErrorKind
from gpufrac.core.gpus import Inventory
from gpufrac.core.logs import decision
from gpufrac.core.slices import GpuGeometry
from gpufrac.memguard.abi import ConfigFile, ContainerConfig

log = logging.getLogger("gpufrac.agent")

DeviceSection = tuple[Hashable, Callable[[], list[tuple[str, bool, int | None]]]]


class BookingLedger(Protocol):
    """What the service reads and books (gpufrac.agent.booking.ledger.Ledger)."""

    @property
    def geometry(self) -> Mapping[str, GpuGeometry]: ...
    def device_sections(self, resource: str) -> Sequence[DeviceSection]: ...
    def booked(self) -> Container[str]: ...
    def released(self) -> Mapping[str, int]: ...
    def find(self, resource: str, device_ids: Iterable[str]) -> ContainerAlloc | None: ...
    def owner(self, device_id: str) -> ContainerAlloc | None: ...
    def reserve(self, resource: str, device_ids: Sequence[str]) -> ContainerAlloc: ...
    def attach(self, key: str, handle: ConfigFile) -> None: ...
    def release(self, key: str) -> ContainerAlloc | None: ...


class Reconciling(Protocol):
    """The ledger against pod-resources (gpufrac.agent.booking.reconcile.Reconciler)."""

    @property
    def listing(self) -> Container[str]: ...
    async def reconcile(self, grace: float | None = None, materialize: bool = True) -> bool: ...


class DirectoryMaker(Protocol):
    """A new container's directory (gpufrac.agent.booking.container_dirs.ContainerDirs), made off the loop."""

    async def create(self, directory: str, cfg: ContainerConfig) -> ConfigFile: ...


class Admitting(Protocol):
    """Reclaim at admission (gpufrac.agent.arbiter.admission.Admission)."""

    def start(self, alloc: ContainerAlloc) -> None: ...
    async def prestart(self, alloc: ContainerAlloc) -> None: ...


class IdentityKick(Protocol):
    """Pod identity soon, off the kubelet's call (gpufrac.agent.booking.reconcile.ReconcileLoop)."""

    def kick(self) -> None: ...


class ClaimPreparer(Protocol):
    """Claims prepared and unprepared for the DRA driver (gpufrac.agent.booking.claims.ClaimService)."""

    async def prepare(self, refs: Sequence[ClaimRef]) -> Mapping[str, PrepareResult]: ...
    async def unprepare(self, refs: Sequence[ClaimRef]) -> Mapping[str, AllocationError | None]: ...
    def health(self) -> list[DeviceHealth]: ...


class AllocationService:
    """The front ends' Backend: the device-plugin servers' (slices of the two resources) and,
    on a node in DRA mode, the DRA driver's (claims, through `claims`)."""

    def __init__(
        self,
        config: Config,
        ledger: BookingLedger,
        inventory: Inventory,
        reconciler: Reconciling,
        dirs: DirectoryMaker,
        admission: Admitting,
        identity: IdentityKick,
        claims: ClaimPreparer | None = None,
    ) -> None:
        self.config = config
        self.ledger = ledger
        self.inventory = inventory
        self.reconciler = reconciler
        self.dirs = dirs
        self.admission = admission
        self.identity = identity
        self.claims = claims

    def device_sections(self, resource: str) -> list[DeviceSection]:
        return list(self.ledger.device_sections(resource))

    def preferred(self, resource: str, available: Sequence[str], must: Sequence[str], size: int) -> list[str]:
        return preferred_mod.preferred(
            resource,
            available,
            must,
            size,
            self.ledger.geometry,
            self.inventory,
            self.config.allocation_policy,
            self.ledger.booked(),
            self.ledger.released(),
        )

    async def allocate(self, resource: str, device_ids: Sequence[str]) -> ContainerAlloc:
        ledger, reconciler = self.ledger, self.reconciler
        existing = ledger.find(resource, device_ids)
        if existing is not None or any(ledger.owner(d) for d in device_ids):
            # The kubelet reuses devices of deleted pods without telling us: ask it
            # which holders are still alive before calling this double booking.
            if await reconciler.reconcile(grace=0.0):
                existing = ledger.find(resource, device_ids)
                if existing is not None and existing.key in reconciler.listing:
                    log.info(
                        "Allocate: %s again for %s (kubelet re-allocation)", existing.key, existing.who()
                    )
                    return existing
            elif existing is not None:
                # Cannot tell who holds them: start over with the safe config (limit = request).
                ledger.release(existing.key)
        alloc = ledger.reserve(resource, device_ids)
        try:
            handle = await self.dirs.create(alloc.directory, alloc.config)
        except OSError as e:
            ledger.release(alloc.key)
            raise AllocationError(
                ErrorKind.NODE_FAILURE, f"cannot create container directory {alloc.directory}: {e}"
            ) from e
        ledger.attach(alloc.key, handle)
        # The state file follows through the persist loop, off the kubelet's critical path:
        # if the agent dies before it lands, pod-resources (the kubelet's record) rebuilds it.
        decision(
            log,
            "allocate",
            "allocated %s: %s x%d on %s (%d bytes per GPU)",
            alloc.key,
            resource,
            alloc.slice_count,
            ",".join(alloc.gpus),
            alloc.request_bytes,
            container=alloc.key,
            resource=resource,
            slices=alloc.slice_count,
            gpus=",".join(alloc.gpus),
            request_bytes=alloc.request_bytes,
        )
        self.identity.kick()
        self.admission.start(alloc)  # PreStartContainer awaits it
        return alloc

    async def prestart(self, resource: str, device_ids: Sequence[str]) -> None:
        if self.ledger.find(resource, device_ids) is None:
            await self.reconciler.reconcile()  # rebuilds from pod-resources if our state was lost
        alloc = self.ledger.find(resource, device_ids)
        if alloc is None:
            ids = sorted(device_ids)
            raise AllocationError(
                ErrorKind.STATE_CONFLICT,
                f"PreStartContainer: {resource} devices {ids[:6]}{'…' if len(ids) > 6 else ''} were never "
                "allocated by this agent",
            )
        if alloc.recorded_at is None:
            alloc.recorded_at = time.monotonic()  # the kubelet records an allocation before any start
        self.identity.kick()
        await self.admission.prestart(alloc)  # never fails the start: at worst it warns

    # -- the DRA driver (docs/architecture.md: a node in mode dra) ------------------------------

    async def prepare_claims(self, refs: Sequence[ClaimRef]) -> Mapping[str, PrepareResult]:
        """NodePrepareResources: each claim's devices (booked, its directory and CDI spec
        written, the state saved), or why not."""
        if self.claims is None:
            return {r.uid: _not_dra(r) for r in refs}
        result = await self.claims.prepare(refs)
        self.identity.kick()
        return result

    async def unprepare_claims(self, refs: Sequence[ClaimRef]) -> Mapping[str, AllocationError | None]:
        """NodeUnprepareResources: each claim's booking released (a claim not booked succeeds)."""
        if self.claims is None:
            return {r.uid: None for r in refs}  # nothing of a claim is booked on this node
        return await self.claims.unprepare(refs)

    def device_health(self) -> list[DeviceHealth]:
        """The health of every device the DRA driver publishes."""
        return [] if self.claims is None else self.claims.health()


def _not_dra(ref: ClaimRef) -> AllocationError:
    return AllocationError(
        ErrorKind.STATE_CONFLICT, f"{ref.who()}: this node's agent is in device-plugin mode, not dra"
    )
