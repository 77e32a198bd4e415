"""A refused annotation is told once, not again on every change to the pod's other annotations.

A tenant (or any controller) may rewrite an unrelated annotation of its pod as often as the
apiserver lets it; each change makes the agent apply the pod's policy again. A refusal
that has not changed must not become a new log line and Event each time. Real pod on
kmock's apiserver, the agent's PodIdentity and pod cache (tests/fixtures/arbiter_harness.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest

from gpufrac.core import annotations as ann
from tests.fixtures.arbiter_harness import ArbiterNode, GiB

pytestmark = pytest.mark.security


def test_a_refused_annotation_is_told_once_whatever_else_changes(
    make_node: Callable[..., ArbiterNode], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    node = make_node()
    a = node.add("a", 2, "1e400", start=False)
    for i in range(3):  # an unrelated annotation rewritten: the policy is applied again each time
        node.v1.patch_namespaced_pod(
            "a", "default", {"metadata": {"annotations": {"example.com/beat": str(i)}}}
        )
        node.until(
            lambda i=i: node.identity.pods.by_uid(a.uid).annotations.get("example.com/beat") == str(i),  # type: ignore[union-attr]
            what="the change in the pod cache",
        )
        node.on_loop(lambda: node.identity.resolve(node.listing))
    assert a.config().limit_bytes == 2 * GiB  # still refused: limit = request
    lines = [r.getMessage() for r in caplog.records if ann.MEMORY_LIMIT in r.getMessage()]
    assert len(lines) == 1 and "1e400" in lines[0], lines
    # Fixed, then broken again: each new refusal is told.
    node.v1.patch_namespaced_pod("a", "default", {"metadata": {"annotations": {ann.MEMORY_LIMIT: "1e401"}}})
    node.until(
        lambda: node.identity.pods.by_uid(a.uid).annotations.get(ann.MEMORY_LIMIT) == "1e401",  # type: ignore[union-attr]
        what="the change in the pod cache",
    )
    node.on_loop(lambda: node.identity.resolve(node.listing))
    lines = [r.getMessage() for r in caplog.records if ann.MEMORY_LIMIT in r.getMessage()]
    assert len(lines) == 2 and "1e401" in lines[1], lines
