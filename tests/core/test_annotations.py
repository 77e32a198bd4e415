"""Pod annotations -> container policy: every key, every bad value, never a loosened limit."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpufrac.core import annotations as A
from gpufrac.core.config import Config, load
from gpufrac.memguard.abi import (
    CLASS_INFERENCE,
    CLASS_INTERACTIVE,
    FLAG_POD_KNOWN,
    FLAG_PREEMPTIBLE,
    FLAG_SWAPPABLE,
    FLAG_WHOLE_GPU,
)

pytestmark = pytest.mark.unit

GiB = 1 << 30
REQ = 8 * GiB
ALLOC = 79 * GiB  # an H100 80GB minus 1 GiB reserved


def policy(ann: dict[str, str], cfg: Config | None = None, **kw: object) -> A.PolicyResult:
    args: dict[str, object] = {
        "container": "server",
        "request_bytes": REQ,
        "gpu_allocatable": ALLOC,
        "cfg": cfg or load(),
        "containers": ["server", "sidecar"],
    }
    args.update(kw)
    return A.parse_policy(ann, **args)  # type: ignore[arg-type]


def test_no_annotations_means_no_burst_and_node_defaults() -> None:
    cfg = load(overrides={"waitTimeout": "45s", "idle": {"idleTimeout": "2h", "maxRuntime": "12h"}})
    r = policy({}, cfg, priority=1000)
    p = r.policy
    assert r.problems == []
    assert (p.limit_bytes, p.limit_key) == (REQ, None)
    assert (p.workload_class, p.preemptible, p.swappable) == ("batch", True, False)
    assert (p.idle_timeout, p.max_runtime, p.wait_timeout) == (7200.0, 43200.0, 45.0)
    assert p.priority == 1000
    assert p.flags == FLAG_POD_KNOWN | FLAG_PREEMPTIBLE
    assert p.config_fields() == {
        "limit_bytes": REQ,
        "flags": FLAG_POD_KNOWN | FLAG_PREEMPTIBLE,
        "workload_class": 0,
        "priority": 1000,
        "wait_timeout_ms": 45000,
    }


def test_memory_limit_quantity() -> None:
    r = policy({A.MEMORY_LIMIT: "24Gi"})
    assert r.problems == []
    assert r.policy.limit_bytes == 24 * GiB
    assert r.policy.limit_key == A.MEMORY_LIMIT
    assert r.policy.burst


def test_memory_limit_equal_to_request_is_fine() -> None:
    r = policy({A.MEMORY_LIMIT: "8192Mi"})
    assert r.problems == [] and r.policy.limit_bytes == REQ


def test_fraction_limit_is_percent_of_allocatable() -> None:
    r = policy({A.FRACTION_LIMIT: "50"})
    assert r.problems == []
    assert r.policy.limit_bytes == ALLOC // 2
    assert policy({A.FRACTION_LIMIT: "100%"}).policy.limit_bytes == ALLOC
    assert policy({A.FRACTION_LIMIT: "12.5"}).policy.limit_bytes == ALLOC // 8


def test_per_container_override_beats_pod_level() -> None:
    ann = {A.MEMORY_LIMIT: "24Gi", A.container_key(A.FRACTION_LIMIT, "server"): "20"}
    r = policy(ann)
    assert r.problems == []
    assert r.policy.limit_bytes == int(ALLOC * 20 / 100)
    assert r.policy.limit_key == "gpufrac.dev/gpu-fraction-limit.server"
    # The sidecar has no override: the pod-level limit applies to it.
    assert policy(ann, container="sidecar").policy.limit_bytes == 24 * GiB


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("lots", "not a quantity"),
        ("-4Gi", "negative"),
        ("0.5", "not a whole number of bytes"),
        ("", "not a quantity"),
        ("4Gi", "below the request 8Gi"),
        ("100Gi", "above the GPU's allocatable 79Gi"),
    ],
)
def test_bad_memory_limit_falls_back_to_request(value: str, reason: str) -> None:
    r = policy({A.MEMORY_LIMIT: value})
    assert r.policy.limit_bytes == REQ and r.policy.limit_key is None
    assert len(r.problems) == 1
    prob = r.problems[0]
    assert (prob.key, prob.value) == (A.MEMORY_LIMIT, value)
    assert reason in prob.reason
    msg = prob.message("server")
    assert A.MEMORY_LIMIT in msg and f'"{value}"' in msg and "limit = request (8Gi)" in msg


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("0", "between 1 and 100"),
        ("101", "between 1 and 100"),
        ("-5", "percentage"),
        ("eighty", "percentage"),
        ("5", "below the request"),  # 5 % of 79 GiB < 8 GiB
    ],
)
def test_bad_fraction_limit_falls_back_to_request(value: str, reason: str) -> None:
    r = policy({A.FRACTION_LIMIT: value})
    assert r.policy.limit_bytes == REQ
    assert [(p.key, p.value) for p in r.problems] == [(A.FRACTION_LIMIT, value)]
    assert reason in r.problems[0].reason


def test_both_limit_kinds_at_one_level_are_refused() -> None:
    r = policy({A.MEMORY_LIMIT: "24Gi", A.FRACTION_LIMIT: "50"})
    assert r.policy.limit_bytes == REQ
    assert {p.key for p in r.problems} == {A.MEMORY_LIMIT, A.FRACTION_LIMIT}
    assert all("both set" in p.reason for p in r.problems)
    per = {
        A.container_key(A.MEMORY_LIMIT, "server"): "24Gi",
        A.container_key(A.FRACTION_LIMIT, "server"): "50",
    }
    assert policy(per).policy.limit_bytes == REQ
    assert len(policy(per).problems) == 2


def test_override_for_a_container_the_pod_lacks_is_a_typo() -> None:
    r = policy({A.container_key(A.MEMORY_LIMIT, "sever"): "24Gi"})
    assert r.policy.limit_bytes == REQ
    assert [p.key for p in r.problems] == ["gpufrac.dev/gpu-memory-limit.sever"]
    assert "no container named 'sever'" in r.problems[0].reason


def test_unknown_gpufrac_key_is_reported_others_ignored() -> None:
    r = policy(
        {"gpufrac.dev/gpu-memory-limt": "24Gi", "example.com/x": "y", "gpufrac.dev/preemptible": "false"}
    )
    assert r.policy.limit_bytes == REQ  # the typo never becomes a limit
    assert r.policy.preemptible is False
    assert [(p.key, p.value) for p in r.problems] == [("gpufrac.dev/gpu-memory-limt", "24Gi")]
    assert "unknown gpufrac annotation" in r.problems[0].reason


def test_whole_gpu_is_never_limited() -> None:
    r = policy({A.MEMORY_LIMIT: "24Gi"}, request_bytes=2 * ALLOC, whole_gpu=True)
    assert r.problems == [] and r.policy.limit_bytes == 2 * ALLOC
    assert r.policy.flags & FLAG_WHOLE_GPU
    aimed = policy({A.container_key(A.MEMORY_LIMIT, "server"): "24Gi"}, request_bytes=ALLOC, whole_gpu=True)
    assert aimed.policy.limit_bytes == ALLOC
    assert "whole-GPU" in aimed.problems[0].reason


@pytest.mark.parametrize(
    ("value", "expect"), [("true", True), ("false", False), ("False", False), ("TRUE", True)]
)
def test_booleans(value: str, expect: bool) -> None:
    r = policy({A.PREEMPTIBLE: value, A.SWAPPABLE: value})
    assert r.problems == []
    assert (r.policy.preemptible, r.policy.swappable) == (expect, expect)
    assert bool(r.policy.flags & FLAG_PREEMPTIBLE) is expect
    assert bool(r.policy.flags & FLAG_SWAPPABLE) is expect


def test_bad_booleans_fall_back_to_safe_defaults() -> None:
    cfg = load(overrides={"swap": {"defaultSwappable": True}})
    r = policy({A.PREEMPTIBLE: "no", A.SWAPPABLE: "1"}, cfg)
    assert r.policy.preemptible is True
    assert r.policy.swappable is True  # the node's default
    assert {(p.key, p.value, p.reason) for p in r.problems} == {
        (A.PREEMPTIBLE, "no", "must be true or false"),
        (A.SWAPPABLE, "1", "must be true or false"),
    }


def test_workload_class() -> None:
    assert (
        policy({A.WORKLOAD_CLASS: "interactive"}).policy.config_fields()["workload_class"]
        == CLASS_INTERACTIVE
    )
    assert policy({A.WORKLOAD_CLASS: "Inference"}).policy.config_fields()["workload_class"] == CLASS_INFERENCE
    r = policy({A.WORKLOAD_CLASS: "training"})
    assert r.policy.workload_class == "batch"
    assert "unknown workload class" in r.problems[0].reason and r.problems[0].default == "batch"


def test_durations() -> None:
    r = policy({A.IDLE_TIMEOUT: "30m", A.MAX_RUNTIME: "12h", A.WAIT_TIMEOUT: "1m30s"})
    assert r.problems == []
    assert (r.policy.idle_timeout, r.policy.max_runtime, r.policy.wait_timeout) == (1800.0, 43200.0, 90.0)
    assert r.policy.config_fields()["wait_timeout_ms"] == 90000
    # A zero wait timeout means "fail fast", which is the user's own choice.
    assert policy({A.WAIT_TIMEOUT: "0s"}).policy.wait_timeout == 0.0


@pytest.mark.parametrize("key", [A.IDLE_TIMEOUT, A.MAX_RUNTIME, A.WAIT_TIMEOUT])
@pytest.mark.parametrize("value", ["soon", "-5m", "10x"])
def test_bad_durations_fall_back_to_node_config(key: str, value: str) -> None:
    cfg = load(overrides={"waitTimeout": "45s", "idle": {"idleTimeout": "2h", "maxRuntime": "12h"}})
    r = policy({key: value}, cfg)
    assert [(p.key, p.value) for p in r.problems] == [(key, value)]
    p = r.policy
    assert (p.idle_timeout, p.max_runtime, p.wait_timeout) == (7200.0, 43200.0, 45.0)
    assert "the node's" in r.problems[0].default


def test_zero_idle_timeout_cannot_switch_reaping_off() -> None:
    r = policy({A.IDLE_TIMEOUT: "0s"})
    assert r.policy.idle_timeout == load().idle.idle_timeout
    assert "positive" in r.problems[0].reason


def test_wait_timeout_above_the_file_format_is_refused() -> None:
    r = policy({A.WAIT_TIMEOUT: "2000h"})
    assert r.policy.wait_timeout == load().wait_timeout
    assert "maximum" in r.problems[0].reason


def test_priority_clamped_to_int32() -> None:
    assert policy({}, priority=2_000_000_000).policy.priority == 2_000_000_000
    assert policy({}, priority=2**40).policy.priority == 2**31 - 1
    assert policy({}, priority=None).policy.priority == 0


def test_safe_policy_is_request_and_pod_unknown() -> None:
    p = A.safe_policy(REQ, load())
    assert p.limit_bytes == REQ and not p.pod_known
    assert not p.flags & FLAG_POD_KNOWN
    assert p.flags & FLAG_PREEMPTIBLE


ANNOTATION_KEYS = st.sampled_from(
    [
        *sorted(A.USER_KEYS),
        A.container_key(A.MEMORY_LIMIT, "server"),
        A.container_key(A.FRACTION_LIMIT, "server"),
        A.container_key(A.MEMORY_LIMIT, "other"),
        "gpufrac.dev/whatever",
        "example.com/x",
    ]
)
ANNOTATION_VALUES = st.one_of(
    st.text(max_size=12),
    st.from_regex(r"-?[0-9]{1,4}(\.[0-9]{1,3})?(Ki|Mi|Gi|Ti|k|M|G|m|%|e3)?", fullmatch=True),
    st.sampled_from(["true", "false", "interactive", "30m", "0", "100", "24Gi", "1Pi", "NaN", "inf"]),
)


@settings(max_examples=400, deadline=None)
@given(
    ann=st.dictionaries(ANNOTATION_KEYS, ANNOTATION_VALUES, max_size=6),
    request=st.integers(min_value=0, max_value=ALLOC),
    allocatable=st.integers(min_value=1, max_value=200 * GiB),
    priority=st.one_of(st.none(), st.integers(min_value=-(2**40), max_value=2**40)),
)
def test_any_annotations_give_a_limit_between_request_and_allocatable(
    ann: dict[str, str], request: int, allocatable: int, priority: int | None
) -> None:
    request = min(request, allocatable)
    r = policy(ann, request_bytes=request, gpu_allocatable=allocatable, priority=priority)
    p = r.policy
    assert request <= p.limit_bytes <= allocatable
    assert (p.limit_key is None) == (p.limit_bytes == request and p.limit_key is None)
    assert p.workload_class in ("batch", "interactive", "inference")
    assert -(2**31) <= p.priority < 2**31
    assert 0 <= p.config_fields()["wait_timeout_ms"] < 2**32
    for prob in r.problems:
        assert prob.key in ann and prob.value == ann[prob.key]


# ---------------------------------------------------------------- compute share (docs/compute.md)


def test_compute_share_is_the_memory_share_by_default() -> None:
    p = policy({}).policy
    assert p.compute_share == pytest.approx(REQ / ALLOC) and p.compute_share_key is None
    whole = policy({}, request_bytes=80 * GiB, whole_gpu=True).policy
    assert whole.compute_share == 1.0


def test_compute_share_annotation_and_per_container_override() -> None:
    r = policy({A.COMPUTE_SHARE: "30"})
    assert r.problems == [] and (r.policy.compute_share, r.policy.compute_share_key) == (0.3, A.COMPUTE_SHARE)
    key = A.COMPUTE_SHARE + ".server"
    r = policy({A.COMPUTE_SHARE: "30", key: "12.5%"})
    assert r.problems == [] and (r.policy.compute_share, r.policy.compute_share_key) == (0.125, key)
    # an override for the pod's other container leaves this one at the pod-level value
    r = policy({A.COMPUTE_SHARE: "30", A.COMPUTE_SHARE + ".sidecar": "5"})
    assert r.problems == [] and r.policy.compute_share == 0.3


@pytest.mark.parametrize("value", ["0", "101", "-5", "half", "", "1e2", "50 percent"])
def test_bad_compute_share_falls_back_to_the_memory_share(value: str) -> None:
    r = policy({A.COMPUTE_SHARE: value})
    (problem,) = r.problems
    assert (problem.key, problem.value) == (A.COMPUTE_SHARE, value)
    assert r.policy.compute_share == pytest.approx(REQ / ALLOC) and r.policy.compute_share_key is None
    message = problem.message("server")
    assert A.COMPUTE_SHARE in message and f'"{value}"' in message and "memory share" in message


def test_compute_share_on_a_whole_gpu_is_the_whole_gpu() -> None:
    r = policy({A.COMPUTE_SHARE + ".server": "20"}, request_bytes=80 * GiB, whole_gpu=True)
    (problem,) = r.problems
    assert "whole-GPU" in problem.reason and r.policy.compute_share == 1.0
    assert policy({A.COMPUTE_SHARE: "20"}, request_bytes=80 * GiB, whole_gpu=True).problems == []


def test_compute_share_override_for_a_missing_container_is_a_typo() -> None:
    (problem,) = policy({A.COMPUTE_SHARE + ".nobody": "20"}).problems
    assert "no container named 'nobody'" in problem.reason
