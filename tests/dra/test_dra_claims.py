"""Claims as device-plugin pods are: parameters read as annotations are (a bad value: the safe
default and one Event naming field, value and reason), the operator's namespace policy capping
them, `gpufrac status` listing them, and the idle reaper judging an interactive claim's pod."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gpufrac.agent.status.client import fetch
from tests.fixtures.dra import DraNode, params
from tests.fixtures.polling import until

MakeNode = Callable[..., DraNode]
GiB = 1 << 30


def events(node: DraNode, kind: str, name: str, reason: str) -> list[dict[str, Any]]:
    return [
        e
        for e in node.kube.events("default")
        if (e.get("involvedObject") or {}).get("kind") == kind
        and e["involvedObject"].get("name") == name
        and e.get("reason") == reason
    ]


def test_bad_parameters_get_the_safe_default_and_one_event_each(dra_node: MakeNode) -> None:
    node = dra_node()
    uid = node.create_claim(
        "c", "8Gi", config=[params(memoryLimit="500Gi", preemptible="no", workloadClass="batch")]
    )
    pod = node.run("p", ["c"])
    entry = node.state_claims()[uid]
    assert entry["config"]["limit_bytes"] == 8 * GiB  # limit = request
    until(
        lambda: len(events(node, "ResourceClaim", "c", "InvalidClaimParameter")) == 2,
        what="two InvalidClaimParameter Events on the claim",
    )
    messages = sorted(e["message"] for e in events(node, "ResourceClaim", "c", "InvalidClaimParameter"))
    assert messages[0].startswith(
        'claim parameter memoryLimit="500Gi" ignored for claim default/c: 500Gi is above'
    )
    assert "applied the safe default limit = request (8Gi)" in messages[0]
    assert messages[1].startswith(
        'claim parameter preemptible="no" ignored for claim default/c: must be a boolean'
    )
    # The pod changing (a re-apply of the claim's policy) says nothing again.
    node.kube.core_v1().patch_namespaced_pod("p", "default", {"metadata": {"labels": {"x": "y"}}})
    node.create_claim("d", "1Gi")
    node.run("q", ["d"])  # another prepare and refresh later
    assert all(e.get("count", 1) == 1 for e in events(node, "ResourceClaim", "c", "InvalidClaimParameter"))
    assert len(events(node, "ResourceClaim", "c", "InvalidClaimParameter")) == 2
    assert pod.uid in {c[0] for c in node.state_claims()[uid]["consumers"]}


def test_the_namespace_policy_caps_a_claims_limit(dra_node: MakeNode) -> None:
    node = dra_node(policy={"default": {"maxLimitRatio": 2, "allowNonPreemptible": False}})
    uid = node.create_claim("c", "8Gi", config=[params(memoryLimit="20Gi", preemptible=False)])
    node.run("p", ["c"])
    cfg = node.state_claims()[uid]["config"]
    assert cfg["limit_bytes"] == 16 * GiB and cfg["flags"] & 2  # capped at 2 x 8Gi; preemptible
    capped = until(lambda: events(node, "ResourceClaim", "c", "GpuPolicyCapped"), what="GpuPolicyCapped")
    assert any("maxLimitRatio 2: limit 16Gi applied" in e["message"] for e in capped)
    applied = until(lambda: events(node, "ResourceClaim", "c", "GpuLimitApplied"), what="GpuLimitApplied")
    assert "limit 16Gi (request 8Gi) from memoryLimit, capped by the node policy" in applied[0]["message"]


def test_status_lists_the_claim_and_the_reaper_judges_its_pod(dra_node: MakeNode) -> None:
    node = dra_node(idle={"idleTimeout": "1s", "gracePeriod": "1s", "interval": "200ms", "action": "notify"})
    node.create_claim("nb", "2Gi", config=[params(workloadClass="interactive")])
    node.run("notebook", ["nb"])
    status = fetch(str(node.root / "status.sock"))
    assert status["ready"] and status["registered"] == {"gpufrac.dev": True}
    (c,) = status["containers"]
    assert (c["namespace"], c["pod"], c["claim"], c["request_bytes"]) == (
        "default",
        "notebook",
        "nb",
        2 * GiB,
    )
    # No GPU work: the interactive claim's pod is warned, then notified (idle.action notify).
    until(lambda: events(node, "Pod", "notebook", "IdleWarning"), what="IdleWarning on the claim's pod")
    notified = until(
        lambda: events(node, "Pod", "notebook", "IdleNotify"), what="IdleNotify on the claim's pod"
    )
    assert "class interactive" in notified[0]["message"]
