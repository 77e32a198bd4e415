"""DRA mode across restarts: agent kill -9, upgrade (SIGTERM and a start), kubelet restart.
Prepared claims are kept, nothing is booked twice, the slice comes back after the kubelet
deletes it, an unknown unprepare succeeds."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.fixtures.dra import DRIVER, DraNode, params
from tests.fixtures.polling import until

MakeNode = Callable[..., DraNode]
GiB = 1 << 30


def booked_per_gpu(node: DraNode) -> dict[str, int]:
    """Bytes the agent's state file books per GPU."""
    out: dict[str, int] = {}
    for a in node.agent.state()["allocations"]:
        gpu = a["config"]["gpu_uuid"]
        out[gpu] = out.get(gpu, 0) + a["config"]["request_bytes"]
    return out


@pytest.mark.slow  # three agent starts
def test_agent_kill_9_and_upgrade_keep_prepared_claims_and_book_nothing_twice(dra_node: MakeNode) -> None:
    node = dra_node()
    a = node.create_claim("a", "8Gi", config=[params(memoryLimit="12Gi", workloadClass="interactive")])
    node.kubelet.run_pod(node.schedule("pa", ["a"]))  # no waiting for the state file's batch
    answer = node.kubelet.prepared()[a].cdi_ids
    # On file before the kubelet had its answer: nothing of it is lost to a kill -9 right after
    # (the state file's batch may not have come yet: the claim's record in its directory has).
    node.agent.kill()
    node.restart_agent()
    until(lambda: list(node.state_claims()) == [a], what="the claim booked after the restart")
    assert booked_per_gpu(node) == {node.gpus[0]: 8 * GiB}
    assert node.state_claims()[a]["config"]["limit_bytes"] == 12 * GiB
    # The restarted agent reads the claim's parameters again (its policy, for the reaper).
    limit_line = "claim default/a: GPU memory limit 12Gi"
    until(lambda: node.agent.log().count(limit_line) == 2, what="the claim's policy applied again")
    # The kubelet sends nothing after a driver restart; a retry of it answers as before.
    again = node.kubelet.prepare_raw(DRIVER, [("default", "a", a)])
    assert list(again.claims[a].devices[0].cdi_device_ids) == answer
    # The scheduler fills gpu-0's 21 units with a 13 GiB claim: the agent books it beside a,
    # not over it (21 GiB of the 21.5 GiB capacity), and the next claim goes to gpu-1.
    b = node.create_claim("b", "13Gi")
    c = node.create_claim("c", "1Gi")
    node.run("pb", ["b"])
    node.run("pc", ["c"])
    assert booked_per_gpu(node) == {node.gpus[0]: 21 * GiB, node.gpus[1]: 1 * GiB}
    assert sorted(node.state_claims()) == sorted([a, b, c])
    # An upgrade: the agent stopped (SIGTERM) and started again, the kubelet sending nothing.
    node.agent.stop()
    node.restart_agent()
    until(lambda: sorted(node.state_claims()) == sorted([a, b, c]), what="the claims after the upgrade")
    assert booked_per_gpu(node) == {node.gpus[0]: 21 * GiB, node.gpus[1]: 1 * GiB}
    assert node.kubelet.unprepare_raw(DRIVER, [("default", "b", b)]).claims[b].error == ""
    until(lambda: sorted(node.state_claims()) == sorted([a, c]), what="b released")


def test_kubelet_restart_resends_prepared_claims_and_the_slice_is_published_again(dra_node: MakeNode) -> None:
    node = dra_node()
    a = node.create_claim("a", "4Gi")
    node.run("pa", ["a"])
    generation = node.slice()["spec"]["pool"]["generation"]  # type: ignore[index]
    before = node.agent.state()["allocations"]
    sent = len(node.kubelet.sent())
    node.kubelet.restart()  # deletes the node's slices, finds the driver again, re-sends a
    assert node.kubelet.sent()[sent:] == [("NodePrepareResources", [a])]
    assert node.kubelet.prepared()[a].cdi_ids == [f"{DRIVER}/claim={a}"]
    published = until(node.slice, what="the slice published again after the kubelet deleted it")
    assert published["spec"]["pool"]["generation"] > generation
    until(lambda: "published again" in node.agent.log(), what="the agent saying it published again")
    # The same booking, once.
    after = node.agent.state()["allocations"]
    assert [(x["key"], x["device_ids"]) for x in after] == [(x["key"], x["device_ids"]) for x in before]
    # An unprepare of a claim this driver never saw is answered as a success.
    resp = node.kubelet.unprepare_raw(DRIVER, [("default", "gone", "uid-gone")])
    assert list(resp.claims) == ["uid-gone"] and not resp.claims["uid-gone"].error


def test_a_claim_deleted_while_its_unprepare_was_lost_is_released(dra_node: MakeNode) -> None:
    node = dra_node()
    a = node.create_claim("a", "4Gi")
    node.run("pa", ["a"])
    # The claim goes from the apiserver without the kubelet telling the driver (its unprepare
    # lost): the claim check releases the booking (dra.claimCheckInterval 1s here).
    node.resource.delete_namespaced_resource_claim("a", "default", _preload_content=False)
    until(lambda: a not in node.state_claims(), what="the booking of the deleted claim released")
    assert "the claim is gone from the apiserver" in node.agent.log()
    # Likewise a claim deallocated (its pods gone) whose unprepare never came.
    b = node.create_claim("b", "4Gi")
    node.run("pb", ["b"])
    node.allocator.deallocate("default", "b")
    until(lambda: b not in node.state_claims(), what="the booking of the deallocated claim released")
    assert "the claim holds nothing of this node any more" in node.agent.log()
