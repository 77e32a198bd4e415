"""Claim parameters (gpufrac.dev/v1alpha1 GpuClaimParameters): read as annotations are, each
refusal naming its field, value and reason, the safe default applied, later objects winning."""

from __future__ import annotations

from typing import Any

import pytest

from gpufrac.core.claimconfig import API_VERSION, KIND, claim_policy
from gpufrac.core.config import Config

pytestmark = pytest.mark.unit

GiB = 1 << 30
CFG = Config()


def obj(**fields: Any) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": KIND, **fields}


def decide(*objects: Any, whole: bool = False) -> tuple[Any, list[str]]:
    policy, problems = claim_policy(
        list(objects),
        claim="claim ns/c",
        request_bytes=8 * GiB,
        gpu_allocatable=79 * GiB,
        cfg=CFG,
        whole_gpu=whole,
    )
    return policy, [p.message("claim ns/c") for p in problems]


def test_fields_set_the_policy_as_their_annotations_do() -> None:
    policy, problems = decide(
        obj(
            memoryLimit="24Gi",
            workloadClass="interactive",
            preemptible=False,
            swappable=True,
            idleTimeout="30m",
            maxRuntime="12h",
            idleExempt=True,
            waitTimeout="45s",
        )
    )
    assert problems == []
    assert (policy.request_bytes, policy.limit_bytes, policy.limit_key) == (8 * GiB, 24 * GiB, "memoryLimit")
    assert (policy.workload_class, policy.preemptible, policy.swappable) == ("interactive", False, True)
    assert (policy.idle_timeout, policy.max_runtime, policy.idle_exempt, policy.wait_timeout) == (
        1800,
        43200,
        True,
        45,
    )
    assert decide(obj(fractionLimit=50))[0].limit_bytes == int(79 * GiB * 50 / 100)


def test_a_compute_share_is_read_as_its_annotation_is() -> None:
    policy, problems = decide(obj(computeShare=25))
    assert problems == [] and (policy.compute_share, policy.compute_share_key) == (0.25, "computeShare")
    # None given: the claim's memory share of its GPU (8 of 79 GiB).
    assert decide(obj())[0].compute_share == pytest.approx(8 / 79)
    policy, problems = decide(obj(computeShare="lots"))
    assert policy.compute_share == pytest.approx(8 / 79) and policy.compute_share_key is None
    assert len(problems) == 1 and problems[0].startswith('claim parameter computeShare="lots" ignored')
    assert "applied the safe default the memory share" in problems[0]


def test_a_later_object_overrides_an_earlier_one_field_by_field() -> None:
    policy, _ = decide(obj(memoryLimit="24Gi", workloadClass="inference"), obj(memoryLimit="16Gi"))
    assert (policy.limit_bytes, policy.workload_class) == (16 * GiB, "inference")


def test_a_bad_value_gets_the_safe_default_and_names_field_value_and_reason() -> None:
    policy, problems = decide(obj(memoryLimit="200Gi", preemptible="no", idleTimeout=30, workloadClass="gpu"))
    assert (
        policy.limit_bytes == policy.request_bytes and policy.preemptible and policy.workload_class == "batch"
    )
    assert policy.idle_timeout == CFG.idle.idle_timeout
    text = "\n".join(problems)
    assert 'memoryLimit="200Gi" ignored for claim ns/c: 200Gi is above the GPU\'s allocatable 79Gi' in text
    assert 'preemptible="no" ignored for claim ns/c: must be a boolean, true or false' in text
    assert 'idleTimeout="30" ignored for claim ns/c: must be a duration string' in text
    assert 'workloadClass="gpu" ignored for claim ns/c: unknown workload class' in text
    assert all("applied the safe default" in p for p in problems)


def test_a_limit_below_the_request_and_two_limits_are_refused_naming_fields() -> None:
    _, problems = decide(obj(memoryLimit="4Gi"))
    assert 'memoryLimit="4Gi"' in problems[0] and "below the request" in problems[0]
    policy, problems = decide(obj(memoryLimit="24Gi", fractionLimit=50))
    assert policy.limit_bytes == 8 * GiB
    assert len(problems) == 2 and all("memoryLimit and fractionLimit are both set" in p for p in problems)


def test_unknown_fields_and_foreign_objects_are_refused() -> None:
    policy, problems = decide(
        obj(memoryLimt="24Gi"),
        {"apiVersion": "gpufrac.dev/v2", "kind": KIND, "memoryLimit": "24Gi"},
        {"apiVersion": API_VERSION, "kind": "Other", "memoryLimit": "24Gi"},
        "not an object",
    )
    assert policy.limit_bytes == policy.request_bytes  # none of them set a limit
    assert 'claim parameter memoryLimt="24Gi" ignored for claim ns/c: unknown field (known: ' in problems[0]
    assert 'apiVersion="gpufrac.dev/v2"' in problems[1] and "the whole object is ignored" in problems[1]
    assert 'kind="Other"' in problems[2]
    assert 'parameters="not an object"' in problems[3]


def test_a_whole_gpu_claim_has_no_limit_of_its_own() -> None:
    policy, problems = decide(obj(memoryLimit="24Gi"), whole=True)
    assert policy.whole_gpu and policy.limit_bytes == policy.request_bytes and problems == []
