"""The four ways to share a GPU node that the capacity study compares, one model each.

A strategy decides three things; the replay in sim.py does the rest identically:

* admission: how much of a GPU's allocatable memory a pod reserves, and how many
  pods a GPU may hold (all strategies share one FIFO admission queue);
* isolation: whether memory is accounted per pod (a pod can only grow into memory
  that is really free, so the GPU never overflows) or not (time-slicing: pods
  allocate blindly and the one whose allocation does not fit dies with OOM);
* for gpufrac only: the resolver chain run when a burst collides, and idle reaping.

These are models of the mechanisms, not measurements of any implementation: see
docs/capacity-study.md for what each leaves out.
"""

from __future__ import annotations

from dataclasses import dataclass

from bench.packing.trace import Node, PodSpec
from gpufrac.core.config import RESOLVERS, Config

_GiB = float(1 << 30)


@dataclass(frozen=True)
class Strategy:
    """Base model: memory isolated per pod, a pod reserves its peak, no bursting."""

    name: str = ""
    # False: no per-pod memory accounting; overflow crashes the allocating pod.
    isolated: bool = True
    # Pods per GPU (None: bounded only by reserved memory).
    slots_per_gpu: int | None = None
    # Which GPU a pod goes to among those it fits: "binpack" (fullest first) or "spread".
    allocation_policy: str = "binpack"
    # gpufrac only (Gpufrac.from_config fills them from the agent's config defaults).
    resolvers: tuple[str, ...] = ()
    # Seconds a waiting burst may block; the replay retries it on the following tick.
    wait_timeout_s: float = 0.0
    evict_idle_threshold_s: float = 0.0
    host_ram_budget_gib: float = 0.0
    idle_reaping: bool = False
    idle_timeout_s: float = 0.0

    def reservation(self, pod: PodSpec, node: Node) -> float:
        """GiB of the GPU's allocatable memory the pod holds a claim on while admitted."""
        return pod.limit_gib

    def limit(self, pod: PodSpec) -> float:
        """The most GPU memory the pod may ever hold."""
        return pod.limit_gib


@dataclass(frozen=True)
class WholeGpus(Strategy):
    """One pod per GPU (`nvidia.com/gpu: 1`, the default device plugin).

    Each pod owns a whole GPU, so memory never collides and nothing crashes; the
    price is that a GPU holding a 10 GiB notebook idles the other 69 GiB, and only
    eight pods can run at once on this node."""

    name: str = "whole_gpus"
    slots_per_gpu: int | None = 1

    def reservation(self, pod: PodSpec, node: Node) -> float:
        return node.allocatable_gib


@dataclass(frozen=True)
class TimeSlicing(Strategy):
    """Time-slicing: every GPU advertised as `replicas` shareable devices.

    Admission counts replicas only; nothing knows or limits memory. Every pod sees
    the whole GPU and allocates what its workload needs. When the pods on a GPU
    together need more than it has, the allocation that does not fit fails and that
    pod is counted as an OOM crash: its memory is freed and the kubelet restarts it
    with CrashLoopBackOff (10 s doubling to 5 min). New pods are placed on the GPU
    with the fewest pods, as spreading is the best a memory-blind scheduler can do."""

    name: str = "time_slicing"
    isolated: bool = False
    slots_per_gpu: int | None = 4

    def reservation(self, pod: PodSpec, node: Node) -> float:
        return 0.0


@dataclass(frozen=True)
class StaticFractions(Strategy):
    """Static fractions (MIG-like slices, or gpufrac with limit = request): each pod
    reserves its peak and may never use more.

    The sum of reservations never exceeds a GPU's allocatable memory and no pod
    grows past its own reservation, so nothing ever collides, waits or crashes; the
    cost is memory reserved for peaks that are rarely reached and for notebooks that
    sit idle all afternoon, which keeps queued pods out."""

    name: str = "static_fractions"


@dataclass(frozen=True)
class Gpufrac(Strategy):
    """gpufrac as docs/design.md section 2 specifies it (lendUnusedRequests off).

    A pod reserves its request: the device plugin never lets the requests on a GPU
    exceed its allocatable memory, and up to its request a pod always gets its
    memory. Between request and limit it bursts into memory nobody has claimed
    (allocatable minus every pod's max(request, use)). When a burst does not fit the
    resolvers run in the configured order:

    * swap: idle, swappable pods holding burst memory on that GPU are moved to host
      RAM (they keep running; bounded by the host-RAM budget) and swapped back in,
      resolving again if needed, when they next do GPU work;
    * evict: processes of preemptible pods holding burst memory with lower priority
      than the requester, or idle longer than evictIdleThreshold, are killed (the
      container restarts with back-off);
    * wait: the burst blocks for up to waitTimeout and gets memory freed meanwhile
      (replayed as one retry a tick later); then CUDA_ERROR_OUT_OF_MEMORY, which the
      application survives (counted as burst_denied, not as a crash).

    The idle reaper evicts interactive pods idle longer than the idle timeout (the
    agent's action "evict"; its default is "notify"); a reaped notebook's user comes
    back at the session's next active stretch and resubmits it to the same queue."""

    name: str = "gpufrac"
    idle_reaping: bool = True

    def __post_init__(self) -> None:
        if self.allocation_policy not in ("binpack", "spread"):
            raise ValueError(f"allocation_policy: {self.allocation_policy!r} is not binpack or spread")
        bad = [r for r in self.resolvers if r not in RESOLVERS]
        if bad:
            raise ValueError(f"resolvers: unknown resolver(s) {bad}; choose from {list(RESOLVERS)}")

    @classmethod
    def from_config(cls, config: Config | None = None, **overrides: object) -> Gpufrac:
        """The model with the agent's own defaults, read from the one config module."""
        c = config or Config(node_name="capacity-study")
        values: dict[str, object] = {
            "allocation_policy": c.allocation_policy,
            "resolvers": tuple(c.resolvers),
            "wait_timeout_s": c.wait_timeout,
            "evict_idle_threshold_s": c.evict_idle_threshold,
            "host_ram_budget_gib": c.swap.host_ram_budget / _GiB,
            "idle_timeout_s": c.idle.idle_timeout,
        }
        values.update(overrides)
        return cls(**values)  # type: ignore[arg-type]

    def reservation(self, pod: PodSpec, node: Node) -> float:
        return pod.request_gib


def default_strategies() -> list[Strategy]:
    return [
        WholeGpus(),
        TimeSlicing(),
        StaticFractions(),
        Gpufrac.from_config(),
        # Same, with the agent's other allocation policy: leaves every GPU burst headroom.
        Gpufrac.from_config(name="gpufrac_spread", allocation_policy="spread"),
    ]
