"""Operator policy: what the pods of a namespace may ask for with their annotations.

A pod sets its own burst limit (gpufrac.dev/gpu-memory-limit), `preemptible`,
`swappable` and its compute share (gpufrac.dev/compute-share). The node config's `policy`
section caps that per namespace, and says how compute is shared there:

    policy:
      default:                    # every namespace not listed below
        maxLimitRatio: 0          # limit <= ratio x request; 0 = no cap
        allowNonPreemptible: true # may pods say preemptible: "false"?
        allowUnswappable: true    # may pods stay unswappable?
        maxComputeShare: 100      # a container's compute share is at most this percent of its GPU
        computeMode: fair         # fair or strict (docs/compute.md); unset: the node's compute.mode
      namespaces:
        research: {maxLimitRatio: 2, allowNonPreemptible: false, computeMode: strict}

A namespace entry names only what differs from `default`. A pod asking beyond its
namespace's policy gets the capped value (a limit of ratio x request, preemptible,
swappable), and one Warning Event naming the cap (gpufrac.agent.booking.pods posts it).

gpufrac.core.config imports this module, and the annotations' ContainerPolicy needs the
config: so `enforce` asks only for the fields it caps (CappedPolicy), and imports neither.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Protocol, TypeVar

from gpufrac.core.quote import shown

_NAMESPACE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_KEYS = {"maxLimitRatio": "max_limit_ratio", "allowNonPreemptible": "allow_non_preemptible"}
_KEYS["allowUnswappable"] = "allow_unswappable"
_KEYS.update(maxComputeShare="max_compute_share", computeMode="compute_mode")
COMPUTE_MODES = ("fair", "strict")

LIMIT, PREEMPTIBLE, SWAPPABLE, COMPUTE_SHARE = "limit", "preemptible", "swappable", "compute-share"
# No cap above this ever binds: a request is at least a memory unit (1Mi or more) and a limit
# at most a GPU's memory, so larger ratios say nothing and only invite overflow.
MAX_LIMIT_RATIO = 1_000_000


@dataclass(frozen=True)
class NamespacePolicy:
    max_limit_ratio: float = 0.0  # the burst limit is at most this times the request; 0 = no cap
    allow_non_preemptible: bool = True  # pods may opt out of preemption (gpufrac.dev/preemptible)
    allow_unswappable: bool = True  # pods may stay out of swap (not swappable)
    max_compute_share: int = 100  # percent of a GPU a container's compute share may be at most
    compute_mode: str | None = None  # "fair" or "strict"; None: the node's compute.mode


@dataclass(frozen=True)
class PolicyConfig:
    default: NamespacePolicy = field(default_factory=NamespacePolicy)
    namespaces: Mapping[str, NamespacePolicy] = field(default_factory=dict)

    def for_namespace(self, namespace: str) -> NamespacePolicy:
        return self.namespaces.get(namespace, self.default)

    def __hash__(self) -> int:  # frozen with a mapping inside: hash what is comparable
        return hash((self.default, tuple(sorted(self.namespaces.items()))))


def _entry(path: str, raw: Any, base: NamespacePolicy) -> NamespacePolicy:
    if not isinstance(raw, Mapping):
        raise ValueError(f"{path}: expected a mapping, got {raw!r}")
    values: dict[str, Any] = {}
    for key, value in raw.items():
        name = _KEYS.get(key) if isinstance(key, str) else None
        if name is None:
            raise ValueError(f"{path}.{key}: unknown key (known: {', '.join(sorted(_KEYS))})")
        if name == "max_limit_ratio":
            # Compared as given, never through float(): a long integer would raise OverflowError,
            # and NaN fails every comparison.
            number = isinstance(value, int | float) and not isinstance(value, bool)
            if not number or not (value == 0 or 1 <= value <= MAX_LIMIT_RATIO):
                raise ValueError(
                    f"{path}.{key}: {shown(repr(value))} must be 0 (no cap) or a number from 1 (a limit is "
                    f"never below the request) to {MAX_LIMIT_RATIO}"
                )
            values[name] = float(value)
        elif name == "max_compute_share":
            number = isinstance(value, int) and not isinstance(value, bool)
            if not number or not 1 <= value <= 100:
                raise ValueError(f"{path}.{key}: {shown(repr(value))} must be a whole percent from 1 to 100")
            values[name] = value
        elif name == "compute_mode":  # null: the node's compute.mode
            if value is not None and value not in COMPUTE_MODES:
                raise ValueError(
                    f"{path}.{key}: {shown(repr(value))} must be one of {', '.join(COMPUTE_MODES)}"
                )
            values[name] = value
        else:
            if not isinstance(value, bool):
                raise ValueError(f"{path}.{key}: expected true or false, got {value!r}")
            values[name] = value
    return dataclasses.replace(base, **values)


def parse_config(path: str, raw: Any) -> PolicyConfig:
    """The `policy` section of the node config; ValueError names the key, value and reason."""
    if not isinstance(raw, Mapping):
        raise ValueError(f"{path}: expected a mapping, got {raw!r}")
    unknown = set(raw) - {"default", "namespaces"}
    if unknown:
        raise ValueError(f"{path}.{sorted(map(str, unknown))[0]}: unknown key (known: default, namespaces)")
    default = _entry(f"{path}.default", raw.get("default") or {}, NamespacePolicy())
    spaces = raw.get("namespaces") or {}
    if not isinstance(spaces, Mapping):
        raise ValueError(f"{path}.namespaces: expected a mapping of namespace to policy, got {spaces!r}")
    namespaces = {}
    for ns, entry in spaces.items():
        if not isinstance(ns, str) or not _NAMESPACE.match(ns):
            raise ValueError(f"{path}.namespaces: {ns!r} is not a namespace name")
        namespaces[ns] = _entry(f"{path}.namespaces.{ns}", entry or {}, default)
    return PolicyConfig(default, namespaces)


class CappedPolicy(Protocol):
    """What `enforce` reads of a container's policy (a frozen dataclass it replaces fields of)."""

    @property
    def request_bytes(self) -> int: ...
    @property
    def limit_bytes(self) -> int: ...
    @property
    def limit_key(self) -> str | None: ...
    @property
    def whole_gpu(self) -> bool: ...
    @property
    def preemptible(self) -> bool: ...
    @property
    def swappable(self) -> bool: ...
    @property
    def compute_share(self) -> float | None: ...
    @property
    def compute_share_key(self) -> str | None: ...


