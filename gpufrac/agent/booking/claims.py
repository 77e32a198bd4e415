"""Claims: what the DRA driver's NodePrepareResources and NodeUnprepareResources do.

The kubelet names a claim (namespace, name, uid); the scheduler wrote what it holds into the
claim's status.allocation, which prepare reads from the apiserver (gpufrac.agent.kube.claims,
parsed by gpufrac.core.claims). A claim is booked like a container (gpufrac.agent.booking.ledger,
keyed by its UID):

* a share of one GPU: consumedCapacity.memory, the amount the scheduler consumed after the
  device's requestPolicy rounded it (memoryUnit steps), booked as that many gpu-memory slices;
* a whole GPU (no consumedCapacity, or the requestPolicy default: all of it), or several:
  every gpu-fraction slice of each, as a whole-GPU container is (no limit of its own).

Then its policy is applied from its parameters (gpufrac.agent.booking.claim_identity), its directory
made (config, usage, arbiter socket: gpufrac.agent.booking.container_dirs) with the booking's record
in it (gpufrac.agent.booking.ledger_store.write_claim_record: after the agent's restart the kubelet
sends nothing again, so what was prepared must be on file before the answer, and the state
file follows only within its batch), and, side by side, its CDI spec written
(gpufrac.agent.booking.cdi) and admission's reclaim of its request run (gpufrac.agent.arbiter.admission).
The record is written, not synced: it survives the agent's kill -9; a crash of the node ends
the claim's containers, and the restarted kubelet prepares the claim again.
Prepare is idempotent (a claim already booked answers the same devices: the kubelet sends
prepared claims again after it restarts), and so is unprepare (a claim never prepared, or
already unprepared, succeeds). Each claim of a call
gets its own answer; one refused claim does not refuse the others.

A claim whose unprepare never came (the kubelet lost it, or the agent died between a release
and its state save) would hold its memory for ever: every `dra.claimCheckInterval` the bookings
are checked against the apiserver, and one whose claim is gone, is another claim of that name
now, or is no longer allocated to this node (deallocated once its pods are gone) is released.
Everything here runs on the agent's loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from gpufrac.agent.booking.cdi import ClaimDevice
from gpufrac.agent.booking.ledger import ContainerAlloc
from gpufrac.core import claims as claims_mod
from gpufrac.core import logs
from gpufrac.core.claims import ClaimAllocation, ClaimRef, Share
from gpufrac.core.errors import AllocationError, ErrorKind
from gpufrac.core.gpus import Inventory
from gpufrac.core.logs import decision
from gpufrac.core.slices import FRACTION, FRACTION_SLICES, MEMORY, GpuGeometry, device_id
from gpufrac.core.units import format_bytes
from gpufrac.memguard.abi import ConfigFile, ContainerConfig

log = logging.getLogger(__name__)
TIMES_KEPT = 4096  # claims whose prepare times the summary at stop covers


@dataclass(frozen=True)
class PreparedDevice:
    """One device of a prepared claim, as NodePrepareResources answers it."""

    requests: tuple[str, ...]
    pool: str
    device: str
    cdi_ids: tuple[str, ...]


PrepareResult = list[PreparedDevice] | AllocationError


@dataclass(frozen=True)
class DeviceHealth:
    """One published device's health, as the DRA health service reports it."""

    pool: str
    device: str
    healthy: bool
    message: str


class ClaimLedger(Protocol):
    """What claims read and book of the ledger (gpufrac.agent.booking.ledger.Ledger)."""

    @property
    def geometry(self) -> Mapping[str, GpuGeometry]: ...
    def containers(self) -> list[ContainerAlloc]: ...
    def by_claim(self, uid: str) -> ContainerAlloc | None: ...
    def booked(self) -> Any: ...  # a Container[str] of booked device IDs
    def reserve(
        self, resource: str, device_ids: Sequence[str], *, claim: ClaimRef | None = None
    ) -> ContainerAlloc: ...
    def attach(self, key: str, handle: ConfigFile) -> None: ...
    def release(self, key: str) -> ContainerAlloc | None: ...
    def unhealthy(self) -> Mapping[str, str]: ...


