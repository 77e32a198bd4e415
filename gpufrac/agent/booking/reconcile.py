"""The ledger kept in line with the kubelet's pod-resources API.

The kubelet never says when it lets devices go (there is no Deallocate): the agent asks
pod-resources which containers still hold devices and releases the bookings it no longer
lists, rebuilds the ones it lists but the ledger lacks (state lost), and records which pod
and container holds each booking. The Reconciler does one such pass; the ReconcileLoop runs
them every few seconds and, soon after an admission, a pass followed by pod identity.

Everything here runs on the agent's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol

import grpc

from gpufrac.agent.booking.ledger import ContainerAlloc, keyed
from gpufrac.core import slices
from gpufrac.core.errors import AllocationError
from gpufrac.core.logs import decision
from gpufrac.core.slices import ContainerDevices
from gpufrac.memguard.abi import ConfigFile, ContainerConfig

log = logging.getLogger("gpufrac.agent")

# How often the agent asks pod-resources which containers still hold devices.
RECONCILE_INTERVAL = 3.0
# A fresh allocation is not released for missing from pod-resources this soon: the
# kubelet records it only after Allocate returns.
RELEASE_GRACE = 10.0


def _recorded_before(alloc: ContainerAlloc, when: float) -> bool:
    return alloc.recorded_at is not None and alloc.recorded_at < when


class PodResourcesLister(Protocol):
    """The kubelet's pod-resources List (gpufrac.deviceplugin.podresources.PodResourcesClient);
    raises grpc.aio.AioRpcError when the kubelet does not answer."""

    async def list(self, resources: tuple[str, ...] | None = None) -> list[ContainerDevices]: ...


class ReconciledLedger(Protocol):
    """What a pass reads and changes of the ledger (gpufrac.agent.booking.ledger.Ledger)."""

    def containers(self) -> list[ContainerAlloc]: ...
    def get(self, key: str) -> ContainerAlloc | None: ...
    def reserve(
        self, resource: str, device_ids: Sequence[str], *, ignore_health: bool = False
    ) -> ContainerAlloc: ...
    def attach(self, key: str, handle: ConfigFile) -> None: ...
    def bind(
        self, key: str, namespace: str, pod: str, container: str, pod_uid: str | None = None
    ) -> ContainerAlloc: ...
    def release(self, key: str) -> ContainerAlloc | None: ...


class Directories(Protocol):
    """The containers' directories (booking.container_dirs.ContainerDirs), written off the loop."""

    async def write(self, directory: str, cfg: ContainerConfig) -> ConfigFile: ...
    async def sweep(self, booked: Callable[[], Iterable[str]]) -> None: ...


class ReleaseMetrics(Protocol):
    """gpufrac.agent.metrics.Metrics, as far as a release concerns it."""

    def forget(self, container: str) -> None: ...


