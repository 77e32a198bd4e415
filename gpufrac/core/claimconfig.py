"""Claim parameters: the typed, versioned opaque config of a gpufrac ResourceClaim.

A ResourceClaim (or its DeviceClass) carries, for driver gpufrac.dev, what a device-plugin
pod says with annotations (docs/design.md section 1):

    config:
    - opaque:
        driver: gpufrac.dev
        parameters:
          apiVersion: gpufrac.dev/v1alpha1
          kind: GpuClaimParameters
          memoryLimit: 24Gi        # burst ceiling (a quantity); or fractionLimit: 80 (percent)
          workloadClass: inference # batch, interactive, inference
          preemptible: true        # booleans are booleans
          swappable: false
          idleTimeout: 30m         # durations are strings
          maxRuntime: 12h
          idleExempt: false
          waitTimeout: 45s
          computeShare: 25         # percent of its GPU's compute (docs/compute.md)

The scheduler copies the class's config and then the claim's into the allocation; a later
object overrides an earlier one field by field. Each field is read exactly as its annotation
is (gpufrac.core.annotations.parse_policy does both), so a value means the same in either
mode, and a bad one gets the same treatment: the safe default for that setting and a problem
naming the field, the value and why (the agent posts it as one Event on the claim). Pure:
no I/O; nothing here raises on what a claim says.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpufrac.core import annotations as ann
from gpufrac.core.annotations import ContainerPolicy
from gpufrac.core.config import Config
from gpufrac.core.quote import shown

API_VERSION = "gpufrac.dev/v1alpha1"
KIND = "GpuClaimParameters"
# Each field and the annotation that says the same for a device-plugin pod.
FIELDS = {
    "memoryLimit": ann.MEMORY_LIMIT,
    "fractionLimit": ann.FRACTION_LIMIT,
    "workloadClass": ann.WORKLOAD_CLASS,
    "preemptible": ann.PREEMPTIBLE,
    "swappable": ann.SWAPPABLE,
    "idleTimeout": ann.IDLE_TIMEOUT,
    "maxRuntime": ann.MAX_RUNTIME,
    "idleExempt": ann.IDLE_EXEMPT,
    "waitTimeout": ann.WAIT_TIMEOUT,
    "computeShare": ann.COMPUTE_SHARE,
}
_FIELD_OF = {v: k for k, v in FIELDS.items()}
_BOOLEAN = frozenset({"preemptible", "swappable", "idleExempt"})
_DURATION = frozenset({"idleTimeout", "maxRuntime", "waitTimeout"})
_HEADER = frozenset({"apiVersion", "kind"})
# A value parse_policy refuses whatever the setting (a NUL is in no quantity, duration,
# boolean or class): stands for a value of the wrong JSON type, whose reason is ours.
_WRONG_TYPE = "\x00"


@dataclass(frozen=True)
class ParameterProblem:
    """One claim parameter the agent could not honour, and what it did instead."""

    field: str
    value: str
    reason: str
    default: str  # the safe value applied instead, in words; "" where nothing replaces it

    def message(self, claim: str) -> str:
        """The text of the Warning Event on the claim: field, value, reason, the default applied."""
        instead = f"; applied the safe default {self.default}" if self.default else ""
        return (
            f'claim parameter {shown(self.field)}="{shown(self.value)}" ignored for {claim}: '
            f"{self.reason}{instead}"
        )


def _text(value: Any) -> str:
    """A parameter's value as the problem quotes it (JSON for what is not a string)."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, sort_keys=True)
    except (TypeError, ValueError):  # pragma: no cover - parsed JSON always dumps
        return repr(value)


def _typed(name: str, value: Any) -> tuple[str, str | None]:
    """The annotation text for a field's value, and why its JSON type is wrong (None if right)."""
    if name in _BOOLEAN:
        return (
            ("true" if value else "false", None)
            if isinstance(value, bool)
            else (_WRONG_TYPE, "must be a boolean, true or false")
        )
    if name in _DURATION:
        if isinstance(value, str):
            return value, None
        return _WRONG_TYPE, "must be a duration string like 30m, 1h30m or 45s"
    if name == "workloadClass":
        return (value, None) if isinstance(value, str) else (_WRONG_TYPE, "must be a string")
    # memoryLimit (a quantity), fractionLimit and computeShare (percentages): a string or a number.
    if isinstance(value, str) or (isinstance(value, int | float) and not isinstance(value, bool)):
        return str(value), None
    return _WRONG_TYPE, "must be a quantity string like 24Gi, or a number"


def merged(parameters: Sequence[Any]) -> tuple[dict[str, Any], list[ParameterProblem]]:
    """The fields of every parameters object of ours, later ones overriding earlier ones, and
    what was refused about the objects themselves (a wrong apiVersion or kind: the whole
    object is ignored; an unknown field: that field is)."""
    fields: dict[str, Any] = {}
    problems: list[ParameterProblem] = []
    for obj in parameters:
        if not isinstance(obj, Mapping):
            problems.append(ParameterProblem("parameters", _text(obj), "is not an object", ""))
            continue
        version, kind = obj.get("apiVersion"), obj.get("kind")
        if version != API_VERSION:
            reason = f"must be {API_VERSION} (the version this agent reads); the whole object is ignored"
            problems.append(ParameterProblem("apiVersion", _text(version), reason, ""))
            continue
        if kind != KIND:
            reason = f"must be {KIND}; the whole object is ignored"
            problems.append(ParameterProblem("kind", _text(kind), reason, ""))
            continue
        for name, value in obj.items():
            if name in _HEADER:
                continue
            if name not in FIELDS:
                reason = f"unknown field (known: {', '.join(sorted(FIELDS))})"
                problems.append(ParameterProblem(str(name), _text(value), reason, ""))
                continue
            fields[name] = value
    return fields, problems


def claim_policy(
    parameters: Sequence[Any],
    *,
    claim: str,
    request_bytes: int,
    gpu_allocatable: int,
    cfg: Config,
    priority: int | None = None,
    whole_gpu: bool = False,
) -> tuple[ContainerPolicy, list[ParameterProblem]]:
    """A claim's policy from its parameters (in the order they apply), as parse_policy
    decides a pod's from its annotations, and the problems, each naming its field."""
    fields, problems = merged(parameters)
    annotations: dict[str, str] = {}
    wrong: dict[str, str] = {}  # field -> why its JSON type is refused
    for name, value in fields.items():
        text, why = _typed(name, value)
        annotations[FIELDS[name]] = text
        if why is not None:
            wrong[name] = why
    result = ann.parse_policy(
        annotations,
        container=claim,
        request_bytes=request_bytes,
        gpu_allocatable=gpu_allocatable,
        cfg=cfg,
        priority=priority,
        whole_gpu=whole_gpu,
    )
    for p in result.problems:
        name = _FIELD_OF.get(p.key, p.key)
        reason = wrong.get(name) or _fields_named(p.reason)
        problems.append(ParameterProblem(name, _text(fields.get(name, p.value)), reason, p.default))
    policy = result.policy
    if policy.limit_key is not None:
        policy = dataclasses.replace(policy, limit_key=_FIELD_OF.get(policy.limit_key, policy.limit_key))
    if policy.compute_share_key is not None:
        key = policy.compute_share_key
        policy = dataclasses.replace(policy, compute_share_key=_FIELD_OF.get(key, key))
    return policy, problems[: ann.MAX_PROBLEMS]


def _fields_named(reason: str) -> str:
    """parse_policy's reason with annotation keys named as the fields they stand for."""
    for key, name in _FIELD_OF.items():
        reason = reason.replace(key, name)
    return reason
