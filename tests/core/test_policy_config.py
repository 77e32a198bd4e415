"""The node config's `policy` section: loaded and validated like every other key (errors
name the key, the value and the reason), and applied to a container's policy."""

from __future__ import annotations

import dataclasses

import pytest

from gpufrac.core import config
from gpufrac.core.annotations import ContainerPolicy
from gpufrac.core.policy import (
    COMPUTE_SHARE,
    LIMIT,
    PREEMPTIBLE,
    SWAPPABLE,
    NamespacePolicy,
    PolicyConfig,
    compute_mode,
    enforce,
)
from gpufrac.core.units import format_bytes

pytestmark = pytest.mark.unit

GiB = 1 << 30


def load(policy: object) -> PolicyConfig:
    return config.load(overrides={"nodeName": "n", "policy": policy}).policy


def test_defaults_cap_nothing() -> None:
    assert config.Config().policy == PolicyConfig() == load({})
    assert PolicyConfig().for_namespace("any") == NamespacePolicy(0.0, True, True)


def test_namespace_entries_inherit_from_default() -> None:
    p = load(
        {
            "default": {"maxLimitRatio": 3, "allowUnswappable": False},
            "namespaces": {"ml": {"maxLimitRatio": 1.5}},
        }
    )
    assert p.for_namespace("ml") == NamespacePolicy(1.5, True, False)
    assert p.for_namespace("other") == NamespacePolicy(3.0, True, False)


@pytest.mark.parametrize(
    ("policy", "says"),
    [
        ({"default": {"maxLimitRatio": 0.5}}, r"policy\.default\.maxLimitRatio: 0\.5 must be 0 \(no cap\)"),
        ({"default": {"maxLimitRatio": True}}, r"policy\.default\.maxLimitRatio: True"),
        ({"default": {"maxLimitRatio": float("inf")}}, r"maxLimitRatio: inf must be"),
        (
            {"default": {"allowNonPreemptible": "yes"}},
            r"policy\.default\.allowNonPreemptible: expected true or false",
        ),
        ({"default": {"maxRatio": 2}}, r"policy\.default\.maxRatio: unknown key"),
        (
            {"namespaces": {"Not_A_Namespace": {}}},
            r"policy\.namespaces: 'Not_A_Namespace' is not a namespace",
        ),
        (
            {"namespaces": {"ml": {"allowUnswappable": 1}}},
            r"policy\.namespaces\.ml\.allowUnswappable: expected",
        ),
        ({"namespaces": ["ml"]}, r"policy\.namespaces: expected a mapping"),
        ({"defaults": {}}, r"policy\.defaults: unknown key"),
        ("strict", r"policy: expected a mapping"),
    ],
)
def test_bad_policy_is_refused_naming_key_and_value(policy: object, says: str) -> None:
    with pytest.raises(config.ConfigError, match=says):
        load(policy)


def _policy(request: int, limit: int, **kw: object) -> ContainerPolicy:
    return ContainerPolicy(request, limit, "gpufrac.dev/gpu-memory-limit" if limit > request else None, **kw)  # type: ignore[arg-type]


def _enforce(p: ContainerPolicy, ns: NamespacePolicy) -> tuple[ContainerPolicy, list[str]]:
    out, caps = enforce(p, "ns", PolicyConfig(default=ns), container="main", format_bytes=format_bytes)
    return out, [c.what for c in caps]


def test_enforce_caps_the_ratio_never_below_the_request() -> None:
    two = NamespacePolicy(max_limit_ratio=2.0)
    assert _enforce(_policy(8 * GiB, 40 * GiB), two) == (_policy(8 * GiB, 16 * GiB), [LIMIT])
    assert _enforce(_policy(8 * GiB, 16 * GiB), two) == (_policy(8 * GiB, 16 * GiB), [])
    assert _enforce(_policy(8 * GiB, 8 * GiB), NamespacePolicy(max_limit_ratio=1.0))[1] == []
    capped, _ = _enforce(_policy(3, 100), NamespacePolicy(max_limit_ratio=1.5))
    assert capped.limit_bytes == 4  # floor(4.5), still >= the request
    whole = dataclasses.replace(_policy(80 * GiB, 80 * GiB), whole_gpu=True)
    assert _enforce(whole, NamespacePolicy(max_limit_ratio=1.0)) == (whole, [])


def test_enforce_forces_preemptible_and_swappable_where_not_allowed() -> None:
    strict = NamespacePolicy(allow_non_preemptible=False, allow_unswappable=False)
    asked = _policy(GiB, GiB, preemptible=False, swappable=False)
    out, caps = _enforce(asked, strict)
    assert (out.preemptible, out.swappable, caps) == (True, True, [PREEMPTIBLE, SWAPPABLE])
    assert _enforce(asked, NamespacePolicy()) == (asked, [])


def test_compute_policy_keys_and_their_checks() -> None:
    p = load({"default": {"maxComputeShare": 50}, "namespaces": {"ml": {"computeMode": "strict"}}})
    assert p.for_namespace("ml").max_compute_share == 50  # inherited
    assert compute_mode(p, "ml", "fair") == "strict" and compute_mode(p, "other", "fair") == "fair"
    for bad, says in (
        ({"default": {"maxComputeShare": 0}}, r"maxComputeShare: 0 must be a whole percent"),
        ({"default": {"maxComputeShare": 50.5}}, r"maxComputeShare: 50\.5 must be"),
        ({"default": {"maxComputeShare": True}}, r"maxComputeShare: True must be"),
        ({"default": {"computeMode": "greedy"}}, r"computeMode: 'greedy' must be one of fair, strict"),
    ):
        with pytest.raises(config.ConfigError, match=says):
            load(bad)


def test_enforce_caps_the_compute_share() -> None:
    asked = _policy(GiB, GiB, compute_share=0.8, compute_share_key="gpufrac.dev/compute-share")
    out, caps = _enforce(asked, NamespacePolicy(max_compute_share=25))
    assert (out.compute_share, caps) == (0.25, [COMPUTE_SHARE])
    assert _enforce(asked, NamespacePolicy()) == (asked, [])
    # a pod not known yet keeps its memory share (None) until its annotations are read
    unknown = _policy(GiB, GiB)
    assert _enforce(unknown, NamespacePolicy(max_compute_share=10)) == (unknown, [])
