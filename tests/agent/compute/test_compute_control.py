"""The compute controller (gpufrac.agent.compute.control): who may use what of a GPU, and the
launch paces that get them there, on a model of a time-sliced GPU.

The model: each container launches kernels as fast as its pace lets it (or at its own natural
rate), each kernel costing it `work` seconds of the GPU; the GPU gives each container with work
an equal turn (time slices between contexts), and nobody more than it asks. The controller never
sees `work`: kernels a thousand times larger (a bigger GPU, a bigger grid) must make no difference.
"""

from __future__ import annotations

import math

import pytest

from gpufrac.agent.compute import control as C

pytestmark = pytest.mark.unit


def tenants(*shares: float, strict: bool = False) -> list[C.Tenant]:
    return [C.Tenant(f"c{i}", s, strict) for i, s in enumerate(shares)]


def test_water_fill_divides_by_weight_and_hands_on_what_the_capped_leave() -> None:
    assert C.water_fill(1.0, {"a": 1, "b": 3}, {"a": 9, "b": 9}) == pytest.approx({"a": 0.25, "b": 0.75})
    # a's cap leaves 0.15 to b and c, split 1:2
    got = C.water_fill(1.0, {"a": 0.2, "b": 0.4, "c": 0.4}, {"a": 0.05, "b": 9, "c": 9})
    assert got == pytest.approx({"a": 0.05, "b": 0.475, "c": 0.475})
    assert C.water_fill(1.0, {"a": 0.5}, {"a": 0.3}) == pytest.approx({"a": 0.3})


def test_fair_targets_under_contention_idle_share_and_a_container_alone() -> None:
    ts = tenants(0.1, 0.9)
    # both busy, the GPU's time slices split 50/50 (saturated): held to 10/90
    assert C.allocate(ts, {"c0": 0.5, "c1": 0.5}, {}) == pytest.approx({"c0": 0.1, "c1": 0.9})
    # c1 idle: c0 (held back by a pace) may take everything c1 does not use
    paced = {"c0": C.Paced(pace_ns=10_000)}
    got = C.allocate(ts, {"c0": 0.1, "c1": 0.0}, paced)
    assert got == pytest.approx({"c0": 1.0, "c1": 0.0})  # nothing set aside for the idle
    # 25/25/50 with one 25 idle: the idle quarter goes to the busy in proportion (1:2)
    ts3 = tenants(0.25, 0.25, 0.5)
    paced3 = {"c0": C.Paced(pace_ns=10_000), "c2": C.Paced(pace_ns=10_000)}
    got = C.allocate(ts3, {"c0": 0.25, "c1": 0.0, "c2": 0.5}, paced3)
    assert got == pytest.approx({"c0": 1 / 3, "c1": 0.0, "c2": 2 / 3})


def test_strict_shares_are_caps_even_alone() -> None:
    ts = tenants(0.3, 0.7, strict=True)
    assert C.allocate(ts, {"c0": 1.0, "c1": 0.0}, {})["c0"] == pytest.approx(0.3)
    decisions = C.step(ts, {"c0": 1.0, "c1": 0.0}, {"c0": 1000}, 0.1, {})
    assert decisions[0].pace_ns > 0 and decisions[1].pace_ns == 0


def test_a_container_alone_in_fair_mode_is_never_paced() -> None:
    state: dict[str, C.Paced] = {}
    for _ in range(20):
        (d,) = C.step(tenants(0.1), {"c0": 1.0}, {"c0": 5000}, 0.1, state)
        assert d.pace_ns == 0 and d.target >= C.FULL


def test_overcommitted_shares() -> None:
    assert C.overcommitted(tenants(0.3, 0.7)) == 0.0
    assert C.overcommitted(tenants(0.6, 0.7)) == pytest.approx(1.3)


# ---------------------------------------------------------------- the closed loop, on a model GPU


def gpu_model(
    ts: list[C.Tenant], paces: dict[str, int], rate: dict[str, float], work: dict[str, float]
) -> dict[str, float]:
    """One period of a time-sliced GPU: each container's use (0..1)."""
    want = {}
    for t in ts:
        r = rate[t.key] if paces.get(t.key, 0) == 0 else min(rate[t.key], 1e9 / paces[t.key])
        want[t.key] = min(1.0, r * work[t.key])
    return C.water_fill(1.0, dict.fromkeys(want, 1.0), want)  # equal turns, none more than it asks


