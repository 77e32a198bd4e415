"""Compute shares through the whole agent (`python -m gpufrac.agent.main`): the pods' annotations
read from the apiserver, the compute loop wired in by the composition root, what `gpufrac status`
serves and the Events a user sees (docs/compute.md). How well shares are held is
test_compute_shares.py's and the bench's business; here, that the agent says what it applies.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from gpufrac.agent.status.client import fetch
from gpufrac.core import annotations as ann
from tests.fixtures.e2e import NODE, E2ENode, PodRun
from tests.fixtures.polling import until

pytestmark = pytest.mark.slow

MakeNode = Callable[..., E2ENode]


def status_of(node: E2ENode, pod: PodRun) -> dict[str, Any]:
    doc = fetch(str(node.sim.root / "status.sock"))
    (c,) = [c for c in doc["containers"] if c["pod"] == pod.name]
    return c


def test_shares_from_annotations_status_and_events(e2e_node: MakeNode) -> None:
    node = e2e_node(policy={"namespaces": {"default": {"computeMode": "strict"}}})
    # 3 of the GPU's 15 memory units (a 20 % memory share), asking 70 % of its compute
    a = node.run_pod("a", 3, annotations={ann.COMPUTE_SHARE: "70"})
    # a bad value: the memory share instead, and one Event naming key, value and why
    b = node.run_pod("b", 6, annotations={ann.COMPUTE_SHARE: "70 percent please"})
    sa = until(
        lambda: (c := status_of(node, a))["compute_share"] is not None and c, what="a's compute share shown"
    )
    assert sa["compute_share"] == 0.7 and sa["compute_mode"] == "strict"
    sb = until(
        lambda: (c := status_of(node, b))["compute_share"] is not None and c, what="b's compute share shown"
    )
    assert abs(sb["compute_share"] - 0.4) < 0.001  # 6 of 15 units
    (bad,) = until(lambda: node.events(b, "InvalidAnnotation"), what="the InvalidAnnotation Event")
    assert ann.COMPUTE_SHARE in bad["message"] and "70 percent please" in bad["message"]
    assert "memory share" in bad["message"]
    # 70 % + 40 %: the GPU's shares cannot all be met; the Node and both pods are told
    for pod in (a, b):
        (ev,) = until(lambda p=pod: node.events(p, "GpuComputeOvercommitted"), what="the overcommit Event")
        assert ev["type"] == "Warning" and "110%" in ev["message"]
    on_node = [
        e
        for e in node.kube.events("default")
        if e["reason"] == "GpuComputeOvercommitted" and e["involvedObject"].get("kind") == "Node"
    ]
    assert [e["involvedObject"]["name"] for e in on_node] == [NODE]
