"""Bad input never crashes a parser, never loosens a limit, and is reported once.

Pod annotations are written by tenants; the node config by an operator. Any string
must give a value or a clear refusal naming key, value and reason: never an
exception escaping the parser (a traceback every reconcile), never a value that
wraps around in the shim's fixed-width fields (memguard_abi.h).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import Callable
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpufrac.core import annotations as ann
from gpufrac.core import policy as policy_mod
from gpufrac.core.config import Config, ConfigError, load
from gpufrac.core.quote import shown
from gpufrac.core.units import format_bytes, parse_bytes, parse_duration
from gpufrac.memguard import abi
from tests.fixtures.arbiter_harness import ArbiterNode, GiB

pytestmark = pytest.mark.security

U32 = 2**32 - 1
MAX_MS_FIELD_S = U32 / 1000  # the shim's u32 millisecond fields, in seconds

# Strings a tenant might write: anything, plus the shapes that reach the number parsers.
numberish = st.one_of(
    st.text(max_size=40),
    st.from_regex(r"\A-?\d{1,420}(\.\d{0,5})?(e-?\d{1,4})?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E|m|%)?\Z"),
    st.from_regex(r"\A(\d{1,30}(\.\d{1,3})?(h|m|s|ms)){1,4}\Z"),
    st.sampled_from(["1e400", "1e400Gi", "-0", "NaN", "Infinity", "1e-400", "99999999999999999999h", "0x10"]),
)
annotation_keys = st.sampled_from(
    [*sorted(ann.USER_KEYS), ann.MEMORY_LIMIT + ".main", ann.FRACTION_LIMIT + ".main", "gpufrac.dev/x"]
)


@settings(max_examples=600, deadline=None)
@given(
    values=st.dictionaries(annotation_keys, numberish, max_size=6),
    request=st.integers(1, 80 * GiB),
    allocatable=st.integers(1, 160 * GiB),
    priority=st.one_of(st.none(), st.integers(-(2**80), 2**80)),
)
def test_annotation_parsing_never_raises_and_never_loosens_a_limit(
    values: dict[str, str], request: int, allocatable: int, priority: int | None
) -> None:
    result = ann.parse_policy(
        values,
        container="main",
        request_bytes=request,
        gpu_allocatable=allocatable,
        cfg=Config(),
        priority=priority,
        containers=["main"],
    )
    p = result.policy
    assert p.limit_bytes == request or request <= p.limit_bytes <= allocatable
    fields = p.config_fields()
    assert 0 <= fields["wait_timeout_ms"] <= U32
    assert -(2**31) <= fields["priority"] < 2**31
    for v in (p.idle_timeout, p.max_runtime, p.wait_timeout):
        assert math.isfinite(v) and v >= 0
    for problem in result.problems:  # every refusal names its key and value, with a reason
        assert problem.key in values and problem.value == values[problem.key] and problem.reason
        message = problem.message("main")
        assert shown(problem.key) in message and shown(problem.value) in message
        assert len(message) < 2048  # a value of any length is named in a line of readable length
        assert "\n" not in message and "\r" not in message


@settings(max_examples=600, deadline=None)
@given(numberish)
def test_quantity_and_duration_parsers_give_a_value_or_a_value_error(text: str) -> None:
    for parse in (parse_bytes, parse_duration):
        try:
            v = parse(text)
        except ValueError as e:
            assert repr(text) in str(e) or "empty" in str(e)
            continue
        assert v >= 0 and math.isfinite(v)
    with pytest.raises(ValueError):
        parse_bytes(2**64)
    assert format_bytes(10**400)  # any size prints (a message naming a huge value must not raise)


# Values a YAML file or an override may hold.
yaml_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**80), 2**80),
        st.floats(allow_nan=True, allow_infinity=True),
        numberish,
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=12), inner, max_size=3)
    ),
    max_leaves=6,
)
config_keys = st.sampled_from(
    [
        "memoryUnit",
        "reservedPerGpu",
        "waitTimeout",
        "arbiterTimeout",
        "grantMargin",
        "evictIdleThreshold",
        "resolvers",
        "lendUnusedRequests",
        "logLevel",
        "nodeName",
        "watchdog",
        "swap",
        "idle",
        "metrics",
        "health",
        "arbiterLimits",
        "bogusKey",
    ]
)
sections = {
    "watchdog": ["mode", "tolerance", "interval"],
    "swap": ["hostRamBudget", "idleThreshold", "lockTimeout", "defaultSwappable"],
    "idle": ["idleTimeout", "maxRuntime", "gracePeriod", "interval", "reapClasses"],
    "metrics": ["port", "bindAddress"],
    "health": ["ignoredXids", "xidRecovery", "pollInterval"],
    "arbiterLimits": [
        "connectionsPerContainer",
        "inflightPerContainer",
        "requestsPerSecond",
        "requestBurst",
        "maxConnections",
    ],
}


@st.composite
def overrides(draw: st.DrawFn) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in draw(st.lists(config_keys, max_size=4)):
        if key in sections and draw(st.booleans()):
            inner = draw(st.lists(st.sampled_from(sections[key]), min_size=1, max_size=3))
            out[key] = {k: draw(yaml_values) for k in inner}
        else:
            out[key] = draw(yaml_values)
    return out


@settings(max_examples=500, deadline=None)
@given(overrides())
def test_config_gives_a_config_or_a_config_error_naming_the_key(data: dict[str, Any]) -> None:
    try:
        cfg = load(overrides={"nodeName": "n", **data})
    except ConfigError as e:
        assert any(k in str(e) for k in (*data, "nodeName", "resolvers")), str(e)
        return
    assert cfg.wait_timeout <= MAX_MS_FIELD_S and cfg.arbiter_timeout <= MAX_MS_FIELD_S


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(max_size=200))
def test_a_config_file_of_any_text_gives_a_config_or_a_config_error(tmp_path: Any, text: str) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    with contextlib.suppress(ConfigError):
        load(path, overrides={"nodeName": "n"})


@pytest.mark.parametrize("key", ["waitTimeout", "arbiterTimeout"])
def test_a_duration_past_the_shims_32_bit_millisecond_field_is_refused(key: str) -> None:
    # 1200h = 4,320,000,000 ms: one more than a u32 holds and it would wrap to about 7 hours.
    with pytest.raises(ConfigError, match=f"{key}: 4.32e\\+06s is more than the shim's limit"):
        load(overrides={"nodeName": "n", key: "1200h"})
    assert load(overrides={"nodeName": "n", key: "1190h"})  # 49.6 days still fits
    result = ann.parse_policy(
        {ann.WAIT_TIMEOUT: "1200h"},
        container="main",
        request_bytes=GiB,
        gpu_allocatable=8 * GiB,
        cfg=Config(),
    )
    assert [p.key for p in result.problems] == [ann.WAIT_TIMEOUT]
    assert result.policy.config_fields()["wait_timeout_ms"] == 30000  # the node's default


def test_the_config_file_refuses_a_value_its_field_cannot_hold(tmp_path: Any) -> None:
    good = abi.ContainerConfig(gpu_uuid="GPU-x", request_bytes=GiB, limit_bytes=GiB)
    f = abi.ConfigFile(tmp_path)
    try:
        f.write(good)
        for field, value in (("wait_timeout_ms", U32 + 1), ("limit_bytes", 2**64), ("priority", 2**31)):
            bad = dataclasses.replace(good, **{field: value})
            with pytest.raises(abi.FormatError, match=field):
                f.write(bad)
        assert abi.read_config(tmp_path) == good  # untouched, still consistent
    finally:
        f.close()


def test_an_annotation_of_1e400_gives_one_event_naming_the_key_and_keeps_limit_request(
    make_node: Callable[..., ArbiterNode], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    node = make_node()
    a = node.add("a", 2, "1e400")  # resolved once here
    for _ in range(3):  # reconciles: nothing new to say
        node.on_loop(lambda: node.identity.resolve(node.listing))
    assert a.config().limit_bytes == 2 * GiB  # limit = request: nothing loosened
    assert a.workload is not None and a.workload.do(f"alloc {3 * GiB}") == "denied"

    def events() -> list[Any]:
        return [
            e
            for e in node.v1.list_namespaced_event("default").items
            if e.involved_object.name == "a" and e.reason == "InvalidAnnotation"
        ]

    node.until(lambda: bool(events()), what="the InvalidAnnotation Event")
    (event,) = events()
    assert ann.MEMORY_LIMIT in event.message and "1e400" in event.message
    assert (event.count or 1) == 1
    lines = [r for r in caplog.records if ann.MEMORY_LIMIT in r.getMessage()]
    assert len(lines) == 1 and "1e400" in lines[0].getMessage()
    assert not [r for r in caplog.records if r.exc_info]  # no traceback


@pytest.mark.parametrize(
    "value",
    ["5Gi\n2026-01-01T00:00:00Z WARNING gpufrac.agent.watchdog.service: forged", "9" * 256 * 1024 + "Gi"],
    ids=["newline", "256KiB"],
)
def test_a_refusal_names_a_value_in_one_line_of_readable_length(value: str) -> None:
    """A value may hold anything the apiserver takes (newlines, 256 KiB): its refusal is still one
    line the agent's log and the Event show whole, its start shown and its length said."""
    result = ann.parse_policy(
        {ann.MEMORY_LIMIT: value}, container="main", request_bytes=GiB, gpu_allocatable=8 * GiB, cfg=Config()
    )
    (problem,) = result.problems
    assert problem.value == value  # the problem keeps the value; only its message shortens it
    message = problem.message("main")
    assert "\n" not in message and len(message) < 1024, message[:300]
    assert ann.MEMORY_LIMIT in message and value[:3] in message
    assert result.policy.limit_bytes == GiB


