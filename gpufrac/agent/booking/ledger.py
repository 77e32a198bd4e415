"""The allocation ledger: which slices belong to which container, the one source of truth.

Every allocation is a *container key* (stable hash of the resource and the sorted
device IDs, because Allocate carries no pod name) owning a set of slices of one
GPU (or whole GPUs), the bytes it guarantees per GPU and a host directory with
the container's memguard config and usage files.

The ledger lives on the agent's event loop (docs/architecture.md) and is never
touched from another thread; it keeps the bookings in memory and writes nothing but the
mapped config of a booked container (gpufrac.agent.booking.container_dirs creates, repairs and
deletes the directories, in its own thread). It refuses double booking, never lets the sum of
requests on a GPU exceed its allocatable memory, and tells listeners about every
change so capacity sync and state persistence follow. Over 500 lines: the bookings, their
checks and their listeners are one piece of state with one owner; split, each part would
reach into the others' dictionaries.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from gpufrac.agent.booking.container_dirs import retire_container_dir, write_container_dir
from gpufrac.core import slices
from gpufrac.core.claims import ClaimRef, claim_key
from gpufrac.core.config import Config
from gpufrac.core.errors import AllocationError, ErrorKind
from gpufrac.core.gpus import Inventory
from gpufrac.core.slices import (
    FRACTION,
    FRACTION_SLICES,
    MEMORY,
    ContainerDevices,
    GpuGeometry,
    container_key,
)
from gpufrac.core.units import format_bytes
from gpufrac.memguard import abi
from gpufrac.memguard.abi import ConfigFile, ContainerConfig

log = logging.getLogger(__name__)

# Fields of ContainerConfig that only the ledger decides (what was booked).
_BOOKED_FIELDS = frozenset({"gpu_uuid", "request_bytes"})


def _invalid(msg: str) -> AllocationError:
    return AllocationError(ErrorKind.INVALID_REQUEST, msg)


def _precondition(msg: str) -> AllocationError:
    return AllocationError(ErrorKind.STATE_CONFLICT, msg)


def _short(ids: Sequence[str], limit: int = 6) -> str:
    shown = ", ".join(ids[:limit])
    return f"[{shown}{', …' if len(ids) > limit else ''}] ({len(ids)} IDs)" if len(ids) > 1 else f"[{shown}]"


def keyed(listed: Iterable[ContainerDevices]) -> dict[str, ContainerDevices]:
    """pod-resources entries (one per container and resource) by container key; entries
    naming devices that are not slices of this node are logged and left out."""
    out: dict[str, ContainerDevices] = {}
    for c in listed:
        try:
            out[container_key(c.resource, c.device_ids)] = c
        except ValueError:
            log.warning("pod-resources lists unknown %s devices for %s/%s", c.resource, c.namespace, c.pod)
    return out


@dataclass
class ContainerAlloc:
    """One container's booking (one resource; the kubelet allocates per resource)."""

    key: str
    resource: str
    device_ids: tuple[str, ...]
    gpus: tuple[str, ...]  # GPU UUIDs, in inventory order
    request_bytes: int  # guaranteed bytes on each of its GPUs
    directory: str  # host directory: config, usage
    whole_gpu: bool
    config: ContainerConfig
    created: float = field(default_factory=time.time)
    # time.monotonic() when the kubelet was first seen to hold it (pod-resources listed it, or
    # PreStartContainer came for it); None before. From then on, a pod-resources List asked
    # later that lacks it means the container is gone: no grace needed.
    recorded_at: float | None = None
    # Pod identity; None until pod-resources / the apiserver tell us.
    namespace: str | None = None
    pod: str | None = None
    container: str | None = None
    pod_uid: str | None = None
    # A DRA ResourceClaim's booking (gpufrac.agent.booking.claims): released by the kubelet's
    # NodeUnprepareResources, never by pod-resources; None for a device-plugin container.
    claim: ClaimRef | None = None
    # The kubelet containers (pod UID, container name) a claim's booking serves: every
    # container of every pod that uses the claim is one group for its limits.
    consumers: frozenset[tuple[str, str]] = frozenset()

    @property
    def slice_count(self) -> int:
        return len(self.device_ids)

    def held_by(self, pod_uid: str, container: str) -> bool:
        """Whether the container (pod UID, name) is this booking's: the one a device-plugin
        allocation was made for, or a consumer of a claim."""
        if self.claim is not None:
            return (pod_uid, container) in self.consumers
        return self.pod_uid == pod_uid and self.container == container

    @property
    def tied(self) -> bool:
        """Whether the containers this booking serves are known: a device-plugin booking's pod
        and container, a claim's consumers (a claim is never bound to one container name). Until
        then a process on its GPU that no booking claims may be this one's."""
        if self.claim is not None:
            return bool(self.consumers)
        return bool(self.pod_uid and self.container)

    def who(self) -> str:
        if self.claim is not None:
            return self.claim.who()
        if self.pod:
            return f"pod {self.namespace}/{self.pod} container {self.container}"
        return f"container {self.key}"