P = TypeVar("P", bound=CappedPolicy)


@dataclass(frozen=True)
class Cap:
    """One thing the policy changed: `what` (limit, preemptible, swappable) and why, in words."""

    what: str
    message: str


def _ratio(r: float) -> str:
    return f"{r:g}"


def enforce(
    policy: P, namespace: str, cfg: PolicyConfig, *, container: str, format_bytes: Callable[[int], str]
) -> tuple[P, list[Cap]]:
    """`policy` (decided from the pod's annotations) held to the namespace's caps: the
    policy to apply and what was capped. Whole-GPU containers have no burst to cap."""
    ns = cfg.for_namespace(namespace)
    where = f"namespace {namespace}" + ("" if namespace in cfg.namespaces else " (policy.default)")
    caps: list[Cap] = []
    changes: dict[str, Any] = {}
    ratio = ns.max_limit_ratio
    capped = bool(ratio) and math.isfinite(ratio)  # an infinite ratio caps nothing
    if capped and not policy.whole_gpu and policy.limit_bytes > policy.request_bytes:
        # Exact: a float product could overflow to inf (a PolicyConfig not made by parse_config).
        most = max(policy.request_bytes, math.floor(Fraction(ratio) * policy.request_bytes))
        if policy.limit_bytes > most:
            changes["limit_bytes"] = most
            times = Fraction(policy.limit_bytes, max(1, policy.request_bytes))
            caps.append(
                Cap(
                    LIMIT,
                    f"container {container}: GPU memory limit {format_bytes(policy.limit_bytes)} "
                    f"({policy.limit_key}) is {float(times):.2f} x the request "
                    f"{format_bytes(policy.request_bytes)}; the node policy for {where} caps it at "
                    f"maxLimitRatio {_ratio(ratio)}: limit {format_bytes(most)} applied",
                )
            )
    # Opt-outs of eviction and swap the namespace may forbid: (the ContainerPolicy field,
    # which its Cap is named after, what was asked, whether allowed, the policy key).
    forced = (
        (PREEMPTIBLE, policy.preemptible, ns.allow_non_preemptible, "allowNonPreemptible"),
        (SWAPPABLE, policy.swappable, ns.allow_unswappable, "allowUnswappable"),
    )
    most_share = ns.max_compute_share / 100
    share = policy.compute_share
    if share is not None and not policy.whole_gpu and share > most_share:
        changes["compute_share"] = most_share
        source = f" ({policy.compute_share_key})" if policy.compute_share_key else " (its memory share)"
        caps.append(
            Cap(
                COMPUTE_SHARE,
                f"container {container}: compute share {share * 100:.4g}%{source} is above the node "
                f"policy's maxComputeShare {ns.max_compute_share} for {where}: "
                f"{ns.max_compute_share}% applied",
            )
        )
    for name, asked, allowed, key in forced:
        if not asked and not allowed:
            changes[name] = True
            caps.append(
                Cap(
                    name,
                    f"container {container}: {name}=false is not allowed by the node policy for {where} "
                    f"({key}: false): applied {name}=true",
                )
            )
    return (dataclasses.replace(policy, **changes) if changes else policy), caps  # type: ignore[type-var]


def compute_mode(cfg: PolicyConfig, namespace: str, node_mode: str) -> str:
    """How compute is shared for a namespace's containers: its policy's computeMode, else the
    node's compute.mode (docs/compute.md)."""
    return cfg.for_namespace(namespace).compute_mode or node_mode
