"""Pod annotations -> the policy of one container (docs/design.md section 1).

Pure functions: no I/O, no Kubernetes client. Every bad value becomes an
AnnotationProblem naming the key, the value and why, plus the SAFE default for
that setting (limit = request, preemptible, class batch, node-config timeouts).
Nothing here raises on user input, and nothing here ever yields a limit below
the request or above the GPU's allocatable memory.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import TypeVar

from gpufrac.core.config import Config
from gpufrac.core.flags import (
    CLASS_NAMES,
    FLAG_POD_KNOWN,
    FLAG_PREEMPTIBLE,
    FLAG_SWAPPABLE,
    FLAG_WHOLE_GPU,
)
from gpufrac.core.quote import shown
from gpufrac.core.units import MAX_MS_FIELD_S, format_bytes, parse_bytes, parse_duration

PREFIX = "gpufrac.dev/"
MEMORY_LIMIT = PREFIX + "gpu-memory-limit"
FRACTION_LIMIT = PREFIX + "gpu-fraction-limit"
PREEMPTIBLE = PREFIX + "preemptible"
SWAPPABLE = PREFIX + "swappable"
WORKLOAD_CLASS = PREFIX + "workload-class"
IDLE_TIMEOUT = PREFIX + "idle-timeout"
MAX_RUNTIME = PREFIX + "max-runtime"
IDLE_EXEMPT = PREFIX + "idle-exempt"  # "true": never reaped for idleness or runtime (agent/idle/)
WAIT_TIMEOUT = PREFIX + "wait-timeout"
# The container's share of its GPU's compute, percent (docs/compute.md); default: its memory share.
COMPUTE_SHARE = PREFIX + "compute-share"

LIMIT_KEYS = (MEMORY_LIMIT, FRACTION_LIMIT)
# Keys a `.<container>` suffix narrows to one container of the pod.
PER_CONTAINER_KEYS = (*LIMIT_KEYS, COMPUTE_SHARE)
# Every annotation a user may write. Other gpufrac.dev/ keys are typos and are
# reported, so "gpufrac.dev/gpu-memory-limt" does not silently mean "no burst".
# Parts of gpufrac that write their own annotations add them to AGENT_OWNED.
USER_KEYS = frozenset(
    {*LIMIT_KEYS, PREEMPTIBLE, SWAPPABLE, WORKLOAD_CLASS, IDLE_TIMEOUT, MAX_RUNTIME, WAIT_TIMEOUT}
    | {IDLE_EXEMPT, COMPUTE_SHARE}
)
AGENT_OWNED: set[str] = set()

T = TypeVar("T")
DEFAULT_CLASS = "batch"
# The config file stores the wait timeout in a u32 of milliseconds.
MAX_WAIT_TIMEOUT_S = MAX_MS_FIELD_S
_INT32 = (-(2**31), 2**31 - 1)
_PERCENT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*%?\s*$")
# A pod may carry ~12,000 keys (256 KiB of annotations): a refusal that stands for many names
# a few (gpufrac.core.quote bounds each).
SHOWN_KEYS = 3  # keys named in a problem that stands for many
# Problems one container's annotations can give: each known key gives at most one or two
# and unknown keys fold into one (see _check_keys); the cap holds whatever is added later.
MAX_PROBLEMS = 16


@dataclass(frozen=True)
class AnnotationProblem:
    """One annotation the agent could not honour, and what it did instead."""

    key: str
    value: str
    reason: str
    default: str  # the safe value applied instead, in words

    def message(self, container: str) -> str:
        """The text of the Warning Event: names key, value, reason and the default applied."""
        return (
            f'annotation {shown(self.key)}="{shown(self.value)}" ignored for container {container}: '
            f"{self.reason}; applied the safe default {self.default}"
        )


@dataclass(frozen=True)
class ContainerPolicy:
    """What the agent enforces for one container, decided from its pod."""

    request_bytes: int
    limit_bytes: int
    limit_key: str | None  # the annotation the limit came from; None = limit is the request
    workload_class: str = DEFAULT_CLASS
    preemptible: bool = True
    swappable: bool = False
    priority: int = 0
    idle_timeout: float = 0.0  # seconds
    max_runtime: float = 0.0  # seconds, 0 = none
    idle_exempt: bool = False
    wait_timeout: float = 0.0  # seconds
    whole_gpu: bool = False
    pod_known: bool = True
    # Share of the GPU's compute, 0..1 (docs/compute.md); None: its memory share (a pod not known yet).
    compute_share: float | None = None
    compute_share_key: str | None = None  # the annotation it came from; None: the memory share

    @property
    def flags(self) -> int:
        f = FLAG_POD_KNOWN if self.pod_known else 0
        f |= FLAG_PREEMPTIBLE if self.preemptible else 0
        f |= FLAG_SWAPPABLE if self.swappable else 0
        f |= FLAG_WHOLE_GPU if self.whole_gpu else 0
        return f

    @property
    def burst(self) -> bool:
        return self.limit_bytes > self.request_bytes

    def config_fields(self) -> dict[str, int]:
        """The memguard ContainerConfig fields this policy sets (for ledger.update_config)."""
        return {
            "limit_bytes": self.limit_bytes,
            "flags": self.flags,
            "workload_class": CLASS_NAMES[self.workload_class],
            "priority": self.priority,
            "wait_timeout_ms": round(self.wait_timeout * 1000),
        }


@dataclass
class PolicyResult:
    policy: ContainerPolicy
    problems: list[AnnotationProblem] = field(default_factory=list)


def safe_policy(request_bytes: int, cfg: Config, *, whole_gpu: bool = False) -> ContainerPolicy:
    """The policy of a container whose pod is not known yet: no burst, node defaults."""
    return ContainerPolicy(
        request_bytes=request_bytes,
        limit_bytes=request_bytes,
        limit_key=None,
        swappable=cfg.swap.default_swappable,
        idle_timeout=cfg.idle.idle_timeout,
        max_runtime=cfg.idle.max_runtime,
        wait_timeout=min(cfg.wait_timeout, MAX_WAIT_TIMEOUT_S),
        whole_gpu=whole_gpu,
        pod_known=False,
    )


def _bool(text: str) -> bool:
    t = text.strip().lower()
    if t in ("true", "false"):
        return t == "true"
    raise ValueError("must be true or false")


def _percent(text: str) -> Decimal:
    m = _PERCENT.match(text)
    if not m:
        raise ValueError("must be a percentage of the GPU between 1 and 100, like 80")
    try:
        pct = Decimal(m.group(1))
    except InvalidOperation as e:  # pragma: no cover - the regex admits only decimals
        raise ValueError("is not a number") from e
    if not 0 < pct <= 100:
        raise ValueError("must be a percentage of the GPU between 1 and 100")
    return pct


def _positive_duration(text: str) -> float:
    seconds = parse_duration(text)
    if seconds <= 0:
        raise ValueError("must be a positive duration like 30m")
    return seconds


def _wait_duration(text: str) -> float:
    seconds = parse_duration(text)
    if seconds > MAX_WAIT_TIMEOUT_S:
        raise ValueError(f"is above the maximum of {MAX_WAIT_TIMEOUT_S:.0f}s")
    return seconds


def _reason(e: ValueError, value: str) -> str:
    # units.py messages start with the repr of the value; the Event already names it.
    text = str(e)
    quoted = repr(value)
    return text[len(quoted) :].strip() if text.startswith(quoted) else text


def container_key(base: str, container: str) -> str:
    """The per-container override of a limit annotation: gpufrac.dev/gpu-memory-limit.<container>."""
    return f"{base}.{container}"


def parse_policy(
    annotations: Mapping[str, str] | None,
    *,
    container: str,
    request_bytes: int,
    gpu_allocatable: int,
    cfg: Config,
    priority: int | None = None,
    containers: Collection[str] | None = None,
    whole_gpu: bool = False,
) -> PolicyResult:
    """Decide one container's policy from its pod's annotations.

    `gpu_allocatable` is the allocatable memory of the GPU the container lives on
    (total - reserved); `containers` are all container names of the pod (for typo
    checks of per-container overrides); `whole_gpu` marks whole-GPU allocations,
    which are accounted but never limited below their GPUs.
    """
    ann = {str(k): str(v) for k, v in (annotations or {}).items()}
    problems: list[AnnotationProblem] = []
    base = safe_policy(request_bytes, cfg, whole_gpu=whole_gpu)

    def setting(key: str, parse: Callable[[str], T], default: T, default_text: str) -> T:
        if key not in ann:
            return default
        try:
            return parse(ann[key])
        except ValueError as e:
            problems.append(AnnotationProblem(key, ann[key], _reason(e, ann[key]), default_text))
            return default

    _check_keys(ann, containers, problems)
    limit, limit_key = _limit(ann, container, request_bytes, gpu_allocatable, whole_gpu, problems)
    share, share_key = _compute_share(ann, container, request_bytes, gpu_allocatable, whole_gpu, problems)

    wclass = setting(WORKLOAD_CLASS, _class, DEFAULT_CLASS, DEFAULT_CLASS)
    preemptible = setting(PREEMPTIBLE, _bool, True, "preemptible=true")
    swappable = setting(SWAPPABLE, _bool, base.swappable, f"swappable={str(base.swappable).lower()}")

    def node_duration(key: str, parse: Callable[[str], float], default: float, name: str) -> float:
        return setting(key, parse, default, f"the node's {name} {default:g}s")

    idle = node_duration(IDLE_TIMEOUT, _positive_duration, base.idle_timeout, "idle-timeout")
    max_rt = node_duration(MAX_RUNTIME, _positive_duration, base.max_runtime, "max-runtime")
    idle_exempt = setting(IDLE_EXEMPT, _bool, False, "idle-exempt=false")
    wait = node_duration(WAIT_TIMEOUT, _wait_duration, base.wait_timeout, "wait-timeout")

    prio = 0 if priority is None else max(_INT32[0], min(_INT32[1], int(priority)))
    policy = ContainerPolicy(
        request_bytes=request_bytes,
        limit_bytes=limit,
        limit_key=limit_key,
        workload_class=wclass,
        preemptible=preemptible,
        swappable=swappable,
        priority=prio,
        idle_timeout=idle,
        max_runtime=max_rt,
        idle_exempt=idle_exempt,
        wait_timeout=wait,
        whole_gpu=whole_gpu,
        pod_known=True,
        compute_share=share,
        compute_share_key=share_key,
    )
    return PolicyResult(policy, problems[:MAX_PROBLEMS])


def _class(text: str) -> str:
    t = text.strip().lower()
    if t not in CLASS_NAMES:
        raise ValueError(f"unknown workload class (choose from {', '.join(sorted(CLASS_NAMES))})")
    return t


def _check_keys(
    ann: Mapping[str, str], containers: Collection[str] | None, problems: list[AnnotationProblem]
) -> None:
    """Report gpufrac.dev/ keys nobody reads (typos) and overrides naming no container: one
    problem for each kind, however many keys (a pod's thousands of keys are one Event)."""
    unknown: list[str] = []
    strangers: list[str] = []  # per-container overrides naming a container the pod lacks
    for key in ann:
        if not key.startswith(PREFIX) or key in USER_KEYS or key in AGENT_OWNED:
            continue
        base, _, target = key.rpartition(".")
        if base in PER_CONTAINER_KEYS and target:
            if containers is not None and target not in containers:
                strangers.append(key)
            continue
        unknown.append(key)
    if strangers:
        reason = (
            f"the pod has no container named {shown(strangers[0].rpartition('.')[2])!r}"
            if len(strangers) == 1
            else "the pod has no container of that name"
        )
        problems.append(_folded(ann, strangers, reason, "no per-container override"))
    if unknown:
        reason = f"unknown gpufrac annotation (known: {', '.join(sorted(USER_KEYS))})"
        problems.append(_folded(ann, unknown, reason, "ignored"))


def _folded(ann: Mapping[str, str], keys: list[str], reason: str, default: str) -> AnnotationProblem:
    """One problem for `keys`, all refused for `reason`: named by the first of them (sorted, so
    the same keys give the same message whatever their order), with how many and a few more."""
    keys = sorted(keys)
    first = keys[0]
    if len(keys) > 1:
        more = ", ".join(shown(k) for k in keys[1:SHOWN_KEYS])
        rest = len(keys) - min(len(keys), SHOWN_KEYS)
        tail = f" and {rest} more" if rest else ""
        reason = f"{reason}; {len(keys)} such keys in all, also {more}{tail}"
    return AnnotationProblem(first, ann[first], reason, default)


def _limit(
    ann: Mapping[str, str],
    container: str,
    request: int,
    allocatable: int,
    whole_gpu: bool,
    problems: list[AnnotationProblem],
) -> tuple[int, str | None]:
    """The burst limit and the key it came from; limit = request on any doubt."""
    default = f"limit = request ({format_bytes(request)})"
    per_container = [k for k in (container_key(b, container) for b in LIMIT_KEYS) if k in ann]
    pod_level = [k for k in LIMIT_KEYS if k in ann]
    # The most specific level wins; two kinds at the same level are ambiguous.
    given = per_container or pod_level
    if not given:
        return request, None
    if len(given) > 1:
        both = " and ".join(given)
        for k in given:
            problems.append(AnnotationProblem(k, ann[k], f"{both} are both set; set only one", default))
        return request, None
    key = given[0]
    value = ann[key]
    if whole_gpu:
        # A whole-GPU container already owns its GPUs; only tell the user when
        # they aimed the annotation at this very container.
        if per_container:
            problems.append(AnnotationProblem(key, value, "has no effect on a whole-GPU allocation", default))
        return request, None
    try:
        if key.startswith(MEMORY_LIMIT):
            limit = parse_bytes(value)
        else:
            limit = int(allocatable * _percent(value) / 100)
    except ValueError as e:
        problems.append(AnnotationProblem(key, value, _reason(e, value), default))
        return request, None
    if limit < request:
        reason = (
            f"{format_bytes(limit)} is below the request {format_bytes(request)}; a limit never undercuts it"
        )
        problems.append(AnnotationProblem(key, value, reason, default))
        return request, None
    if limit > allocatable:
        reason = f"{format_bytes(limit)} is above the GPU's allocatable {format_bytes(allocatable)}"
        problems.append(AnnotationProblem(key, value, reason, default))
        return request, None
    return limit, key


def memory_share(request_bytes: int, allocatable: int) -> float:
    """A container's share of its GPU's memory: its request over the GPU's allocatable memory
    (a gpu-fraction of N is N %), at most the whole GPU."""
    return min(1.0, request_bytes / allocatable) if allocatable > 0 else 1.0


def _compute_share(
    ann: Mapping[str, str],
    container: str,
    request: int,
    allocatable: int,
    whole_gpu: bool,
    problems: list[AnnotationProblem],
) -> tuple[float, str | None]:
    """The container's compute share (0..1) and the key it came from: its memory share unless
    gpufrac.dev/compute-share(.<container>) says otherwise; the memory share on any doubt."""
    default = memory_share(request, allocatable)
    if whole_gpu:
        default = 1.0
    default_text = f"the memory share {default * 100:.4g}%"
    key = next((k for k in (container_key(COMPUTE_SHARE, container), COMPUTE_SHARE) if k in ann), None)
    if key is None:
        return default, None
    if whole_gpu:
        if key != COMPUTE_SHARE:  # aimed at this very container
            problems.append(
                AnnotationProblem(key, ann[key], "has no effect on a whole-GPU allocation", "100%")
            )
        return default, None
    try:
        pct = _percent(ann[key])
    except ValueError as e:
        problems.append(AnnotationProblem(key, ann[key], _reason(e, ann[key]), default_text))
        return default, None
    return float(pct) / 100, key
