"""The idle reaper's decisions and the activity signal, on an injected clock.

Real parts: the allocation ledger writing real container directories, usage slots
written through gpufrac.memguard.abi.UsageFile as the shim writes them, pod
policies from the real annotation parser. The apiserver side (Events, the
Eviction API) is recorded here and exercised for real in
tests/agent/idle/test_idle_reaping.py against kmock's emulator."""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest

from gpufrac.agent.booking.ledger import ContainerAlloc, Ledger
from gpufrac.agent.gpu import activity
from gpufrac.agent.gpu.activity import ActivityTracker
from gpufrac.agent.idle.reaper import IdleReaper
from gpufrac.agent.idle.view import action_reason
from gpufrac.agent.kube.evict import EvictOutcome, EvictResult
from gpufrac.agent.kube.objref import ObjectRef
from gpufrac.agent.kube.podcache import PodInfo
from gpufrac.agent.metrics.registry import Metrics
from gpufrac.agent.processes.proc import proc_identity
from gpufrac.core import annotations
from gpufrac.core.annotations import ContainerPolicy
from gpufrac.core.config import Config, ConfigError, GiB, load
from gpufrac.core.gpus import Gpu, Inventory
from gpufrac.core.slices import MEMORY, device_id
from gpufrac.core.units import format_duration, parse_duration
from gpufrac.memguard import abi

pytestmark = pytest.mark.unit

GPU = "GPU-00000000-0000-0000-0000-000000000000"


class FakeClock:
    """Monotonic time in seconds that only moves when told; wall time moves with it."""

    def __init__(self) -> None:
        self.t = 1000.0

    def monotonic(self) -> float:
        return self.t

    def monotonic_ns(self) -> int:
        return int(self.t * 1e9)

    def time(self) -> float:
        return 1e6 + (self.t - 1000.0)  # exact in binary for the quarter-second steps used

    def advance(self, seconds: float) -> None:
        self.t += seconds


@dataclass
class Events:
    got: list[tuple[str, str, str, str]] = field(default_factory=list)  # pod, type, reason, message

    def record(self, ref: ObjectRef, type_: str, reason: str, message: str) -> None:
        self.got.append((ref.name, type_, reason, message))

    def reasons(self, pod: str) -> list[str]:
        return [r for p, _, r, _ in self.got if p == pod]

    def message(self, pod: str, reason: str) -> str:
        return next(m for p, _, r, m in self.got if p == pod and r == reason)


class Pods:
    def __init__(self) -> None:
        self.by_name: dict[tuple[str, str], PodInfo] = {}

    def get(self, namespace: str, name: str) -> PodInfo | None:
        return self.by_name.get((namespace, name))


class Identity:
    """The two lookups the reaper makes of gpufrac.agent.booking.pods.PodIdentity."""

    def __init__(self) -> None:
        self.pods = Pods()
        self.events = Events()
        self.policies: dict[str, ContainerPolicy] = {}

    def policy(self, key: str) -> ContainerPolicy | None:
        return self.policies.get(key)


class Evictor:
    """Answers evictions from a script: one outcome per call, the last one repeating."""

    def __init__(self, *outcomes: EvictResult) -> None:
        self.outcomes = list(outcomes) or [EvictResult.EVICTED]
        self.calls: list[tuple[float, str]] = []
        self.clock: FakeClock | None = None

    async def evict(self, namespace: str, name: str, uid: str) -> EvictOutcome:
        assert self.clock is not None
        self.calls.append((self.clock.monotonic(), name))
        result = self.outcomes.pop(0) if len(self.outcomes) > 1 else self.outcomes[0]
        detail = (
            "Cannot evict pod as it would violate the pod's disruption budget."
            if result is EvictResult.BLOCKED
            else ""
        )
        return EvictOutcome(result, detail)