def test_yaml_special_floats_in_config_are_refused() -> None:
    for key in ("waitTimeout", "memoryUnit"):
        for value in (".inf", ".nan", "1e400"):
            data = yaml.safe_load(f"{key}: {value}")
            with pytest.raises(ConfigError, match=key):
                load(overrides={"nodeName": "n", **data})


ratios = st.one_of(
    yaml_values,
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(-(2**1100), 2**1100),
    st.sampled_from([1e300, 1e308, 2**1024, 1_000_000, 1_000_001, 1, 0.5, 0]),
)


@settings(max_examples=400, deadline=None)
@given(
    ratio=ratios,
    request=st.integers(1, 2**40),
    limit=st.integers(1, 2**64 - 1),
)
def test_any_max_limit_ratio_gives_a_config_error_or_a_policy_that_caps_without_raising(
    ratio: Any, request: int, limit: int
) -> None:
    """A ratio of 1e300 once overflowed to inf in the cap and raised OverflowError on every pod
    of its namespace; a long integer raised it while the config was read."""
    try:
        cfg = load(overrides={"nodeName": "n", "policy": {"namespaces": {"team": {"maxLimitRatio": ratio}}}})
    except ConfigError as e:
        assert "policy.namespaces.team.maxLimitRatio" in str(e), str(e)
        return
    ns = cfg.policy.for_namespace("team")
    assert ns.max_limit_ratio == 0 or 1 <= ns.max_limit_ratio <= policy_mod.MAX_LIMIT_RATIO
    asked = ann.ContainerPolicy(request, max(request, limit), limit_key=ann.MEMORY_LIMIT)
    policy, _ = policy_mod.enforce(asked, "team", cfg.policy, container="main", format_bytes=format_bytes)
    assert request <= policy.limit_bytes <= asked.limit_bytes
    if ns.max_limit_ratio:
        assert policy.limit_bytes <= max(request, request * ns.max_limit_ratio)