class Reconciler:
    """Aligns the ledger with pod-resources, one pass per reconcile(); `listing` is the last
    applied answer (container key -> who holds those devices)."""

    def __init__(
        self,
        ledger: ReconciledLedger,
        lister: PodResourcesLister,
        dirs: Directories,
        metrics: ReleaseMetrics,
        *,
        release_grace: float = RELEASE_GRACE,
    ) -> None:
        self.ledger = ledger
        self.lister = lister
        self.dirs = dirs
        self.metrics = metrics
        self.release_grace = release_grace
        # Last pod-resources answer: container key -> who holds those devices.
        self.listing: dict[str, ContainerDevices] = {}
        # Lists asked and the latest applied (reconciles overlap: the loop, identity passes,
        # Allocate and PreStartContainer; an answer older than the one applied is dropped).
        self._lists_asked = 0
        self._list_applied = 0
        self._listing_asked = 0.0  # time.monotonic() when the applied List was asked

    async def reconcile(self, grace: float | None = None, materialize: bool = True) -> bool:
        """Align the ledger with pod-resources: release what the kubelet no longer lists
        (older than `grace`), rebuild what it lists but the ledger lacks, record names.
        False when pod-resources did not answer (nothing changed then)."""
        grace = self.release_grace if grace is None else grace
        asked = time.monotonic()
        self._lists_asked += 1
        seq = self._lists_asked
        try:
            listed = await self.lister.list(slices.RESOURCES)
        except grpc.aio.AioRpcError as e:
            log.debug("pod-resources List: %s", e.details())
            return False
        if seq < self._list_applied:
            # A List asked after this one was applied meanwhile: this answer is older than
            # what the ledger now follows (it may name a released key's former pod). The
            # caller's release rule (Allocate asks with grace 0) goes over the newer one.
            self._release_unlisted(grace, self._listing_asked)
            return True
        self._list_applied, self._listing_asked = seq, asked
        self.listing = keyed(listed)
        for alloc in self.ledger.containers():
            c = self.listing.get(alloc.key)
            if c is not None:
                if alloc.recorded_at is None:
                    alloc.recorded_at = asked
                if alloc.pod is None:
                    self.ledger.bind(alloc.key, c.namespace, c.pod, c.container, alloc.pod_uid)
        self._release_unlisted(grace, asked)
        for key, c in self.listing.items():
            if seq != self._list_applied:
                break  # a newer List was applied during the last await: it decides the rest
            if self.ledger.get(key) is not None:
                continue
            try:
                alloc = self.ledger.reserve(c.resource, list(c.device_ids), ignore_health=True)
            except AllocationError as e:
                log.error(
                    "cannot rebuild allocation of %s/%s %s: %s", c.namespace, c.pod, c.container, e.message
                )
                continue
            alloc.recorded_at = asked  # listed: the kubelet holds it
            self.ledger.bind(alloc.key, c.namespace, c.pod, c.container, None)
            log.info(
                "rebuilt allocation %s of %s/%s %s from pod-resources", key, c.namespace, c.pod, c.container
            )
            if materialize:
                try:
                    handle = await self.dirs.write(alloc.directory, alloc.config)
                except OSError as e:
                    # Unbooked again, so the next reconcile rebuilds it (and tries the files again).
                    log.error("cannot write the directory of rebuilt allocation %s: %s", key, e)
                    if self.ledger.get(key) is alloc:
                        self.ledger.release(key)
                    continue
                self.ledger.attach(alloc.key, handle)
        return True

    def _release_unlisted(self, grace: float, asked: float) -> None:
        """Release the bookings the last applied List (asked at `asked`) lacks, unless younger
        than `grace` and not yet recorded by the kubelet."""
        now = time.time()
        for alloc in self.ledger.containers():
            if alloc.key in self.listing or alloc.claim is not None:
                continue  # listed; or a DRA claim's, released by NodeUnprepareResources only
            if now - alloc.created >= grace or _recorded_before(alloc, asked):
                # Too old to be an Allocate the kubelet has yet to record, or recorded
                # before this List was asked: the kubelet has let it go.
                decision(
                    log,
                    "release",
                    "releasing %s (%s): pod-resources no longer lists it",
                    alloc.key,
                    alloc.who(),
                    container=alloc.key,
                    resource=alloc.resource,
                    gpus=",".join(alloc.gpus),
                    request_bytes=alloc.request_bytes,
                    namespace=alloc.namespace or "",
                    pod=alloc.pod or "",
                )
                self.ledger.release(alloc.key)
                self.metrics.forget(alloc.key)

    async def materialize_all(self) -> None:
        """(Re)write every booked container's directory and keep its config open."""
        for alloc in self.ledger.containers():
            handle = await self.dirs.write(alloc.directory, alloc.config)
            self.ledger.attach(alloc.key, handle)

    async def sweep_orphans(self) -> None:
        """Delete the directories of containers the ledger does not book."""
        ledger = self.ledger
        await self.dirs.sweep(lambda: [a.key for a in ledger.containers()])


class PodResolver(Protocol):
    """Pod identity and policy from a pod-resources listing (gpufrac.agent.booking.pods.PodIdentity)."""

    async def resolve(self, listing: Mapping[str, ContainerDevices] | None = None) -> int: ...


class ReconcileMetrics(Protocol):
    def count_reconcile_error(self) -> None: ...


class ReconcileLoop:
    """Reconciles every `interval`, each answered pass followed by an orphan sweep and pod
    identity; kick() asks for a pass and identity soon (after an admission)."""

    def __init__(
        self,
        reconciler: Reconciler,
        pods: PodResolver,
        metrics: ReconcileMetrics,
        *,
        interval: float = RECONCILE_INTERVAL,
    ) -> None:
        self.reconciler = reconciler
        self.pods = pods
        self.metrics = metrics
        self.interval = interval
        self._identity_task: asyncio.Task[None] | None = None
        self._identity_again = False

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                if await self.reconciler.reconcile():
                    await self.reconciler.sweep_orphans()
                    await self.resolve_identity()
                else:
                    self.metrics.count_reconcile_error()  # pod-resources did not answer
            except Exception:
                self.metrics.count_reconcile_error()
                log.exception("reconcile failed")

    def kick(self) -> None:
        """Resolve pod identity soon, without delaying the kubelet's call."""
        if self._identity_task is not None and not self._identity_task.done():
            self._identity_again = True
            return
        self._identity_task = asyncio.create_task(self._identity_soon())

    async def _identity_soon(self) -> None:
        while True:
            # Coalesce a burst of admissions into one pass (and stay far below the
            # kubelet's pod-resources rate limit).
            await asyncio.sleep(0.2)
            self._identity_again = False
            try:
                await self.reconciler.reconcile()  # the kubelet has recorded the new allocation by now
                await self.resolve_identity()
            except Exception:  # the reconcile loop tries again; say why this pass failed
                self.metrics.count_reconcile_error()
                log.exception("identity pass after an admission failed")
            if not self._identity_again:
                return

    async def resolve_identity(self) -> None:
        """Pod identity for new and changed containers, from the last pod-resources listing."""
        try:
            await self.pods.resolve(self.reconciler.listing)
        except Exception:
            log.exception("pod identity resolution failed")

    def close(self) -> None:
        """Cancel a pending identity pass (the agent is stopping)."""
        if self._identity_task is not None:
            self._identity_task.cancel()
