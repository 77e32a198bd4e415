"""A ResourceClaim as the DRA driver reads it (gpufrac.core.claims): its shares of this node's
pool, what they consume, the parameters that apply, and refusals that name the field."""

from __future__ import annotations

from typing import Any

import pytest

from gpufrac.core.claims import ClaimRef, allocation, claim_key
from gpufrac.core.errors import AllocationError, ErrorKind

pytestmark = pytest.mark.unit

REF = ClaimRef("ns", "c", "uid-1")
OURS = {"driver": "gpufrac.dev", "pool": "node-a"}


def claim(
    results: list[dict[str, Any]], config: list[dict[str, Any]] | None = None, uid: str = "uid-1"
) -> Any:
    return {
        "metadata": {"uid": uid},
        "status": {
            "allocation": {"devices": {"results": results, "config": config or []}},
            "reservedFor": [{"resource": "pods", "name": "p", "uid": "pod-1"}],
        },
    }


def test_shares_of_this_pool_with_consumed_memory_and_share_ids() -> None:
    raw = claim(
        [
            {
                **OURS,
                "request": "gpu",
                "device": "gpu-1",
                "consumedCapacity": {"memory": "8Gi"},
                "shareID": "s1",
            },
            {"driver": "gpufrac.dev", "pool": "node-b", "request": "gpu", "device": "gpu-0"},  # another node
            {"driver": "other.dev", "pool": "node-a", "request": "nic", "device": "nic-0"},  # another driver
        ]
    )
    a = allocation(raw, REF, driver="gpufrac.dev", pool="node-a")
    assert [(s.request, s.device, s.consumed, s.share_id) for s in a.shares] == [
        ("gpu", "gpu-1", 8 << 30, "s1")
    ]
    assert a.reserved_for == ("pod-1",)


def test_a_result_without_consumed_memory_is_the_whole_device() -> None:
    raw = claim([{**OURS, "request": "gpu", "device": "gpu-0"}])
    assert allocation(raw, REF, driver="gpufrac.dev", pool="node-a").shares[0].consumed is None


def test_parameters_apply_class_first_then_claim_and_only_to_their_requests() -> None:
    mine = {"driver": "gpufrac.dev", "parameters": {"memoryLimit": "1Gi"}}
    raw = claim(
        [{**OURS, "request": "gpu/small", "device": "gpu-0", "consumedCapacity": {"memory": "1Gi"}}],
        [
            {"source": "FromClaim", "opaque": {**mine, "parameters": {"from": "claim"}}},
            {"source": "FromClass", "requests": ["gpu"], "opaque": {**mine, "parameters": {"from": "class"}}},
            {
                "source": "FromClaim",
                "requests": ["other"],
                "opaque": {**mine, "parameters": {"from": "other"}},
            },
            {"source": "FromClaim", "opaque": {"driver": "x.dev", "parameters": {"from": "x"}}},
        ],
    )
    params = allocation(raw, REF, driver="gpufrac.dev", pool="node-a").parameters
    assert [p["from"] for p in params] == ["class", "claim"]


@pytest.mark.parametrize(
    ("raw", "kind", "words"),
    [
        (claim([], uid="uid-2"), ErrorKind.STATE_CONFLICT, "uid uid-2"),
        ({"metadata": {"uid": "uid-1"}, "status": {}}, ErrorKind.STATE_CONFLICT, "not allocated"),
        (
            claim([{"driver": "gpufrac.dev", "pool": "node-b", "request": "g", "device": "d"}]),
            ErrorKind.STATE_CONFLICT,
            "no device",
        ),
        (claim([{**OURS, "request": "gpu"}]), ErrorKind.INVALID_REQUEST, "results[0]: no device"),
        (
            claim([{**OURS, "request": "gpu", "device": "gpu-0", "consumedCapacity": {"memory": "lots"}}]),
            ErrorKind.INVALID_REQUEST,
            "results[0].consumedCapacity.memory",
        ),
    ],
)
def test_refusals_name_what_is_wrong(raw: Any, kind: ErrorKind, words: str) -> None:
    with pytest.raises(AllocationError) as e:
        allocation(raw, REF, driver="gpufrac.dev", pool="node-a")
    assert e.value.kind == kind and words in e.value.message and "claim ns/c" in e.value.message


def test_claim_keys_are_stable_and_distinct() -> None:
    assert claim_key("a") == claim_key("a") != claim_key("b")
    assert claim_key("a").startswith("c-")