policy_entries = st.dictionaries(
    st.sampled_from(["maxLimitRatio", "allowNonPreemptible", "allowUnswappable", "bogus"]), ratios, max_size=3
)
policy_sections = st.dictionaries(
    st.sampled_from(["default", "namespaces", "bogus"]),
    st.one_of(
        yaml_values,
        policy_entries,
        st.dictionaries(st.one_of(st.sampled_from(["team", "Bad NS", ""]), st.integers()), policy_entries),
    ),
    max_size=3,
)


@settings(max_examples=400, deadline=None)
@given(st.one_of(yaml_values, policy_sections))
def test_a_policy_section_of_any_shape_gives_a_config_or_a_config_error_naming_it(section: Any) -> None:
    try:
        cfg = load(overrides={"nodeName": "n", "policy": section})
    except ConfigError as e:
        assert str(e).startswith("policy"), str(e)
        return
    for ns in ("team", "other"):
        asked = ann.ContainerPolicy(request_bytes=GiB, limit_bytes=4 * GiB, limit_key=ann.MEMORY_LIMIT)
        policy, _ = policy_mod.enforce(asked, ns, cfg.policy, container="main", format_bytes=format_bytes)
        assert GiB <= policy.limit_bytes <= 4 * GiB


def test_a_max_limit_ratio_of_1e300_is_refused_naming_key_and_value_and_never_overflows() -> None:
    with pytest.raises(ConfigError, match=r"policy\.default\.maxLimitRatio: 1e\+300 must be"):
        load(overrides={"nodeName": "n", "policy": {"default": {"maxLimitRatio": 1e300}}})
    # A policy made without the config's checks still caps without raising.
    huge = policy_mod.PolicyConfig(policy_mod.NamespacePolicy(max_limit_ratio=1e300))
    asked = ann.ContainerPolicy(request_bytes=GiB, limit_bytes=8 * GiB, limit_key=ann.MEMORY_LIMIT)
    policy, caps = policy_mod.enforce(asked, "team", huge, container="main", format_bytes=format_bytes)
    assert (policy.limit_bytes, caps) == (8 * GiB, [])
    two = policy_mod.PolicyConfig(policy_mod.NamespacePolicy(max_limit_ratio=2))
    policy, caps = policy_mod.enforce(asked, "team", two, container="main", format_bytes=format_bytes)
    assert policy.limit_bytes == 2 * GiB and "8.00 x the request" in caps[0].message
