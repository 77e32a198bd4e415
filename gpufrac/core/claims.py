"""ResourceClaims as the DRA driver reads them: who a claim is, what the scheduler gave it.

The kubelet's NodePrepareResources names a claim (namespace, name, uid) and nothing else: the
devices and the capacity each consumes are in the claim's status.allocation, which the driver
reads from the apiserver (gpufrac.agent.kube.claims) and parses here. Pure functions over the
claim as JSON (a dict): no Kubernetes client, no I/O. A claim that cannot be read as one of
ours raises AllocationError naming the field and why.

What the scheduler records per device it allocated (resource.k8s.io/v1,
status.allocation.devices.results[]): driver, pool, device, the request it serves, and with
consumable capacity (KEP-5075) consumedCapacity (the amount after the device's requestPolicy
rounded it) and a shareID. A result without consumedCapacity took the whole device: the device
was allocated exclusively (a scheduler without DRAConsumableCapacity, or a request that named
no amount on a capacity whose requestPolicy default is the whole).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpufrac.core.errors import AllocationError, ErrorKind
from gpufrac.core.quote import shown
from gpufrac.core.units import parse_bytes

# The capacity name the driver publishes GPU memory under (ResourceSlice devices[].capacity).
MEMORY_CAPACITY = "memory"


@dataclass(frozen=True)
class ClaimRef:
    """A ResourceClaim as the kubelet names it."""

    namespace: str
    name: str
    uid: str

    def who(self) -> str:
        return f"claim {self.namespace}/{self.name}"


def claim_key(uid: str) -> str:
    """The ledger key of a claim's booking: stable across restarts, one per claim UID."""
    return "c-" + hashlib.sha256(uid.encode()).hexdigest()[:20]


@dataclass(frozen=True)
class Share:
    """One device result of a claim for this driver and pool."""

    request: str
    device: str
    consumed: int | None  # bytes of memory consumedCapacity; None: the whole device
    share_id: str = ""


@dataclass(frozen=True)
class ClaimAllocation:
    """What the claim holds of this driver's pool, and the consumers it is reserved for."""

    ref: ClaimRef
    shares: tuple[Share, ...]
    # status.reservedFor: the pods (by UID) the claim may be used by now.
    reserved_for: tuple[str, ...] = ()
    # status.allocation.devices.config[] opaque parameters for this driver that apply to the
    # requests of `shares`, in the order they apply (a class's first, then the claim's).
    parameters: tuple[Mapping[str, Any], ...] = ()


def _refused(kind: ErrorKind, ref: ClaimRef, text: str) -> AllocationError:
    return AllocationError(kind, f"{ref.who()}: {text}")


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _seq(value: Any) -> Sequence[Any]:
    return value if isinstance(value, list) else []


def allocation(claim: Mapping[str, Any], ref: ClaimRef, *, driver: str, pool: str) -> ClaimAllocation:
    """The shares of `driver`'s `pool` (this node) the claim was allocated, read from its
    status. Raises AllocationError: STATE_CONFLICT when the claim is not the one the kubelet
    named (another UID) or holds nothing of ours; INVALID_REQUEST when a result cannot be read."""
    meta = _mapping(claim.get("metadata"))
    uid = meta.get("uid")
    if uid != ref.uid:
        raise _refused(
            ErrorKind.STATE_CONFLICT,
            ref,
            f"the apiserver's claim of that name has uid {shown(str(uid))}, the kubelet asked for "
            f"{shown(ref.uid)} (deleted and created again?)",
        )
    status = _mapping(claim.get("status"))
    alloc = status.get("allocation")
    if not isinstance(alloc, Mapping):
        raise _refused(
            ErrorKind.STATE_CONFLICT, ref, "status.allocation is missing: the claim is not allocated"
        )
    devices = _mapping(alloc.get("devices"))
    shares: list[Share] = []
    for i, raw in enumerate(_seq(devices.get("results"))):
        r = _mapping(raw)
        if r.get("driver") != driver or r.get("pool") != pool:
            continue
        where = f"status.allocation.devices.results[{i}]"
        device, request = r.get("device"), r.get("request")
        if not isinstance(device, str) or not device or not isinstance(request, str):
            raise _refused(ErrorKind.INVALID_REQUEST, ref, f"{where}: no device or request name")
        consumed = _consumed(ref, where, r.get("consumedCapacity"))
        share_id = r.get("shareID")
        shares.append(Share(request, device, consumed, share_id if isinstance(share_id, str) else ""))
    if not shares:
        raise _refused(
            ErrorKind.STATE_CONFLICT,
            ref,
            f"status.allocation holds no device of driver {driver} in pool {pool} (this node)",
        )
    # A request of a prioritized list is "<request>/<subrequest>"; config may name either.
    requests = {s.request for s in shares} | {s.request.split("/")[0] for s in shares}
    return ClaimAllocation(
        ref,
        tuple(shares),
        reserved_for=tuple(
            str(c.get("uid"))
            for c in map(_mapping, _seq(status.get("reservedFor")))
            if c.get("resource") == "pods" and c.get("uid")
        ),
        parameters=_parameters(devices, driver, requests),
    )


def _consumed(ref: ClaimRef, where: str, consumed: Any) -> int | None:
    if consumed is None:
        return None
    if not isinstance(consumed, Mapping):
        raise _refused(ErrorKind.INVALID_REQUEST, ref, f"{where}.consumedCapacity is not a mapping")
    if MEMORY_CAPACITY not in consumed:
        return None  # consumes other capacities only: the device's memory is not shared out
    value = consumed[MEMORY_CAPACITY]
    try:
        return parse_bytes(value)
    except ValueError as e:
        raise _refused(
            ErrorKind.INVALID_REQUEST, ref, f"{where}.consumedCapacity.{MEMORY_CAPACITY}: {e}"
        ) from None


def _parameters(devices: Mapping[str, Any], driver: str, requests: set[str]) -> tuple[Mapping[str, Any], ...]:
    """This driver's opaque parameters that apply to `requests`, in order: the scheduler
    copies the DeviceClass's config (source FromClass) ahead of the claim's (FromClaim), and
    a later one overrides an earlier one field by field. An entry naming requests applies
    to those only."""
    out: list[tuple[int, Mapping[str, Any]]] = []
    for cfg in map(_mapping, _seq(devices.get("config"))):
        opaque = _mapping(cfg.get("opaque"))
        if opaque.get("driver") != driver:
            continue
        named = cfg.get("requests")
        if isinstance(named, list) and named and not requests & {str(n) for n in named}:
            continue
        rank = 0 if cfg.get("source") == "FromClass" else 1
        out.append((rank, _mapping(opaque.get("parameters"))))
    return tuple(p for _, p in sorted(out, key=lambda t: t[0]))