class ClaimSource(Protocol):
    """ResourceClaims from the apiserver (gpufrac.agent.kube.ClaimReader): None when the claim
    does not exist; raises an exception when it cannot be read."""

    async def get(self, namespace: str, name: str) -> dict[str, Any] | None: ...


class DirectoryMaker(Protocol):
    """A booking's directory (gpufrac.agent.booking.container_dirs.ContainerDirs)."""

    async def create(self, directory: str, cfg: ContainerConfig) -> ConfigFile: ...


class Specs(Protocol):
    """The CDI specs of prepared claims (gpufrac.agent.booking.cdi.CdiSpecs)."""

    def device_ids(self, claim: ClaimDevice) -> list[str]: ...
    async def write(self, claim: ClaimDevice) -> list[str]: ...
    async def remove(self, uid: str) -> None: ...
    async def sync(self, booked: Sequence[ClaimDevice]) -> None: ...


class Records(Protocol):
    """A claim booking's record in its directory (gpufrac.agent.booking.ledger_store.write_claim_record),
    written on the loop: small, as the spare directory's rename is. Raises OSError."""

    def write(self, alloc: ContainerAlloc) -> None: ...


class Durable(Protocol):
    """The state file saved now, after a release (gpufrac.agent.booking.persist.Persister.flush); raises
    OSError."""

    async def flush(self) -> None: ...


class Policies(Protocol):
    """A claim's policy from its parameters, and its consumers (gpufrac.agent.booking.claim_identity)."""

    def prepared(self, alloc: ContainerAlloc, allocation: ClaimAllocation) -> None: ...
    def released(self, alloc: ContainerAlloc) -> None: ...
    def known(self, key: str) -> bool: ...


class Admitting(Protocol):
    """Reclaim at admission (gpufrac.agent.arbiter.admission.Admission)."""

    def start(self, alloc: ContainerAlloc) -> None: ...
    async def prestart(self, alloc: ContainerAlloc) -> None: ...


class Forgetting(Protocol):
    """Per-container metrics of a released booking (gpufrac.agent.metrics.Metrics)."""

    def forget(self, container: str) -> None: ...


def claim_device(alloc: ContainerAlloc) -> ClaimDevice:
    assert alloc.claim is not None
    return ClaimDevice(alloc.claim.uid, alloc.gpus, alloc.directory)