def run(
    ts: list[C.Tenant],
    rate: dict[str, float],
    work: dict[str, float],
    periods: int,
    period: float = 0.1,
    state: dict[str, C.Paced] | None = None,
) -> tuple[list[dict[str, float]], dict[str, C.Paced]]:
    state = {} if state is None else state
    history = []
    paces: dict[str, int] = {k: p.pace_ns for k, p in state.items()}
    ran = dict.fromkeys((t.key for t in ts), 0.0)  # launches the GPU ran, counted whole as a file does
    for _ in range(periods):
        used = gpu_model(ts, paces, rate, work)
        # What its usage file counts: the launches the GPU ran (a queue full of work blocks the next).
        launches = {}
        for t in ts:
            before = int(ran[t.key])
            ran[t.key] += used[t.key] * period / work[t.key]
            launches[t.key] = int(ran[t.key]) - before
        history.append(used)
        paces = {d.key: d.pace_ns for d in C.step(ts, used, launches, period, state)}
    return history, state


@pytest.mark.parametrize("shares", [(0.1, 0.9), (0.3, 0.7), (0.25, 0.25, 0.5), (0.1, 0.2, 0.3, 0.4)])
@pytest.mark.parametrize("scale", [1.0, 100.0])
@pytest.mark.parametrize("strict", [False, True])
def test_busy_containers_converge_to_their_shares(
    shares: tuple[float, ...], scale: float, strict: bool
) -> None:
    """Every container busy: each settles within 3 points of its share in 10 periods (1 s), with
    kernels of very different sizes (10 us to 2 ms), and the same when every kernel is 100 times larger."""
    ts = tenants(*shares, strict=strict)
    work = {t.key: scale * 1e-5 * (1 + 7 * i) for i, t in enumerate(ts)}  # GPU-seconds a launch
    rate = {t.key: 10 / work[t.key] for t in ts}  # each could fill the GPU ten times over
    history, _ = run(ts, rate, work, 30)
    within = [all(abs(h[t.key] - t.share) <= 0.03 for t in ts) for h in history]
    settled = next(i for i in range(len(history)) if all(within[i:]))  # within from here on
    assert settled <= 10, history[: settled + 1]


def test_fair_idle_share_flows_to_the_busy_in_proportion() -> None:
    ts = tenants(0.25, 0.25, 0.5)
    work = dict.fromkeys(("c0", "c1", "c2"), 1e-4)
    rate = {"c0": 1e5, "c1": 1e5, "c2": 1e5}
    _, state = run(ts, rate, work, 20)
    rate["c1"] = 0.0  # c1 goes idle
    history, _ = run(ts, rate, work, 20, state=state)
    last = history[-1]
    assert last["c1"] == 0.0
    assert last["c0"] == pytest.approx(1 / 3, abs=0.03) and last["c2"] == pytest.approx(2 / 3, abs=0.03)
    # and the GPU stays busy: nothing is lost to the idle share
    assert last["c0"] + last["c2"] >= 0.95


def test_a_container_that_needs_little_is_not_held_back() -> None:
    """Fair: a container using less than its share is never paced, and the busy one takes the rest."""
    ts = tenants(0.5, 0.5)
    work = {"c0": 1e-4, "c1": 1e-4}
    rate = {"c0": 2000.0, "c1": 1e6}  # c0 wants 20 % of the GPU
    history, state = run(ts, rate, work, 30)
    assert state["c0"].pace_ns == 0
    assert history[-1]["c0"] == pytest.approx(0.2, abs=0.01)
    assert history[-1]["c1"] >= 0.75


def test_a_container_the_pace_does_not_hold_is_reported_unheld() -> None:
    ts = tenants(0.2, 0.8)
    state: dict[str, C.Paced] = {}
    flagged = False
    for _ in range(60):  # c0 uses half the GPU whatever its pace (it bypasses the shim)
        decisions = C.step(ts, {"c0": 0.5, "c1": 0.5}, {"c0": 100}, 0.1, state)
        flagged = decisions[0].unheld
    assert flagged and state["c0"].k == C.K_RANGE  # the pace corrected as far as it goes
    assert decisions[0].hold == C.MAX_HOLD  # and its processes stopped for most of each period
    assert not decisions[1].unheld
    assert math.isclose(state["c0"].paced_s, 5.9, rel_tol=0.05)