class Ledger:
    def __init__(
        self,
        config: Config,
        inventory: Inventory,
        retire: Callable[[str, ConfigFile | None], None] = retire_container_dir,
    ) -> None:
        """`retire`: how release() lets go of a container's config mapping and directory; the
        agent passes ContainerDirs.discard, which queues that behind the directory writes in its
        I/O thread instead of blocking the loop (unmap and delete: ~0.15 ms a container)."""
        self.config = config
        self.inventory = inventory
        self.geometry: dict[str, GpuGeometry] = slices.geometry(config, inventory)
        self._allocs: dict[str, ContainerAlloc] = {}
        self._owner: dict[str, str] = {}  # device ID -> container key
        self._claims: dict[str, str] = {}  # claim UID -> container key
        # Device ID -> when it was last released (a count of releases: higher is later).
        self._released: dict[str, int] = {}
        self._releases = 0
        self._requested: dict[str, int] = dict.fromkeys(self.geometry, 0)
        self._unhealthy: dict[str, str] = {}  # GPU UUID -> reason
        self._files: dict[str, ConfigFile] = {}
        self._listeners: list[Callable[[], None]] = []
        self._attach_listeners: list[Callable[[ContainerAlloc], None]] = []
        # Bumped by every change that can alter what ListAndWatch reports (bookings, health),
        # not by config-only changes (identity, limits, grants): listeners tell them apart.
        self.capacity_generation = 0
        self._gpu_generation: dict[str, int] = dict.fromkeys(self.geometry, 0)  # the same, per GPU
        # Bumped by every change the state file records; not by a grant alone (every burst):
        # grants live in the config files, and recovery reads them there (published_grants).
        self.state_generation = 0
        self._retire = retire
        # Device ID strings per (GPU, resource), built once: capacity sync lists them after every change.
        self._ids: dict[tuple[str, str], list[str]] = {
            (g.uuid, r): [slices.device_id(g.uuid, r, n) for n in range(g.slices(r))]
            for g in self.geometry.values()
            for r in slices.RESOURCES
        }

    # -- observation -----------------------------------------------------------------

    def add_attach_listener(self, callback: Callable[[ContainerAlloc], None]) -> None:
        """Called (on the loop) when a booked container's directory is written (attach())."""
        self._attach_listeners.append(callback)

    def add_listener(self, callback: Callable[[], None]) -> None:
        """Called (on the loop) after every allocation, release, config or health change."""
        self._listeners.append(callback)

    def _changed(self, *, stateful: bool = True) -> None:
        if stateful:
            self.state_generation += 1
        for cb in self._listeners:
            cb()

    def containers(self) -> list[ContainerAlloc]:
        return list(self._allocs.values())

    def get(self, key: str) -> ContainerAlloc | None:
        return self._allocs.get(key)

    def find(self, resource: str, device_ids: Iterable[str]) -> ContainerAlloc | None:
        try:
            return self._allocs.get(container_key(resource, device_ids))
        except ValueError:
            return None

    def owner(self, device_id: str) -> ContainerAlloc | None:
        key = self._owner.get(device_id)
        return self._allocs[key] if key else None

    def by_claim(self, uid: str) -> ContainerAlloc | None:
        """The booking of a ResourceClaim, by its UID."""
        key = self._claims.get(uid)
        return self._allocs[key] if key else None

    def booked(self) -> Container[str]:
        """Every device ID some container holds (a live view)."""
        return self._owner.keys()

    def attached(self, key: str) -> bool:
        """Whether the booking's directory has been written (attach()): until then its path
        may still hold the files of a released container of the same key."""
        return key in self._files

    def released(self) -> Mapping[str, int]:
        """When each device ID was last released, as a count of releases (a live view)."""
        return self._released

    def requested(self, gpu_uuid: str) -> int:
        return self._requested[gpu_uuid]

    def unrequested(self, gpu_uuid: str) -> int:
        return self.geometry[gpu_uuid].allocatable - self._requested[gpu_uuid]

    def healthy(self, gpu_uuid: str) -> bool:
        return gpu_uuid not in self._unhealthy

    def unhealthy(self) -> Mapping[str, str]:
        """GPU UUID -> why it is unhealthy, for every unhealthy GPU (a live view)."""
        return self._unhealthy

    def set_compute_pace(self, key: str, pace_ns: int) -> None:
        """The container's launch pace (its compute share: gpufrac.agent.compute), written in its
        config at once; not a config change (no generation, no listener). Nothing before the
        container's directory is attached."""
        handle = self._files.get(key)
        if handle is not None:
            handle.set_pace(pace_ns)

    def compute_pace(self, key: str) -> int:
        """The launch pace in the container's config now (0: none, or no config attached)."""
        handle = self._files.get(key)
        return handle.pace() if handle is not None else 0

    def container_dir(self, key: str) -> str:
        return os.path.join(self.config.paths.containers_dir, key)

    # -- capacity sync ---------------------------------------------------------------

    def devices(self, resource: str) -> list[tuple[str, bool, int | None]]:
        """The full device list for ListAndWatch: (ID, healthy, NUMA node).

        Per GPU: allocated slices stay Healthy (the kubelet subtracts its own
        allocations; Unhealthy would count them twice), plus as many unallocated
        slices, lowest numbers first, as still fit in the GPU's unrequested memory;
        the rest are Unhealthy. A GPU the health monitor marks bad is all Unhealthy."""
        return [d for geo in self.geometry.values() for d in self._gpu_devices(geo, resource)]

    def device_sections(
        self, resource: str
    ) -> list[tuple[tuple[str, int], Callable[[], list[tuple[str, bool, int | None]]]]]:
        """devices() per GPU: (key, build) where the key changes whenever that GPU's part of
        the list may have (its bookings, requests or health), so capacity sync rebuilds
        only the GPUs a change touched."""
        return [
            ((geo.uuid, self._gpu_generation[geo.uuid]), functools.partial(self._gpu_devices, geo, resource))
            for geo in self.geometry.values()
        ]

    def _gpu_devices(self, geo: GpuGeometry, resource: str) -> list[tuple[str, bool, int | None]]:
        out: list[tuple[str, bool, int | None]] = []
        gpu_ok = self.healthy(geo.uuid)
        room = geo.slices_fitting(resource, self.unrequested(geo.uuid))
        for dev in self._ids[(geo.uuid, resource)]:
            if dev in self._owner:
                ok = True
            elif room > 0:
                ok, room = True, room - 1
            else:
                ok = False
            out.append((dev, ok and gpu_ok, geo.numa_node))
        return out

    def _bump(self, *gpu_uuids: str) -> None:
        self.capacity_generation += 1
        for u in gpu_uuids:
            self._gpu_generation[u] += 1

    def set_health(self, gpu_uuid: str, healthy: bool, reason: str = "") -> bool:
        """Record a GPU's health; True (and listeners told) when it changed."""
        if gpu_uuid not in self.geometry or healthy == self.healthy(gpu_uuid):
            return False
        if healthy:
            del self._unhealthy[gpu_uuid]
        else:
            self._unhealthy[gpu_uuid] = reason or "unhealthy"
        self._bump(gpu_uuid)
        self._changed()
        return True

    # -- booking ---------------------------------------------------------------------

    def check(
        self, resource: str, device_ids: Sequence[str], *, ignore_health: bool = False
    ) -> tuple[tuple[str, ...], int, bool]:
        """Validate a request: returns (GPU UUIDs, request bytes per GPU, whole GPUs).

        Raises AllocationError naming the IDs and the rule broken."""
        name = resource.rsplit("/", 1)[-1]
        if not device_ids:
            raise _invalid(f"{name}: the request names no devices")
        unknown, parsed = [], []
        for dev in device_ids:
            try:
                s = slices.parse(dev)
            except ValueError:
                unknown.append(dev)
                continue
            geo = self.geometry.get(s.gpu_uuid)
            if s.resource != resource or geo is None or s.number >= geo.slices(resource):
                unknown.append(dev)
            else:
                parsed.append(s)
        if unknown:
            raise _invalid(f"unknown device IDs {_short(unknown)}: not {resource} devices of this node")
        if len(set(device_ids)) != len(device_ids):
            dups = sorted({d for d in device_ids if device_ids.count(d) > 1})
            raise _invalid(f"device IDs {_short(dups)} appear more than once in one request")

        per_gpu: dict[str, int] = {}
        for s in parsed:
            per_gpu[s.gpu_uuid] = per_gpu.get(s.gpu_uuid, 0) + 1
        gpus = tuple(u for u in self.geometry if u in per_gpu)  # inventory order
        n = len(device_ids)
        whole = False
        if resource == MEMORY and len(gpus) > 1:
            raise _invalid(
                f"{name} {n}: slices {_short(sorted(device_ids))} span GPUs {', '.join(gpus)}; "
                "a gpu-memory request must come from one GPU"
            )
        if resource == FRACTION:
            if n > FRACTION_SLICES and n % FRACTION_SLICES:
                raise _invalid(
                    f"{name} {n} is neither <= {FRACTION_SLICES} (a share of one GPU) nor a multiple of "
                    f"{FRACTION_SLICES} (whole GPUs)"
                )
            if n <= FRACTION_SLICES and len(gpus) > 1:
                raise _invalid(
                    f"{name} {n}: slices {_short(sorted(device_ids))} span GPUs {', '.join(gpus)}; "
                    f"a fraction of {FRACTION_SLICES} or less must come from one GPU"
                )
            whole = n % FRACTION_SLICES == 0
            partial = [u for u in gpus if per_gpu[u] != FRACTION_SLICES]
            if n > FRACTION_SLICES and partial:
                raise _invalid(
                    f"{name} {n} asks for {n // FRACTION_SLICES} whole GPUs and must take all "
                    f"{FRACTION_SLICES} slices of each; got "
                    + ", ".join(f"{per_gpu[u]} of GPU {u}" for u in partial)
                )

        taken = sorted((d for d in device_ids if d in self._owner), key=slices.sort_key)
        if taken:
            owners = {self._allocs[self._owner[d]].who() for d in taken}
            raise _precondition(
                f"device IDs {_short(taken)} are already allocated to {', '.join(sorted(owners))}"
            )
        if not ignore_health:
            bad = [u for u in gpus if not self.healthy(u)]
            if bad:
                raise _precondition(
                    "; ".join(f"GPU {u} is Unhealthy ({self._unhealthy[u]})" for u in bad)
                    + f": cannot allocate {_short(sorted(device_ids))}"
                )
        count = per_gpu[gpus[0]]
        request = self.geometry[gpus[0]].request_bytes(resource, count)
        for u in gpus:
            if request > self.unrequested(u):
                raise _precondition(
                    f"GPU {u} has {format_bytes(self.unrequested(u))} of "
                    f"{format_bytes(self.geometry[u].allocatable)} unrequested; {name} {n} needs "
                    f"{format_bytes(request)} (the other resource took the rest)"
                )
        return gpus, request, whole

    def reserve(
        self,
        resource: str,
        device_ids: Sequence[str],
        *,
        ignore_health: bool = False,
        config: ContainerConfig | None = None,
        created: float | None = None,
        claim: ClaimRef | None = None,
    ) -> ContainerAlloc:
        """Book slices in memory (no files yet); listeners are told. A claim's booking is
        keyed by its UID (gpufrac.core.claims.claim_key), one booking per claim."""
        if claim is not None and claim.uid in self._claims:
            raise _precondition(f"{claim.who()} (uid {claim.uid}) is already booked")
        gpus, request, whole = self.check(resource, device_ids, ignore_health=ignore_health)
        key = container_key(resource, device_ids) if claim is None else claim_key(claim.uid)
        if config is None:
            flags = abi.FLAG_PREEMPTIBLE | (abi.FLAG_WHOLE_GPU if whole else 0)
            if self.config.swap.default_swappable:
                flags |= abi.FLAG_SWAPPABLE
            # limit = request until the pod is known (safe default).
            config = ContainerConfig(
                gpu_uuid=gpus[0],
                request_bytes=request,
                limit_bytes=request,
                flags=flags,
                arbiter_timeout_ms=int(self.config.arbiter_timeout * 1000),
                wait_timeout_ms=int(self.config.wait_timeout * 1000),
            )
        else:
            config = dataclasses.replace(config, gpu_uuid=gpus[0], request_bytes=request)
        alloc = ContainerAlloc(
            key=key,
            resource=resource,
            device_ids=tuple(sorted(device_ids, key=slices.sort_key)),
            gpus=gpus,
            request_bytes=request,
            directory=self.container_dir(key),
            whole_gpu=whole,
            config=config,
            created=time.time() if created is None else created,
            claim=claim,
        )
        if claim is not None:
            self._claims[claim.uid] = key
        self._allocs[key] = alloc
        for d in device_ids:
            self._owner[d] = key
        for u in gpus:
            self._requested[u] += request
        self._bump(*gpus)
        self._changed()
        return alloc

    def attach(self, key: str, handle: ConfigFile) -> None:
        """Keep the open config file of a booked container (written in a worker thread)."""
        old = self._files.pop(key, None)
        if old is not None:
            old.close()
        alloc = self._allocs.get(key)
        if alloc is not None:
            self._files[key] = handle
            if handle.written != alloc.config:  # changed (identity, a limit) while being written
                handle.write(alloc.config)
            for cb in self._attach_listeners:
                cb(alloc)
        else:  # released while its directory was being written
            handle.close()

    def allocate(self, resource: str, device_ids: Sequence[str]) -> ContainerAlloc:
        """Book and write the directory in one go (synchronous callers, tests)."""
        alloc = self.reserve(resource, device_ids)
        try:
            self.attach(alloc.key, write_container_dir(alloc.directory, alloc.config))
        except OSError:
            self.release(alloc.key)
            raise
        return alloc

    def release(self, key: str) -> ContainerAlloc | None:
        """Free a container's slices and delete its directory (no deallocate RPC exists:
        the agent calls this when pod-resources no longer lists the container)."""
        alloc = self._allocs.pop(key, None)
        if alloc is None:
            return None
        if alloc.claim is not None:
            self._claims.pop(alloc.claim.uid, None)
        self._releases += 1
        for d in alloc.device_ids:
            self._owner.pop(d, None)
            self._released[d] = self._releases
        for u in alloc.gpus:
            self._requested[u] -= alloc.request_bytes
        self._retire(alloc.directory, self._files.pop(key, None))
        self._bump(*alloc.gpus)
        self._changed()
        return alloc

    # -- identity and policy (used by gpufrac.agent.booking.pods) ----------------------------

    def bind(
        self,
        key: str,
        namespace: str | None,
        pod: str | None,
        container: str | None,
        pod_uid: str | None = None,
    ) -> ContainerAlloc:
        """Record which pod/container owns an allocation (and write it to the config)."""
        alloc = self._require(key)
        if (alloc.namespace, alloc.pod, alloc.container, alloc.pod_uid) == (
            namespace,
            pod,
            container,
            pod_uid,
        ):
            return alloc
        alloc.namespace, alloc.pod, alloc.container, alloc.pod_uid = namespace, pod, container, pod_uid
        self._write(
            alloc,
            dataclasses.replace(
                alloc.config,
                namespace=namespace or "",
                pod=pod or "",
                container=container or "",
                pod_uid=pod_uid or "",
            ),
        )
        return alloc

    def set_consumers(self, key: str, consumers: frozenset[tuple[str, str]]) -> None:
        """Record which kubelet containers (pod UID, name) a claim's booking serves."""
        alloc = self._require(key)
        if alloc.consumers != consumers:
            alloc.consumers = consumers
            self._changed()

    def update_config(self, key: str, **fields: object) -> ContainerConfig:
        """Rewrite a container's config with some fields changed (limit, grant, flags, class,
        priority…). What was booked (GPU, request) cannot change here, and ContainerConfig
        clamps the limit to at least the request."""
        alloc = self._require(key)
        booked = _BOOKED_FIELDS & fields.keys()
        if booked:
            raise ValueError(f"update_config({key}): {sorted(booked)} are decided by the booking")
        new = dataclasses.replace(alloc.config, **fields)  # type: ignore[arg-type]
        if new != alloc.config:
            self._write(alloc, new, stateful=fields.keys() != {"grant_bytes"})
        return alloc.config

    def _require(self, key: str) -> ContainerAlloc:
        alloc = self._allocs.get(key)
        if alloc is None:
            raise KeyError(f"no allocation with container key {key!r}")
        return alloc

    def _write(self, alloc: ContainerAlloc, cfg: ContainerConfig, *, stateful: bool = True) -> None:
        alloc.config = cfg
        handle = self._files.get(alloc.key)
        if handle is not None:
            handle.write(cfg)
        self._changed(stateful=stateful)