class ClaimService:
    """Prepares and unprepares claims for the DRA front end (through the allocation service)."""

    def __init__(
        self,
        ledger: ClaimLedger,
        inventory: Inventory,
        source: ClaimSource,
        dirs: DirectoryMaker,
        specs: Specs,
        records: Records,
        durable: Durable,
        policies: Policies,
        admission: Admitting,
        metrics: Forgetting,
        *,
        driver: str,
        pool: str,
        device_names: Mapping[str, str],
    ) -> None:
        self.ledger = ledger
        self.inventory = inventory
        self.source = source
        self.dirs = dirs
        self.specs = specs
        self.records = records
        self.durable = durable
        self.policies = policies
        self.admission = admission
        self.metrics = metrics
        self.driver = driver
        self.pool = pool
        self.gpu_of = dict(device_names)  # device name -> GPU UUID
        self.device_of = {u: d for d, u in self.gpu_of.items()}
        # One prepare or unprepare of a claim at a time (the kubelet may retry while one runs).
        self._locks: dict[str, asyncio.Lock] = {}
        self.prepared = 0  # claims booked (tests, the bench)
        # Per claim booked: seconds reading it from the apiserver, and in all (the summary at stop).
        self.times: deque[tuple[float, float]] = deque(maxlen=TIMES_KEPT)

    # -- prepare ---------------------------------------------------------------------------

    async def prepare(self, refs: Sequence[ClaimRef]) -> dict[str, PrepareResult]:
        """Each claim's devices, or why it was refused."""
        results = await asyncio.gather(*(self._prepare_locked(r) for r in refs))
        return {ref.uid: result for ref, result in zip(refs, results, strict=True)}

    async def _prepare_locked(self, ref: ClaimRef) -> PrepareResult:
        async with self._lock(ref.uid):
            try:
                return await self._prepare(ref)
            except AllocationError as e:
                log.warning("NodePrepareResources %s refused: %s", ref.who(), e.message)
                return e

    async def _prepare(self, ref: ClaimRef) -> PrepareResult:
        alloc = self.ledger.by_claim(ref.uid)
        if alloc is not None:
            # Prepared already (the kubelet restarted, or retries): the same answer, its files as
            # they must be (written again if they went missing).
            return await self._answer(alloc, self._devices_of(alloc))
        t0 = time.perf_counter()
        try:
            raw = await self.source.get(ref.namespace, ref.name)
        except Exception as e:
            raise AllocationError(ErrorKind.NODE_FAILURE, f"{ref.who()}: cannot read it: {e}") from None
        read = time.perf_counter() - t0
        if raw is None:
            raise AllocationError(ErrorKind.STATE_CONFLICT, f"{ref.who()}: not found in the apiserver")
        allocation = claims_mod.allocation(raw, ref, driver=self.driver, pool=self.pool)
        resource, ids = self._slices(allocation)
        alloc = self.ledger.reserve(resource, ids, claim=ref)
        self.policies.prepared(alloc, allocation)  # its limit and policy, before anything runs
        # Admission's reclaim of its request begins now: its NVML reading, in a worker thread,
        # runs while the loop writes the claim's files (should they fail, the reclaim runs out
        # for nothing: bursts are lent, never owed).
        self.admission.start(alloc)
        try:
            handle = await self.dirs.create(alloc.directory, alloc.config)
            self.ledger.attach(alloc.key, handle)
            # Its record, before the answer: after the agent's restart the kubelet sends nothing
            # again, so the booking must be on file (the state file follows within its batch).
            self.records.write(alloc)
        except OSError as e:
            await self._release(alloc, "its directory could not be written")
            raise AllocationError(
                ErrorKind.NODE_FAILURE, f"{ref.who()}: cannot write its directory {alloc.directory}: {e}"
            ) from e
        # Side by side, both before the answer: its CDI spec, and admission's reclaim of its request.
        devices: dict[str, set[str]] = {}
        for s in allocation.shares:
            devices.setdefault(s.device, set()).add(s.request)
        answer, _ = await asyncio.gather(
            self._answer(alloc, devices),
            self.admission.prestart(alloc),  # never refuses: at worst a warning
            return_exceptions=True,
        )
        if isinstance(answer, BaseException):
            await self._release(alloc, "its CDI spec could not be written")
            raise AllocationError(
                ErrorKind.NODE_FAILURE, f"{ref.who()}: cannot write its CDI spec: {answer}"
            ) from answer
        self.prepared += 1
        self.times.append((read, time.perf_counter() - t0))
        decision(
            log,
            "prepare",
            "prepared %s (uid %s): %s x%d on %s (%s per GPU)",
            ref.who(),
            ref.uid,
            resource,
            alloc.slice_count,
            ",".join(alloc.gpus),
            format_bytes(alloc.request_bytes),
            container=alloc.key,
            claim=f"{ref.namespace}/{ref.name}",
            claim_uid=ref.uid,
            resource=resource,
            gpus=",".join(alloc.gpus),
            request_bytes=alloc.request_bytes,
        )
        return answer

    async def _answer(self, alloc: ContainerAlloc, devices: Mapping[str, set[str]]) -> list[PreparedDevice]:
        """The claim's CDI spec written (again), and each device with the requests it serves."""
        ids = tuple(await self.specs.write(claim_device(alloc)))
        return [PreparedDevice(tuple(sorted(reqs)), self.pool, dev, ids) for dev, reqs in devices.items()]

    def _devices_of(self, alloc: ContainerAlloc) -> dict[str, set[str]]:
        """The devices of a claim booked before, each for every request of the claim (no
        request names: the booking does not keep them, and none means all)."""
        return {self.device_of.get(u, u): set() for u in alloc.gpus}

    def _slices(self, allocation: ClaimAllocation) -> tuple[str, list[str]]:
        """The slices a claim's shares book: a share of one GPU in gpu-memory slices, whole GPUs
        in gpu-fraction slices. AllocationError for what the agent cannot hold (shares of
        several GPUs; a device not of this node)."""
        ref = allocation.ref
        per_gpu: dict[str, list[Share]] = {}
        for s in allocation.shares:
            uuid = self.gpu_of.get(s.device)
            if uuid is None or uuid not in self.ledger.geometry:
                raise AllocationError(
                    ErrorKind.INVALID_REQUEST, f"{ref.who()}: device {s.device} is not a GPU of this node"
                )
            per_gpu.setdefault(uuid, []).append(s)
        whole: dict[str, bool] = {}
        amount: dict[str, int] = {}
        for uuid, shares in per_gpu.items():
            geo = self.ledger.geometry[uuid]
            most = geo.memory_slices * geo.memory_unit  # the requestPolicy default: the whole GPU
            if any(s.consumed is None for s in shares):
                whole[uuid] = True
                continue
            total = sum(s.consumed or 0 for s in shares)
            whole[uuid] = total >= most
            amount[uuid] = total
        if len(per_gpu) > 1 and not all(whole.values()):
            raise AllocationError(
                ErrorKind.INVALID_REQUEST,
                f"{ref.who()}: shares of {len(per_gpu)} GPUs ({', '.join(sorted(per_gpu))}); a claim holds "
                "a share of one GPU, or whole GPUs",
            )
        if all(whole.values()):
            return FRACTION, [device_id(u, FRACTION, n) for u in per_gpu for n in range(FRACTION_SLICES)]
        (uuid,) = per_gpu
        geo = self.ledger.geometry[uuid]
        count = -(-amount[uuid] // geo.memory_unit)  # whole memory units, rounded up
        if count * geo.memory_unit != amount[uuid]:
            log.warning(
                "%s consumes %d bytes of GPU %s, not a whole number of memory units (%s): booked %d units",
                ref.who(),
                amount[uuid],
                uuid,
                format_bytes(geo.memory_unit),
                count,
            )
        booked = self.ledger.booked()
        free = [d for n in range(geo.memory_slices) if (d := device_id(uuid, MEMORY, n)) not in booked]
        if count <= 0 or len(free) < count:
            raise AllocationError(
                ErrorKind.STATE_CONFLICT,
                f"{ref.who()}: GPU {uuid} has {len(free)} memory units free, the claim consumes {count}",
            )
        return MEMORY, free[:count]

    # -- unprepare -------------------------------------------------------------------------

    async def unprepare(self, refs: Sequence[ClaimRef]) -> dict[str, AllocationError | None]:
        """Release each claim's booking; a claim not booked (never prepared, or unprepared
        already) succeeds. None: released (or nothing to release)."""
        out: dict[str, AllocationError | None] = {}
        released = False
        for ref in refs:
            async with self._lock(ref.uid):
                alloc = self.ledger.by_claim(ref.uid)
                if alloc is None:
                    log.info(
                        "NodeUnprepareResources %s (uid %s): not prepared here, nothing to do",
                        ref.who(),
                        ref.uid,
                    )
                else:
                    await self._release(alloc, "NodeUnprepareResources")
                    released = True
                out[ref.uid] = None
        if released:
            try:
                await self.durable.flush()
            except OSError as e:  # released in memory: the next save (or the claim check) follows
                log.error("cannot save the agent's state after unprepare: %s", e)
        return out

    async def _release(self, alloc: ContainerAlloc, why: str) -> None:
        assert alloc.claim is not None
        await self.specs.remove(alloc.claim.uid)
        if self.ledger.release(alloc.key) is None:
            return
        self.policies.released(alloc)
        self.metrics.forget(alloc.key)
        decision(
            log,
            "release",
            "released %s (uid %s): %s",
            alloc.who(),
            alloc.claim.uid,
            why,
            container=alloc.key,
            claim=f"{alloc.claim.namespace}/{alloc.claim.name}",
            claim_uid=alloc.claim.uid,
            gpus=",".join(alloc.gpus),
            request_bytes=alloc.request_bytes,
        )

    def _lock(self, uid: str) -> asyncio.Lock:
        lock = self._locks.get(uid)
        if lock is None:
            lock = self._locks[uid] = asyncio.Lock()
        if len(self._locks) > 4096:  # drop the locks nobody holds
            self._locks = {u: lk for u, lk in self._locks.items() if lk.locked() or u == uid}
        return lock

    def log_summary(self) -> None:
        """One line: how long preparing a claim took, and how much of it was reading the claim
        from the apiserver (the agent stops)."""
        if not self.times:
            return

        def ms(values: list[float], q: float) -> float:
            values = sorted(values)
            return round(values[min(len(values) - 1, round(q * (len(values) - 1)))] * 1000, 3)

        total = [t for _, t in self.times]
        read = [r for r, _ in self.times]
        own = [t - r for r, t in self.times]
        fields = {
            "claims_prepared": len(total),
            "claim_prepare_p50_ms": ms(total, 0.5),
            "claim_prepare_p99_ms": ms(total, 0.99),
            "claim_read_p50_ms": ms(read, 0.5),
            "claim_read_p99_ms": ms(read, 0.99),
            "claim_own_p50_ms": ms(own, 0.5),
            "claim_own_p99_ms": ms(own, 0.99),
        }
        log.info(
            "claims: %d prepared in p50 %.3f ms, p99 %.3f ms; reading a claim p50 %.3f ms, p99 %.3f ms",
            len(total),
            fields["claim_prepare_p50_ms"],
            fields["claim_prepare_p99_ms"],
            fields["claim_read_p50_ms"],
            fields["claim_read_p99_ms"],
            extra={logs.FIELDS: fields},
        )

    def health(self) -> list[DeviceHealth]:
        """Every published device's health (the ledger's view of its GPU)."""
        bad = self.ledger.unhealthy()
        return [DeviceHealth(self.pool, d, u not in bad, bad.get(u, "")) for d, u in self.gpu_of.items()]

    # -- recovery and the claim check --------------------------------------------------------

    async def recover(self) -> None:
        """After the ledger was restored: every booked claim's CDI spec as it must be, and the
        specs of claims no longer booked removed."""
        await self.specs.sync([claim_device(a) for a in self.ledger.containers() if a.claim is not None])

    async def check(self) -> int:
        """Release bookings whose claim the apiserver no longer has, has under another UID, or
        no longer allocates to this node (its pods are gone); how many. A claim that cannot be
        read is left alone. A booking restored from the state file gets its policy from its
        parameters again (the reaper judges it from then on)."""
        released = 0
        for alloc in [a for a in self.ledger.containers() if a.claim is not None]:
            ref = alloc.claim
            assert ref is not None
            try:
                raw = await self.source.get(ref.namespace, ref.name)
            except Exception as e:
                log.debug("claim check of %s: %s", ref.who(), e)
                return released  # the apiserver is away: try again next time
            uid = ((raw or {}).get("metadata") or {}).get("uid")
            why = "the claim is gone from the apiserver" if raw is None else f"the claim now has uid {uid}"
            if raw is not None and uid == ref.uid:
                try:
                    allocation = claims_mod.allocation(raw, ref, driver=self.driver, pool=self.pool)
                except AllocationError as e:
                    if e.kind != ErrorKind.STATE_CONFLICT:
                        log.warning("claim check: %s", e.message)
                        continue
                    # Deallocated (its pods are gone) or allocated elsewhere since.
                    why = "the claim holds nothing of this node any more"
                else:
                    if not self.policies.known(alloc.key) and self.ledger.by_claim(ref.uid) is alloc:
                        self.policies.prepared(alloc, allocation)
                    continue
            async with self._lock(ref.uid):
                if self.ledger.by_claim(ref.uid) is alloc:
                    await self._release(alloc, f"{why} (no unprepare came)")
                    released += 1
        if released:
            try:
                await self.durable.flush()
            except OSError as e:
                log.error("cannot save the agent's state after the claim check: %s", e)
        return released

    async def run_checks(self, interval: float) -> None:
        """check() now (policies of restored bookings) and then every `interval` seconds."""
        while True:
            try:
                await self.check()
            except Exception:
                log.exception("claim check failed")
            await asyncio.sleep(interval)
