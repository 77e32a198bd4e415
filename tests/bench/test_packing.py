"""The capacity study (bench/packing): a seeded trace, four strategy models, one replay.

The invariants here are what makes its table trustworthy: each strategy model obeys
the rules of the mechanism it stands for, on every tick."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.packing import main
from bench.packing.report import BEGIN, END, run_study, update_doc, write_json
from bench.packing.sim import Replay, replay
from bench.packing.strategies import (
    Gpufrac,
    StaticFractions,
    Strategy,
    TimeSlicing,
    WholeGpus,
    default_strategies,
)
from bench.packing.trace import HOUR_S, Node, PodSpec, Trace, generate

pytestmark = pytest.mark.unit

EPS = 1e-6
TICK = 30.0
# A small, contended day: 2 GPUs, 4 hours, same mix as the study.
SMALL = {
    "horizon_s": 4 * HOUR_S,
    "node": Node(gpus=2),
    "always_on_inference": 3,
    "daytime_inference": 5,
    "notebooks": 14,
    "batch_jobs": 10,
}


def small_trace(seed: int = 1) -> Trace:
    return generate(seed, **SMALL)


def pod(
    name: str,
    demand: list[float],
    *,
    request: float,
    limit: float | None = None,
    arrival: float = 0.0,
    kind: str = "batch",
    priority: int = 100,
    active: list[bool] | None = None,
    swappable: bool = False,
    preemptible: bool = True,
) -> PodSpec:
    return PodSpec(
        name,
        kind,  # type: ignore[arg-type]
        arrival,
        duration_s=len(demand) * TICK if kind != "batch" else 10 * HOUR_S,
        request_gib=request,
        limit_gib=limit if limit is not None else max([*demand, request]),
        priority=priority,
        preemptible=preemptible,
        swappable=swappable,
        demand=tuple(demand),
        active=tuple(active or ()),
    )


def crafted(pods: list[PodSpec], *, gpus: int = 1, gib: float = 10.0, ticks: int = 20) -> Trace:
    return Trace(0, TICK, ticks * TICK, Node(gpus=gpus, gpu_memory_gib=gib, reserved_gib=0.0), tuple(pods))


# ---- the trace -----------------------------------------------------------------------------------
def test_same_seed_same_trace_and_same_results() -> None:
    a, b = small_trace(3), small_trace(3)
    assert a == b
    for s in default_strategies():
        ra, rb = replay(a, s), replay(b, s)
        assert ra.to_json() == rb.to_json(), s.name
        assert ra.events == rb.events, s.name


def test_different_seeds_give_different_days() -> None:
    assert small_trace(3).pods != small_trace(4).pods


def test_trace_has_the_three_workloads_with_requests_below_peak() -> None:
    t = generate(7)
    kinds = {p.kind for p in t.pods}
    assert kinds == {"inference", "notebook", "batch"}
    for p in t.pods:
        assert max(p.demand) <= p.limit_gib + EPS
        assert p.request_gib == int(p.request_gib)  # gpufrac.dev/gpu-memory is whole units
    # Inference and notebooks ask for less than their peak: the case gpufrac is for.
    assert all(p.request_gib < p.limit_gib for p in t.pods if p.kind == "notebook")
    assert any(p.request_gib < p.limit_gib for p in t.pods if p.kind == "inference")
    # Notebooks idle for long stretches, holding memory while idle.
    nb = next(p for p in t.pods if p.kind == "notebook" and not all(p.active))
    idle_held = [d for d, on in zip(nb.demand, nb.active, strict=True) if not on]
    assert idle_held and min(idle_held) > 0


def test_bad_pod_spec_is_refused_with_its_name() -> None:
    with pytest.raises(ValueError, match=r"pod x: need 0 < request \(8.0\) <= limit \(4.0\)"):
        pod("x", [1.0], request=8.0, limit=4.0)
    with pytest.raises(ValueError, match=r"pod y: demand 9\.0 GiB exceeds its limit 4\.0"):
        pod("y", [9.0], request=2.0, limit=4.0)


def test_unknown_resolver_is_refused() -> None:
    with pytest.raises(ValueError, match=r"resolvers: unknown resolver\(s\) \['pray'\]"):
        Gpufrac.from_config(resolvers=("swap", "pray"))


def test_gpufrac_model_uses_the_agent_config_defaults() -> None:
    from gpufrac.core.config import Config

    c = Config(node_name="x")
    g = Gpufrac.from_config(c)
    assert list(g.resolvers) == c.resolvers
    assert g.wait_timeout_s == c.wait_timeout
    assert g.idle_timeout_s == c.idle.idle_timeout
    assert g.allocation_policy == c.allocation_policy


# ---- strategy invariants on a generated day ----------------------------------------------------------
def _replay_checked(strategy: Strategy, trace: Trace, check) -> Replay:  # type: ignore[no-untyped-def]
    rp = Replay(trace, strategy, observer=check)
    rp.run()
    return rp


def test_whole_gpus_never_share_a_gpu() -> None:
    seen = []

    def check(k: int, rp: Replay) -> None:
        for pods in rp.gpus:
            assert len(pods) <= 1
        seen.append(sum(len(p) for p in rp.gpus))

    rp = _replay_checked(WholeGpus(), small_trace(), check)
    assert max(seen) == rp.node.gpus  # the node filled up: the rule was exercised
    r = rp.result.to_json()
    assert r["oom_crashes"] == 0 and r["pods_served"] < len(small_trace().pods)


def test_static_fractions_never_overcommit_and_never_oom() -> None:
    def check(k: int, rp: Replay) -> None:
        for pods in rp.gpus:
            assert sum(p.reserved for p in pods) <= rp.node.allocatable_gib + EPS
            assert sum(p.held for p in pods) <= rp.node.allocatable_gib + EPS
            for p in pods:
                assert p.reserved == p.spec.limit_gib  # request = peak
                assert p.held == pytest.approx(p.target)  # always gets what it uses

    rp = _replay_checked(StaticFractions(), small_trace(), check)
    r = rp.result.to_json()
    assert r["oom_crashes"] == r["evictions"] == r["waits"] == r["burst_denied"] == 0
    assert r["pods_not_served"] > 0  # reserving peaks turned pods away on this day


def _check_gpufrac(k: int, rp: Replay) -> None:
    alloc = rp.node.allocatable_gib
    for pods in rp.gpus:
        assert sum(p.reserved for p in pods) <= alloc + EPS  # device plugin: requests fit
        assert sum(p.held for p in pods) <= alloc + EPS  # never beyond the GPU
        assert sum(p.claim for p in pods) <= alloc + EPS  # bursts only from unclaimed memory
        for p in pods:
            assert p.held <= p.spec.limit_gib + EPS  # never above limit
            if not p.down and p.active:
                # The guarantee: up to its request a working pod has all it asks for.
                assert p.held >= min(p.target, p.reserved) - EPS
    assert rp.host_swapped_gib <= rp.strategy.host_ram_budget_gib + EPS


@pytest.mark.parametrize("policy", ["binpack", "spread"])
def test_gpufrac_respects_capacity_limits_and_guarantees(policy: str) -> None:
    rp = _replay_checked(Gpufrac.from_config(allocation_policy=policy), small_trace(), _check_gpufrac)
    r = rp.result
    # The day was contended enough to exercise the resolvers.
    assert r.evictions + r.swaps + r.waits > 0
    for e in r.events:
        if e.what in ("evicted", "swap_out", "evicted_for_guarantee"):
            assert e.gib > 0, e  # only pods holding burst memory are ever reclaimed


# ---- crafted scenarios -------------------------------------------------------------------------------------
def test_time_slicing_crashes_the_pod_whose_allocation_overflows() -> None:
    steady = pod("steady", [6.0] * 20, request=6.0)
    grows = pod("grows", [3.0] * 5 + [6.0] * 15, request=3.0)
    r = replay(crafted([steady, grows]), TimeSlicing())
    assert r.oom_crashes > 0
    crashed = {e.pod for e in r.events if e.what == "oom_crash"}
    assert crashed == {"grows"}
    # The control: the same pods within capacity never crash.
    fits = pod("fits", [3.0] * 5 + [4.0] * 15, request=3.0)
    assert replay(crafted([steady, fits]), TimeSlicing()).oom_crashes == 0


def test_static_fractions_queue_what_time_slicing_would_crash() -> None:
    steady = pod("steady", [6.0] * 20, request=6.0)
    grows = pod("grows", [3.0] * 5 + [6.0] * 15, request=3.0)
    r = replay(crafted([steady, grows]), StaticFractions(), max_queue_wait_s=60.0)
    assert r.oom_crashes == 0
    assert r.pods_served == 1  # 6 + 6 > 10: the second pod is never admitted


def test_gpufrac_evicts_a_lower_priority_burst_for_a_higher_priority_one() -> None:
    lo = pod("lo", [8.0] * 20, request=3.0, priority=100)
    hi = pod("hi", [3.0] * 4 + [7.0] * 16, request=3.0, priority=1000)
    rp = _replay_checked(Gpufrac.from_config(), crafted([lo, hi]), _check_gpufrac)
    ev = [e for e in rp.result.events if e.what == "evicted"]
    assert ev and all(e.pod == "lo" and e.by == "hi" for e in ev)
    # Reversed priorities: the burst cannot evict, so it waits and is then denied.
    lo2 = pod("lo", [8.0] * 20, request=3.0, priority=1000)
    hi2 = pod("hi", [3.0] * 4 + [7.0] * 16, request=3.0, priority=100)
    r2 = _replay_checked(Gpufrac.from_config(), crafted([lo2, hi2]), _check_gpufrac).result
    assert r2.evictions == 0 and r2.waits >= 1 and r2.burst_denied >= 1


def test_gpufrac_reclaims_burst_for_a_newcomers_guarantee() -> None:
    burster = pod("burster", [9.0] * 20, request=2.0, priority=1000)
    # Arrives later; its 6 GiB guarantee is in the burster's hands and must come back.
    newcomer = pod("newcomer", [6.0] * 10, request=6.0, arrival=5 * TICK, priority=100)
    rp = _replay_checked(Gpufrac.from_config(), crafted([burster, newcomer]), _check_gpufrac)
    assert rp.result.evictions_for_guarantee == 1
    assert [e.pod for e in rp.result.events if e.what == "evicted_for_guarantee"] == ["burster"]


def test_gpufrac_never_reclaims_memory_within_a_request() -> None:
    # Both stay within their requests: nothing may be taken from them, whatever bursts.
    a = pod("a", [4.0] * 20, request=4.0, priority=100)
    b = pod("b", [3.0] * 20, request=3.0, priority=100)
    c = pod("c", [1.0] * 3 + [8.0] * 17, request=1.0, limit=8.0, priority=1000)
    r = _replay_checked(Gpufrac.from_config(), crafted([a, b, c]), _check_gpufrac).result
    assert r.evictions == r.swaps == 0
    assert r.burst_denied >= 1  # c wanted 8 but only 2 were unclaimed


def test_gpufrac_swaps_an_idle_notebook_and_brings_it_back() -> None:
    on = [True] * 4 + [False] * 8 + [True] * 8
    nb = pod("nb", [6.0] * 20, request=2.0, kind="notebook", priority=500, active=on, swappable=True)
    srv = pod("srv", [2.0] * 6 + [7.0] * 14, request=2.0, priority=1000, kind="inference")
    rp = _replay_checked(Gpufrac.from_config(resolvers=("swap", "wait")), crafted([nb, srv]), _check_gpufrac)
    r = rp.result
    assert r.swaps == 1 and r.swap_ins == 1 and r.evictions == 0
    assert [e.pod for e in r.events if e.what == "swap_out"] == ["nb"]


def test_gpufrac_reaps_idle_notebooks_and_the_user_resubmits() -> None:
    active = [True] * 2 + [False] * 10 + [True] * 8
    nb = pod("nb", [5.0] * 20, request=2.0, kind="notebook", priority=500, active=active, swappable=True)
    g = Gpufrac.from_config(idle_timeout_s=4 * TICK)
    r = replay(crafted([nb]), g)
    assert r.idle_reaped == 1 and r.resubmitted == 1
    admits = [e for e in r.events if e.what == "admit"]
    assert admits[0].pod == "nb" and admits[1].pod.startswith("nb~")
    assert admits[1].tick == 12  # back when the session's next active stretch starts
    assert r.pods_served == 1  # the resubmission is the same user's pod, not a new one
    # Without reaping the idle notebook keeps its memory the whole time.
    assert replay(crafted([nb]), StaticFractions()).idle_reaped == 0


def test_a_pod_that_waits_too_long_is_not_served() -> None:
    hog = pod("hog", [10.0] * 20, request=10.0)
    late = pod("late", [5.0] * 20, request=5.0, arrival=TICK)
    r = replay(crafted([hog, late]), StaticFractions(), max_queue_wait_s=3 * TICK)
    assert r.pods_served == 1
    assert any(e.what == "not_served" and e.pod == "late" for e in r.events)


# ---- the report --------------------------------------------------------------------------------
REQUIRED = ("pods_served", "memory_utilisation", "oom_crashes", "waits", "evictions", "swaps")


def test_study_json_has_the_required_keys(tmp_path: Path) -> None:
    data = run_study(1, sensitivity_seeds=2, trace_kwargs=SMALL)
    out = tmp_path / "packing.json"
    write_json(data, out)
    got = json.loads(out.read_text())
    assert got["seed"] == 1
    assert got["trace"]["pods"] == len(small_trace(1).pods)
    assert set(got["strategies"]) == {
        "whole_gpus",
        "time_slicing",
        "static_fractions",
        "gpufrac",
        "gpufrac_spread",
    }
    for name, r in got["strategies"].items():
        for key in REQUIRED:
            assert key in r, (name, key)
        assert 0 <= r["memory_utilisation"] <= 1
    assert got["sensitivity"]["seeds"] == [1, 2]


def test_main_writes_json_and_refuses_bad_arguments(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r" / "packing.json"
    assert main(["--seed", "5", "--sensitivity-seeds", "1", "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["seed"] == 5 and "time_slicing" in got["strategies"]
    assert "| gpufrac |" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["--sensitivity-seeds", "0", "--out", str(out)])
    assert e.value.code == 2
    assert "--sensitivity-seeds: 0 must be at least 1" in capsys.readouterr().err


def test_doc_update_replaces_only_the_generated_block(tmp_path: Path) -> None:
    doc = tmp_path / "study.md"
    doc.write_text(f"# Title\nprose before\n{BEGIN}\nold table\n{END}\nprose after\n")
    update_doc(doc, run_study(1, sensitivity_seeds=1, trace_kwargs=SMALL))
    text = doc.read_text()
    assert "old table" not in text and "prose before" in text and "prose after" in text
    assert "| gpufrac |" in text
    doc.write_text("no markers")
    with pytest.raises(ValueError, match="markers"):
        update_doc(doc, run_study(1, sensitivity_seeds=1, trace_kwargs=SMALL))
