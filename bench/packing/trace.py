"""A seeded synthetic trace: one day of GPU workloads arriving at one 8-GPU node.

Every pod carries its own memory-demand curve, sampled once per tick, so that all
strategies replay exactly the same workload; only what each strategy does with it
differs. Three workload kinds, chosen because they stress sharing differently:

* inference servers: always busy, memory follows load (a diurnal curve peaking in
  the afternoon, plus autocorrelated noise); the curve is indexed by wall-clock
  time, because load depends on the time of day, not on when the pod started.
* notebooks: interactive sessions that alternate short active bursts with long idle
  stretches during which they keep holding the memory they last used (a framework
  cache does not shrink by itself); indexed by the pod's age.
* batch jobs: steady memory for a fixed amount of work; indexed by age.

Requests and limits are whole GiB, as the `gpufrac.dev/gpu-memory` resource is.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Literal

Kind = Literal["inference", "notebook", "batch"]
KINDS: tuple[Kind, ...] = ("inference", "notebook", "batch")

DAY_S = 86_400.0
HOUR_S = 3_600.0


@dataclass(frozen=True)
class Node:
    """The node every strategy packs onto."""

    gpus: int = 8
    gpu_memory_gib: float = 80.0
    # Driver and context overhead no workload can use (gpufrac's reservedPerGpu).
    reserved_gib: float = 1.0

    @property
    def allocatable_gib(self) -> float:
        return self.gpu_memory_gib - self.reserved_gib

    @property
    def total_gib(self) -> float:
        return self.gpus * self.gpu_memory_gib


@dataclass(frozen=True)
class PodSpec:
    """One pod of the trace: when it arrives, what it asks for, what it really uses."""

    name: str
    kind: Kind
    arrival_s: float
    # inference, notebook: seconds it runs once admitted; batch: seconds of work to finish.
    duration_s: float
    # What a gpufrac user would write: guaranteed request and burst limit (= peak use).
    request_gib: float
    limit_gib: float
    priority: int
    preemptible: bool
    swappable: bool
    # Demand per tick in GiB (<= limit_gib); "wall" curves are indexed by the tick of
    # the day, "age" curves by ticks since the pod (re)started running.
    demand: tuple[float, ...]
    clock: Literal["wall", "age"] = "age"
    # Per-tick activity (GPU work being issued); empty means always active.
    active: tuple[bool, ...] = ()
    # Offset into the age-indexed curves: a notebook resubmitted after being reaped
    # resumes its session where it left off.
    age_offset_ticks: int = 0
    # The trace pod this one continues (a resubmission), or "" for an original pod.
    origin: str = ""

    def __post_init__(self) -> None:
        if not 0 < self.request_gib <= self.limit_gib:
            raise ValueError(
                f"pod {self.name}: need 0 < request ({self.request_gib}) <= limit ({self.limit_gib})"
            )
        if not self.demand:
            raise ValueError(f"pod {self.name}: empty demand curve")
        if max(self.demand) > self.limit_gib + 1e-9:
            raise ValueError(
                f"pod {self.name}: demand {max(self.demand)} GiB exceeds its limit {self.limit_gib}"
            )
        if self.active and len(self.active) != len(self.demand):
            raise ValueError(f"pod {self.name}: active and demand curves differ in length")

    @property
    def peak_gib(self) -> float:
        return self.limit_gib

    def sample(self, wall_tick: int, age_tick: int) -> tuple[float, bool]:
        """Demand (GiB) and activity at this tick; past the end a curve repeats its tail
        (wall) or wraps around (age: a batch job slowed by restarts keeps its pattern)."""
        if self.clock == "wall":
            i = min(wall_tick, len(self.demand) - 1)
        else:
            i = (age_tick + self.age_offset_ticks) % len(self.demand)
        return self.demand[i], (self.active[i] if self.active else True)


@dataclass(frozen=True)
class Trace:
    seed: int
    tick_s: float
    horizon_s: float
    node: Node
    pods: tuple[PodSpec, ...]
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def ticks(self) -> int:
        return round(self.horizon_s / self.tick_s)

    def summary(self) -> dict[str, Any]:
        kinds = Counter(p.kind for p in self.pods)
        return {
            "pods": len(self.pods),
            "by_kind": {k: kinds.get(k, 0) for k in KINDS},
            "sum_requests_gib": round(sum(p.request_gib for p in self.pods), 1),
            "sum_limits_gib": round(sum(p.limit_gib for p in self.pods), 1),
            "mean_request_over_limit": round(
                sum(p.request_gib / p.limit_gib for p in self.pods) / max(1, len(self.pods)), 3
            ),
            "tick_s": self.tick_s,
            "horizon_h": self.horizon_s / HOUR_S,
            "node": {
                "gpus": self.node.gpus,
                "gpu_memory_gib": self.node.gpu_memory_gib,
                "reserved_gib": self.node.reserved_gib,
            },
        }


def diurnal_load(t_s: float) -> float:
    """Request load in [0, 1] over the day: a trough at 04:00, a peak at 16:00."""
    return 0.5 - 0.5 * math.cos(2 * math.pi * (t_s - 4 * HOUR_S) / DAY_S)


def _ar1(rng: random.Random, n: int, sigma: float, rho: float = 0.97) -> list[float]:
    """Autocorrelated noise: load changes smoothly tick to tick, not white-noise jitter."""
    out, x = [], 0.0
    scale = sigma * math.sqrt(1 - rho * rho)
    for _ in range(n):
        x = rho * x + rng.gauss(0.0, scale)
        out.append(x)
    return out


def _inference(
    rng: random.Random, name: str, arrival: float, duration: float, ticks: int, tick: float
) -> PodSpec:
    peak = float(rng.randint(16, 40))
    base = peak * rng.uniform(0.35, 0.5)  # weights + minimal KV cache: always resident
    noise = _ar1(rng, ticks, 0.08)
    curve = []
    for k in range(ticks):
        load = min(1.0, max(0.0, diurnal_load(k * tick) + noise[k]))
        curve.append(round(base + (peak - base) * load, 3))
    # A gpufrac user requests roughly the median use and bursts to the peak.
    request = float(min(peak, math.ceil(sorted(curve)[len(curve) // 2])))
    return PodSpec(
        name, "inference", arrival, duration, request, peak, priority=1000, preemptible=True,
        swappable=False, demand=tuple(curve), clock="wall",
    )  # fmt: skip


def _notebook(rng: random.Random, name: str, arrival: float, duration: float, tick: float) -> PodSpec:
    peak = float(rng.randint(8, 32))
    n = max(1, int(duration / tick))
    demand: list[float] = []
    active: list[bool] = []
    level = 0.0
    is_active = True
    while len(demand) < n:
        if is_active:
            seg = rng.uniform(10, 60) * 60
            level = round(peak * rng.uniform(0.5, 1.0), 3)
        else:
            seg = rng.uniform(20, 150) * 60
        for _ in range(max(1, int(seg / tick))):
            demand.append(level)
            active.append(is_active)
        is_active = not is_active
    request = float(max(2, math.ceil(peak * 0.25)))
    return PodSpec(
        name, "notebook", arrival, duration, request, peak, priority=500, preemptible=True,
        swappable=True, demand=tuple(demand[:n]), active=tuple(active[:n]),
    )  # fmt: skip


def _batch(rng: random.Random, name: str, arrival: float, work: float, tick: float) -> PodSpec:
    peak = float(rng.randint(10, 40))
    level = peak * rng.uniform(0.85, 0.95)
    n = max(1, int(work / tick))
    # Steady use with small wiggles (activation size varies by batch); never above peak.
    curve = tuple(round(min(peak, level + rng.uniform(-0.03, 0.05) * peak), 3) for _ in range(n))
    # Batch users know their steady footprint and request all of it: no burst to lose.
    request = peak
    return PodSpec(
        name, "batch", arrival, work, request, peak, priority=100, preemptible=True, swappable=False,
        demand=curve,
    )  # fmt: skip


def generate(
    seed: int = 7,
    *,
    tick_s: float = 30.0,
    horizon_s: float = DAY_S,
    node: Node | None = None,
    always_on_inference: int = 6,
    daytime_inference: int = 10,
    notebooks: int = 30,
    batch_jobs: int = 24,
) -> Trace:
    """The day's trace for `seed`: same seed, same trace, byte for byte."""
    rng = random.Random(seed)
    ticks = round(horizon_s / tick_s)
    scale = horizon_s / DAY_S  # shorter horizons (tests) squeeze the day's shape
    pods: list[PodSpec] = []
    for i in range(always_on_inference):
        pods.append(_inference(rng, f"inf-{i:02d}", 0.0, horizon_s, ticks, tick_s))
    for i in range(daytime_inference):
        # Scale-out replicas come up through the morning ramp and leave in the evening.
        arrival = rng.uniform(7, 12) * HOUR_S * scale
        duration = rng.uniform(6, 10) * HOUR_S * scale
        pods.append(_inference(rng, f"inf-{always_on_inference + i:02d}", arrival, duration, ticks, tick_s))
    for i in range(notebooks):
        arrival = rng.uniform(8, 17) * HOUR_S * scale
        duration = rng.uniform(2, 8) * HOUR_S * scale
        pods.append(_notebook(rng, f"nb-{i:02d}", arrival, duration, tick_s))
    for i in range(batch_jobs):
        arrival = rng.uniform(0, 22) * HOUR_S * scale
        work = rng.uniform(1, 5) * HOUR_S * scale
        pods.append(_batch(rng, f"batch-{i:02d}", arrival, work, tick_s))
    pods.sort(key=lambda p: (p.arrival_s, p.name))
    params = {
        "always_on_inference": always_on_inference,
        "daytime_inference": daytime_inference,
        "notebooks": notebooks,
        "batch_jobs": batch_jobs,
    }
    return Trace(seed, tick_s, horizon_s, node or Node(), tuple(pods), params)