class Node:
    def __init__(
        self, tmp_path: Path, idle: dict[str, Any], evictor: Evictor | None, swapper: Any = None
    ) -> None:
        self.cfg = load(overrides={"paths": {"stateDir": str(tmp_path / "state")}, "idle": idle})
        inv = Inventory(gpus=[Gpu(0, GPU, "Sim", 41 * GiB, "0000:01:00.0", 0, (), 0)])
        self.ledger = Ledger(self.cfg, inv)
        self.clock = FakeClock()
        self.ident = Identity()
        self.evictor = evictor
        if evictor is not None:
            evictor.clock = self.clock
        self.tracker = ActivityTracker(clock=self.clock)
        self.metrics = Metrics()
        self.reaper = IdleReaper(
            self.cfg,
            self.ledger,
            self.tracker,
            self.ident,
            evictor=evictor,
            swapper=swapper,
            metrics=self.metrics,
            clock=self.clock,
        )
        self._slice = 0
        self.usage: dict[str, abi.UsageFile] = {}

    def pod(
        self, name: str, ann: dict[str, str] | None = None, namespace: str = "default", gib: int = 2
    ) -> ContainerAlloc:
        """A pod bound to an allocation, with its policy from its annotations, and one live
        process (this test process) holding memory in its usage file."""
        ids = [device_id(GPU, MEMORY, self._slice + i) for i in range(gib)]
        self._slice += gib
        alloc = self.ledger.allocate(MEMORY, ids)
        alloc.created = self.clock.time()  # allocated "now" on the test's clock
        uid = f"uid-{name}"
        self.ledger.bind(alloc.key, namespace, name, "main", uid)
        info = PodInfo(namespace, name, uid, "node-a", annotations=dict(ann or {}), containers=("main",))
        self.ident.pods.by_name[(namespace, name)] = info
        result = annotations.parse_policy(
            info.annotations,
            container="main",
            request_bytes=alloc.request_bytes,
            gpu_allocatable=40 * GiB,
            cfg=self.cfg,
        )
        self.ident.policies[alloc.key] = result.policy
        u = self.usage[alloc.key] = abi.UsageFile(alloc.directory)
        s = u.usage.slots[0]
        s.start_time = proc_identity(os.getpid())[1]  # type: ignore[index]
        s.used_bytes = 1 << 30
        s.last_activity_ns = self.clock.monotonic_ns()  # the shim stamps the claim
        s.pid = os.getpid()
        return alloc

    def launch(self, alloc: ContainerAlloc) -> None:
        """What the shim does on a kernel launch: bump the counter, stamp the time."""
        s = self.usage[alloc.key].usage.slots[0]
        s.launches += 1
        s.last_activity_ns = self.clock.monotonic_ns()

    def run(self, seconds: float, step: float = 0.5) -> None:
        """Let `seconds` pass, with a reaper pass every `step`."""
        end = self.clock.t + seconds
        while self.clock.t < end - 1e-9:
            self.clock.advance(step)
            asyncio.run(self.reaper.tick())

    def close(self) -> None:
        for u in self.usage.values():
            u.close()
        for a in self.ledger.containers():
            self.ledger.release(a.key)


@pytest.fixture
def make_node(tmp_path: Path) -> Iterator[Any]:
    made: list[Node] = []

    def make(evictor: Evictor | None = None, swapper: Any = None, **idle: Any) -> Node:
        base = {"idleTimeout": "10s", "gracePeriod": "5s", "action": "evict", "interval": "1s"}
        node = Node(tmp_path / f"n{len(made)}", {**base, **idle}, evictor, swapper)
        made.append(node)
        return node

    yield make
    for n in made:
        n.close()


# -- activity --------------------------------------------------------------------------------------


def test_idle_seconds_count_from_the_last_launch_and_survive_process_exit(make_node: Any) -> None:
    n = make_node()
    a = n.pod("nb")
    n.run(4)
    assert n.tracker.idle_seconds(a.key) == pytest.approx(4.0)
    n.launch(a)
    n.run(1)
    assert n.tracker.idle_seconds(a.key) == pytest.approx(1.0)
    assert n.tracker.get(a.key).launches == 1  # type: ignore[union-attr]
    # The process exits: the shim zeroes its slot. What the tracker saw stays.
    slot = n.usage[a.key].usage.slots[0]
    slot.pid, slot.launches, slot.last_activity_ns = 0, 0, 0
    n.run(2)
    act = n.tracker.get(a.key)
    assert act is not None and act.processes == 0
    assert act.idle_seconds() == pytest.approx(3.0)


