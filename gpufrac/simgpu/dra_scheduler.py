"""The scheduler's side of DRA, for tests and the demo: claims allocated against published slices.

What kube-scheduler's DRA plugin does to a ResourceClaim, with consumable capacity
(KEP-5075, resource.k8s.io/v1), played against the ResourceSlices in the apiserver:

* a request (spec.devices.requests[].exactly: deviceClassName, count, capacity.requests,
  tolerations) is matched against the devices of the class's driver, in slice order (the
  scheduler picks the first device that fits; nodes are what it scores);
* a device with allowMultipleAllocations is shared: each allocation consumes the request
  rounded UP to the capacity's requestPolicy (validRange min/step/max, or the next of
  validValues), or the policy's default when the request names no amount, or the whole
  value when there is no policy; a request above the policy's max does not fit; the sum of
  what is consumed never passes the capacity's value; each allocation gets a shareID, and the
  result records consumedCapacity;
* a device without allowMultipleAllocations is allocated to one claim at a time;
* a device tainted NoSchedule or NoExecute is skipped unless the request tolerates the taint;
* the result carries the class's config (FromClass) then the claim's (FromClaim), the node
  selector of the node, and status.reservedFor names the pod.

DeviceClass selectors: only `device.driver == "<name>"` is understood (the classes gpufrac
ships use nothing else); another expression raises NotImplementedError rather than being
ignored. Quantities are read with gpufrac.core.units.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from gpufrac.core.units import parse_bytes

_DRIVER_SELECTOR = re.compile(r"""^\s*device\.driver\s*==\s*["']([^"']+)["']\s*$""")


class AllocationFailed(Exception):
    """No device fits a request: the pod stays Pending (the scheduler says why)."""


def quantity(n: int) -> str:
    """Bytes as the apiserver writes a canonical quantity (8Gi, 512Mi, or plain bytes)."""
    for suffix, scale in (("Ti", 1 << 40), ("Gi", 1 << 30), ("Mi", 1 << 20), ("Ki", 1 << 10)):
        if n and n % scale == 0:
            return f"{n // scale}{suffix}"
    return str(n)


def consumed(capacity: Mapping[str, Any], requested: int | None) -> int | None:
    """What one allocation consumes of a shared device's capacity for a request of `requested`
    bytes (None: the request names no amount); None when it cannot be had from this device."""
    value = parse_bytes(capacity["value"])
    policy = capacity.get("requestPolicy")
    if not policy:
        return value if requested is None else requested
    if requested is None:
        return parse_bytes(policy["default"]) if policy.get("default") is not None else value
    values = policy.get("validValues")
    if values:
        fits = [v for v in sorted(parse_bytes(x) for x in values) if v >= requested]
        return fits[0] if fits else None
    rng = policy.get("validRange")
    if rng:
        low = parse_bytes(rng["min"])
        step = parse_bytes(rng["step"]) if rng.get("step") else None
        high = parse_bytes(rng["max"]) if rng.get("max") else None
        amount = max(requested, low)
        if step:
            amount = low + -(-(amount - low) // step) * step  # rounded up to min + k * step
        if high is not None and amount > high:
            return None
        return amount
    return requested


@dataclass
class _Device:
    driver: str
    pool: str
    name: str
    node: str
    raw: dict[str, Any]

    @property
    def shared(self) -> bool:
        return bool(self.raw.get("allowMultipleAllocations"))


class Allocator:
    """Allocates ResourceClaims the way the scheduler does (see the module docstring)."""

    def __init__(self, api: client.ApiClient) -> None:
        self.api = client.ResourceV1Api(api)

    def _json(self, resp: Any) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(resp.data)
        return data

    def _devices(self, node: str | None) -> list[_Device]:
        slices = self._json(self.api.list_resource_slice(_preload_content=False))["items"]
        out = []
        for s in sorted(slices, key=lambda s: s["metadata"]["name"]):
            spec = s.get("spec") or {}
            if node is not None and spec.get("nodeName") != node:
                continue
            for d in spec.get("devices") or []:
                out.append(
                    _Device(spec["driver"], spec["pool"]["name"], d["name"], spec.get("nodeName", ""), d)
                )
        return out

    def _usage(self) -> tuple[dict[tuple[str, str, str], int], set[tuple[str, str, str]]]:
        """Memory consumed per shared device, and the devices held whole, by every allocated claim."""
        used: dict[tuple[str, str, str], int] = {}
        whole: set[tuple[str, str, str]] = set()
        claims = self._json(self.api.list_resource_claim_for_all_namespaces(_preload_content=False))["items"]
        for c in claims:
            results = (((c.get("status") or {}).get("allocation") or {}).get("devices") or {}).get(
                "results"
            ) or []
            for r in results:
                key = (r["driver"], r["pool"], r["device"])
                cap = r.get("consumedCapacity")
                if cap is None:
                    whole.add(key)
                else:
                    used[key] = used.get(key, 0) + sum(parse_bytes(v) for v in cap.values())
        return used, whole

    def _class_driver(self, class_name: str) -> tuple[str, list[dict[str, Any]]]:
        dc = self._json(self.api.read_device_class(class_name, _preload_content=False))
        spec = dc.get("spec") or {}
        drivers = []
        for sel in spec.get("selectors") or []:
            expr = (sel.get("cel") or {}).get("expression", "")
            for part in expr.split("&&"):
                m = _DRIVER_SELECTOR.match(part)
                if m is None:
                    raise NotImplementedError(
                        f"DeviceClass {class_name}: selector {part.strip()!r} is not emulated"
                    )
                drivers.append(m.group(1))
        if len(set(drivers)) != 1:
            raise NotImplementedError(f"DeviceClass {class_name}: needs exactly one device.driver selector")
        return drivers[0], list(spec.get("config") or [])

    @staticmethod
    def _tolerated(taint: Mapping[str, Any], tolerations: Sequence[Mapping[str, Any]]) -> bool:
        for t in tolerations:
            if t.get("effect") and t["effect"] != taint.get("effect"):
                continue
            if t.get("operator") == "Exists" and (not t.get("key") or t["key"] == taint.get("key")):
                return True
            if t.get("key") == taint.get("key") and t.get("value", "") == taint.get("value", ""):
                return True
        return False

    def allocate(
        self, namespace: str, name: str, *, node: str | None, pod: tuple[str, str] | None = None
    ) -> dict[str, Any]:
        """Allocate the claim on `node` (None: any) and reserve it for `pod` (name, uid);
        returns its status. AllocationFailed when a request fits no device."""
        claim = self._json(self.api.read_namespaced_resource_claim(name, namespace, _preload_content=False))
        used, whole = self._usage()
        devices = self._devices(node)
        results: list[dict[str, Any]] = []
        configs: list[dict[str, Any]] = []
        spec = claim.get("spec") or {}
        picked_nodes: set[str] = set()
        for req in (spec.get("devices") or {}).get("requests") or []:
            exact = req.get("exactly") or {}
            driver, class_config = self._class_driver(exact["deviceClassName"])
            for c in class_config:
                configs.append({**c, "source": "FromClass", "requests": [req["name"]]})
            mode = exact.get("allocationMode", "ExactCount")
            if mode != "ExactCount":
                raise NotImplementedError(f"allocationMode {mode} is not emulated")
            wanted = (exact.get("capacity") or {}).get("requests") or {}
            amounts = {k: parse_bytes(v) for k, v in wanted.items()}
            tolerations = exact.get("tolerations") or []
            for _ in range(int(exact.get("count", 1))):
                results.append(
                    self._pick(req["name"], driver, devices, amounts, tolerations, used, whole, picked_nodes)
                )
        for c in (spec.get("devices") or {}).get("config") or []:
            configs.append({**c, "source": "FromClaim"})
        allocation: dict[str, Any] = {"devices": {"results": results, "config": configs}}
        if len(picked_nodes) == 1:
            (n,) = picked_nodes
            allocation["nodeSelector"] = {
                "nodeSelectorTerms": [
                    {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [n]}]}
                ]
            }
        status: dict[str, Any] = {"allocation": allocation}
        if pod is not None:
            status["reservedFor"] = [{"resource": "pods", "name": pod[0], "uid": pod[1]}]
        self.api.patch_namespaced_resource_claim_status(
            name,
            namespace,
            {"status": status},
            _content_type="application/merge-patch+json",
            _preload_content=False,
        )
        return status

    def _pick(
        self,
        request: str,
        driver: str,
        devices: Sequence[_Device],
        amounts: Mapping[str, int],
        tolerations: Sequence[Mapping[str, Any]],
        used: dict[tuple[str, str, str], int],
        whole: set[tuple[str, str, str]],
        nodes: set[str],
    ) -> dict[str, Any]:
        why = []
        for d in devices:
            if d.driver != driver:
                continue
            key = (d.driver, d.pool, d.name)
            taints = [t for t in d.raw.get("taints") or [] if t.get("effect") in ("NoSchedule", "NoExecute")]
            if any(not self._tolerated(t, tolerations) for t in taints):
                why.append(f"{d.name}: tainted")
                continue
            if key in whole:
                why.append(f"{d.name}: allocated whole")
                continue
            if not d.shared:
                if used.get(key):
                    why.append(f"{d.name}: shared out")
                    continue
                whole.add(key)
                nodes.add(d.node)
                return {"request": request, "driver": d.driver, "pool": d.pool, "device": d.name}
            caps = d.raw.get("capacity") or {}
            take: dict[str, int] = {}
            for cap_name, cap in caps.items():
                amount = consumed(cap, amounts.get(cap_name))
                if amount is None or used.get(key, 0) + amount > parse_bytes(cap["value"]):
                    take = {}
                    why.append(f"{d.name}: {cap_name} does not fit")
                    break
                take[cap_name] = amount
            if not take:
                continue
            used[key] = used.get(key, 0) + sum(take.values())
            nodes.add(d.node)
            return {
                "request": request,
                "driver": d.driver,
                "pool": d.pool,
                "device": d.name,
                "consumedCapacity": {k: quantity(v) for k, v in take.items()},
                "shareID": str(uuid.uuid4()),
            }
        raise AllocationFailed(
            f"request {request}: no {driver} device fits ({'; '.join(why) or 'no devices'})"
        )

    def reserve(self, namespace: str, name: str, pod: tuple[str, str]) -> None:
        """Add a pod to an allocated claim's reservedFor (a second pod sharing it)."""
        claim = self._json(self.api.read_namespaced_resource_claim(name, namespace, _preload_content=False))
        reserved = list((claim.get("status") or {}).get("reservedFor") or [])
        reserved.append({"resource": "pods", "name": pod[0], "uid": pod[1]})
        self.api.patch_namespaced_resource_claim_status(
            name,
            namespace,
            {"status": {"reservedFor": reserved}},
            _content_type="application/merge-patch+json",
            _preload_content=False,
        )

    def deallocate(self, namespace: str, name: str) -> None:
        """The claim's allocation and reservations cleared (its pods are gone)."""
        try:
            self.api.patch_namespaced_resource_claim_status(
                name,
                namespace,
                {"status": {"allocation": None, "reservedFor": None}},
                _content_type="application/merge-patch+json",
                _preload_content=False,
            )
        except ApiException as e:
            if e.status != 404:
                raise