def test_a_counter_that_moves_is_work_even_with_a_stale_stamp(make_node: Any) -> None:
    n = make_node()
    a = n.pod("nb")
    n.run(5)
    # A launch whose time stamp comes from another clock domain (far in the past).
    slot = n.usage[a.key].usage.slots[0]
    slot.launches += 1
    slot.last_activity_ns = 1
    n.run(1, step=1)
    assert n.tracker.idle_seconds(a.key) == 0.0
    n.run(2)
    assert n.tracker.idle_seconds(a.key) == 2.0


def test_an_unreadable_usage_file_does_not_reset_the_idle_time(
    make_node: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    n = make_node()
    a = n.pod("nb")
    n.launch(a)
    n.run(4)
    assert n.tracker.idle_seconds(a.key) == pytest.approx(4.0)
    read_usage = abi.read_usage

    def torn(directory: Any) -> Any:
        if str(directory) == a.directory:
            raise abi.FormatError("usage: short read")
        return read_usage(directory)

    # One poll cannot read the file: it says nothing, so what was known stands...
    monkeypatch.setattr(activity.abi, "read_usage", torn)
    n.run(0.5)
    assert n.tracker.idle_seconds(a.key) == pytest.approx(4.5)
    # ...and the next good read does not take the old launch counter for new work.
    monkeypatch.setattr(activity.abi, "read_usage", read_usage)
    n.run(1)
    assert n.tracker.idle_seconds(a.key) == pytest.approx(5.5)
    assert n.tracker.get(a.key).launches == 1  # type: ignore[union-attr]


# -- who is reaped ---------------------------------------------------------------------------------


def test_idle_interactive_pod_is_warned_then_evicted_after_the_grace_period(make_node: Any) -> None:
    ev = Evictor()
    n = make_node(ev)
    n.pod("nb", {annotations.WORKLOAD_CLASS: "interactive"})
    n.run(9.5)
    assert n.ident.events.reasons("nb") == []
    n.run(0.5)  # idle 10 s = the node's idle timeout
    assert n.ident.events.reasons("nb") == ["IdleWarning"]
    warning = n.ident.events.message("nb", "IdleWarning")
    assert "no GPU work for 10s" in warning and "will evict the pod in 5s" in warning
    assert "idle-timeout 10s from node config idle.idleTimeout" in warning
    n.run(4.5)
    assert ev.calls == []  # still in the grace period
    n.run(0.5)
    assert [c[1] for c in ev.calls] == ["nb"]
    assert n.ident.events.reasons("nb") == ["IdleWarning", "IdleEvicted"]
    record = n.ident.events.message("nb", "IdleEvicted")
    assert "no GPU work for 15s" in record and "evicted through the Eviction API" in record
    assert n.reaper.records == {"IdleEvicted": 1}
    reaps = n.metrics.registry.get_sample_value
    assert reaps("gpufrac_idle_reaps_total", {"action": "evict", "reason": "idle"}) == 1
    n.run(5)
    assert len(ev.calls) == 1  # once


def test_work_in_the_grace_period_cancels(make_node: Any) -> None:
    ev = Evictor()
    n = make_node(ev)
    a = n.pod("nb", {annotations.WORKLOAD_CLASS: "interactive"})
    n.run(12)
    assert n.ident.events.reasons("nb") == ["IdleWarning"]
    n.launch(a)
    n.run(9)
    assert ev.calls == []
    assert n.ident.events.reasons("nb") == ["IdleWarning", "IdleCancelled"]
    assert "GPU work resumed; the pending eviction is cancelled" in n.ident.events.message(
        "nb", "IdleCancelled"
    )
    # A new idle episode starts from the launch: warned again at 10 s idle, evicted 5 s later.
    n.run(6)
    assert n.ident.events.reasons("nb")[-2:] == ["IdleWarning", "IdleEvicted"]
    assert len(ev.calls) == 1


def test_batch_inference_and_exempt_pods_are_never_reaped(make_node: Any) -> None:
    ev = Evictor()
    n = make_node(ev, exemptNamespaces=["notebooks-vip"])
    n.pod("batch")  # no class annotation: batch
    n.pod("server", {annotations.WORKLOAD_CLASS: "inference"})
    n.pod("vip", {annotations.WORKLOAD_CLASS: "interactive"}, namespace="notebooks-vip")
    n.pod("pinned", {annotations.WORKLOAD_CLASS: "interactive", annotations.IDLE_EXEMPT: "true"})
    n.pod("nb", {annotations.WORKLOAD_CLASS: "interactive"})
    n.run(60)
    assert [c[1] for c in ev.calls] == ["nb"]
    assert {p for p, *_ in n.ident.events.got} == {"nb"}


def test_reap_classes_extend_reaping_to_batch(make_node: Any) -> None:
    ev = Evictor()
    n = make_node(ev, reapClasses=["batch"])
    n.pod("batch")
    n.pod("server", {annotations.WORKLOAD_CLASS: "inference"})
    n.run(20)
    assert [c[1] for c in ev.calls] == ["batch"]


def test_a_pod_is_not_reaped_before_its_own_idle_timeout(make_node: Any) -> None:
    """Memory held, CPU-only for a long phase: the annotation's timeout rules, not the node's."""
    ev = Evictor()
    n = make_node(ev)
    n.pod("nb", {annotations.WORKLOAD_CLASS: "interactive", annotations.IDLE_TIMEOUT: "1m"})
    n.run(59.5)
    assert n.ident.events.got == [] and ev.calls == []
    n.run(0.5)
    assert n.ident.events.reasons("nb") == ["IdleWarning"]
    assert "idle-timeout 1m from annotation gpufrac.dev/idle-timeout" in n.ident.events.message(
        "nb", "IdleWarning"
    )
    n.run(5)
    assert len(ev.calls) == 1


def test_max_runtime_reaps_a_busy_pod_at_its_limit(make_node: Any) -> None:
    ev = Evictor()
    n = make_node(ev, maxRuntime="1h")
    a = n.pod("nb", {annotations.WORKLOAD_CLASS: "interactive", annotations.MAX_RUNTIME: "30s"})
    for _ in range(24):  # busy all along
        n.launch(a)
        n.run(1)
    assert n.ident.events.reasons("nb") == []
    n.launch(a)
    n.run(1)  # 25 s: grace (5 s) before the limit
    assert n.ident.events.reasons("nb") == ["MaxRuntimeWarning"]
    assert "max-runtime 30s from annotation gpufrac.dev/max-runtime" in n.ident.events.message(
        "nb", "MaxRuntimeWarning"
    )
    for _ in range(4):
        n.launch(a)
        n.run(1)
    assert ev.calls == []  # work does not cancel a runtime limit, nor does it come early
    n.launch(a)
    n.run(1)
    assert [c[1] for c in ev.calls] == ["nb"]
    assert n.ident.events.reasons("nb") == ["MaxRuntimeWarning", "MaxRuntimeEvicted"]
    reaps = n.metrics.registry.get_sample_value
    assert reaps("gpufrac_idle_reaps_total", {"action": "evict", "reason": "max_runtime"}) == 1
    assert reaps("gpufrac_idle_reaps_total", {"action": "evict", "reason": "idle"}) == 0


@pytest.mark.parametrize("age", [27.0, 3600.0])
def test_a_pod_met_inside_the_max_runtime_window_still_gets_the_grace_period(
    make_node: Any, age: float
) -> None:
    """maxRuntime turned on (or the agent restarted) with pods near or long past their limit:
    each is warned a whole grace period before the action, not evicted on sight."""
    ev = Evictor()
    n = make_node(ev)
    a = n.pod("nb", {annotations.WORKLOAD_CLASS: "interactive", annotations.MAX_RUNTIME: "30s"})
    a.created = n.clock.time() - age
    n.run(0.5)
    assert n.ident.events.reasons("nb") == ["MaxRuntimeWarning"]
    assert "will evict the pod in 5s" in n.ident.events.message("nb", "MaxRuntimeWarning")
    assert ev.calls == []
    n.run(4.5)
    assert ev.calls == []
    n.run(0.5)
    assert [c[1] for c in ev.calls] == ["nb"]
    assert n.ident.events.reasons("nb") == ["MaxRuntimeWarning", "MaxRuntimeEvicted"]


@pytest.mark.parametrize(
    ("action", "records"),
    [
        ("swap", ["MaxRuntimeNotify", "IdleWarning", "IdleSwapped"]),
        ("notify", ["MaxRuntimeNotify", "IdleWarning", "IdleNotify"]),
        ("evict", ["MaxRuntimeEvicted"]),  # the pod is on its way out: nothing more
    ],
)
def test_an_idle_pod_is_still_reaped_after_its_max_runtime_notice(
    make_node: Any, action: str, records: list[str]
) -> None:
    swapped: list[str] = []

    async def swapper(alloc: ContainerAlloc, reason: str) -> tuple[bool, str]:
        swapped.append(alloc.key)
        return True, "swapped 1Gi"

    ev = Evictor()
    n = make_node(ev, swapper, action=action, maxRuntime="8s")
    a = n.pod("nb", {annotations.WORKLOAD_CLASS: "interactive"})
    n.run(8)  # warned at 3 s, the limit at 8 s: swapping does not end a runtime, so a notice
    assert n.ident.events.reasons("nb") == ["MaxRuntimeWarning", records[0]]
    n.run(22)  # idle 10 s at 10 s, the action 5 s later; the max-runtime notice is not repeated
    assert n.ident.events.reasons("nb") == ["MaxRuntimeWarning", *records]
    assert swapped == ([a.key] if action == "swap" else [])
    assert len(ev.calls) == (1 if action == "evict" else 0)


def test_the_most_lenient_policy_of_a_pods_containers_wins(make_node: Any) -> None:
    """Containers of one pod that disagree (a policy resolved before an annotation changed):
    each limit takes its most lenient value, and 0 (off) is the most lenient of all."""
    ev = Evictor()
    n = make_node(ev, maxRuntime="20s")
    a = n.pod("nb", {annotations.WORKLOAD_CLASS: "interactive"})
    side = n.ledger.allocate(MEMORY, [device_id(GPU, MEMORY, n._slice)])
    n._slice += 1
    side.created = a.created
    n.ledger.bind(side.key, "default", "nb", "side", "uid-nb")
    n.usage[side.key] = abi.UsageFile(side.directory)
    # main: idle-timeout 10 s, max-runtime 20 s; side: no idle-timeout, max-runtime 40 s.
    n.ident.policies[side.key] = replace(n.ident.policies[a.key], idle_timeout=0.0, max_runtime=40.0)
    n.run(34.5)
    assert n.ident.events.got == [] and ev.calls == []
    n.run(0.5)
    assert n.ident.events.reasons("nb") == ["MaxRuntimeWarning"]
    assert "max-runtime 40s" in n.ident.events.message("nb", "MaxRuntimeWarning")
    n.run(5)
    assert [c[1] for c in ev.calls] == ["nb"]


def test_dry_run_reports_and_changes_nothing(make_node: Any, caplog: pytest.LogCaptureFixture) -> None:
    ev = Evictor()
    n = make_node(ev, dryRun=True)
    n.pod("nb", {annotations.WORKLOAD_CLASS: "interactive"})
    with caplog.at_level("WARNING", logger="gpufrac.agent.idle.reaper"):
        n.run(30)
    assert ev.calls == []
    assert n.ident.events.reasons("nb") == ["IdleWarning", "IdleDryRun"]
    assert "dry run: would evict the pod" in n.ident.events.message("nb", "IdleDryRun")
    assert any("would evict" in r.getMessage() for r in caplog.records)
    reaps = n.metrics.registry.get_sample_value
    assert reaps("gpufrac_idle_reaps_total", {"action": "dry_run", "reason": "idle"}) == 1
    assert reaps("gpufrac_idle_reaps_total", {"action": "evict", "reason": "idle"}) == 0


def test_a_pdb_refusal_is_retried_with_back_off_and_never_forced(make_node: Any) -> None:
    ev = Evictor(EvictResult.BLOCKED, EvictResult.BLOCKED, EvictResult.BLOCKED, EvictResult.EVICTED)
    n = make_node(ev)
    n.pod("nb", {annotations.WORKLOAD_CLASS: "interactive"})
    n.run(60, step=0.25)
    times = [t for t, _ in ev.calls]
    assert len(times) == 4
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert gaps == sorted(gaps) and gaps[0] >= 1.0 and gaps[-1] >= 4.0  # doubling from the 1 s interval
    reasons = n.ident.events.reasons("nb")
    assert reasons.count("IdleEvictionBlocked") == 3 and reasons[-1] == "IdleEvicted"
    assert "disruption budget" in n.ident.events.message("nb", "IdleEvictionBlocked")


def test_notify_posts_a_record_once_per_idle_episode(make_node: Any) -> None:
    n = make_node(None, action="notify")
    a = n.pod("nb", {annotations.WORKLOAD_CLASS: "interactive"})
    n.run(40)
    assert n.ident.events.reasons("nb") == ["IdleWarning", "IdleNotify"]
    assert "notified only" in n.ident.events.message("nb", "IdleNotify")
    n.launch(a)
    n.run(16)
    assert n.ident.events.reasons("nb") == ["IdleWarning", "IdleNotify", "IdleWarning", "IdleNotify"]


def test_swap_without_a_swap_resolver_says_so_and_notifies(make_node: Any) -> None:
    n = make_node(None, action="swap")
    n.pod("nb", {annotations.WORKLOAD_CLASS: "interactive"})
    n.run(20)
    assert n.ident.events.reasons("nb") == ["IdleWarning", "IdleNotify"]
    assert "swap to host RAM is unavailable" in n.ident.events.message("nb", "IdleNotify")


def test_swap_goes_through_the_swap_resolver(make_node: Any) -> None:
    swapped: list[str] = []
    reasons: list[str] = []

    async def swapper(alloc: ContainerAlloc, reason: str) -> tuple[bool, str]:
        swapped.append(alloc.key)
        reasons.append(reason)
        return True, "swapped 1Gi"

    n = make_node(None, swapper, action="swap")
    a = n.pod("nb", {annotations.WORKLOAD_CLASS: "interactive"})
    n.run(20)
    assert swapped == [a.key]
    # The swap's own Event says why: the idle time and the policy that called for it.
    assert "no GPU work for" in reasons[0] and "idle-timeout" in reasons[0]
    assert n.ident.events.reasons("nb") == ["IdleWarning", "IdleSwapped"]


def test_pods_whose_annotations_are_unknown_are_left_alone(make_node: Any) -> None:
    ev = Evictor()
    n = make_node(ev)
    a = n.pod("nb", {annotations.WORKLOAD_CLASS: "interactive"})
    n.ident.policies[a.key] = annotations.safe_policy(a.request_bytes, n.cfg)  # pod not resolved yet
    n.run(30)
    assert ev.calls == [] and n.ident.events.got == []


# -- config and words -------------------------------------------------------------------------------


def test_unknown_reap_class_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"idle.reapClasses: unknown workload class\(es\) \['notebook'\]"):
        load(overrides={"idle": {"reapClasses": ["notebook"]}})
    assert load(overrides={"idle": {"reapClasses": ["batch"]}}).idle.reap_classes == ["batch"]


def test_bad_idle_exempt_annotation_is_reported_and_not_exempt() -> None:
    r = annotations.parse_policy(
        {annotations.IDLE_EXEMPT: "yes"},
        container="main",
        request_bytes=GiB,
        gpu_allocatable=8 * GiB,
        cfg=Config(),
    )
    assert not r.policy.idle_exempt
    assert [p.key for p in r.problems] == [annotations.IDLE_EXEMPT]


@pytest.mark.parametrize("seconds", [0.25, 1, 59, 60, 3725, 86400])
def test_durations_print_as_they_parse(seconds: float) -> None:
    assert parse_duration(format_duration(seconds)) == seconds


def test_action_reasons() -> None:
    assert action_reason("idle", "evict") == "IdleEvicted"
    assert action_reason("max-runtime", "dry-run") == "MaxRuntimeDryRun"
