"""The kubelet emulator's contract and the agent's answers to kubelet events."""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Callable

import grpc
import pytest

from gpufrac.core.slices import FRACTION, MEMORY, SOCKETS
from gpufrac.deviceplugin.podresources import PodResourcesClient
from gpufrac.proto import deviceplugin_pb2 as pb
from gpufrac.proto import deviceplugin_pb2_grpc as pb_grpc
from gpufrac.proto import podresources_pb2 as pr
from gpufrac.proto import podresources_pb2_grpc as pr_grpc
from gpufrac.simgpu.kubelet import AdmissionError, Container, KubeletEmulator, Pod
from tests.fixtures.agentsim import Sim


def register(k: KubeletEmulator, **fields: str) -> grpc.RpcError:
    req = pb.RegisterRequest(version="v1beta1", endpoint="nothing.sock", resource_name="example.com/x")
    for name, value in fields.items():
        setattr(req, name, value)
    with grpc.insecure_channel(f"unix://{k.kubelet_socket}") as ch, pytest.raises(grpc.RpcError) as exc:
        pb_grpc.RegistrationStub(ch).Register(req, timeout=30)
    return exc.value


def test_register_errors_read_like_the_kubelet() -> None:
    with tempfile.TemporaryDirectory(prefix="gfk", dir="/tmp") as root, KubeletEmulator(root) as k:
        err = register(k, version="v1alpha")
        assert err.details() == (
            'requested API version "v1alpha" is not supported by kubelet. Supported version is ["v1beta1"]'
        )
        assert register(k, resource_name="kubernetes.io/gpu").details() == (
            'the ResourceName "kubernetes.io/gpu" is invalid'
        )
        # nobody serves the endpoint: the dial-back inside Register fails the call
        assert "failed to connect to new client" in register(k).details()


def test_kubelet_restart_wipes_sockets_and_agent_registers_again(sim: Sim) -> None:
    k = sim.kubelet
    pod = sim.admit("keep", MEMORY, 10)
    before = {r: len(k.registrations(r)) for r in (FRACTION, MEMORY)}
    k.restart()
    k.wait_for(lambda: all(len(k.registrations(r)) > before[r] for r in (FRACTION, MEMORY)), 30)
    sim.wait_registered(30)
    assert all((k.device_plugin_dir / s).exists() for s in SOCKETS.values())
    # the allocation survived on both sides and capacity sync still accounts for it
    (g,) = sim.gpus_of(pod)
    k.wait_for(lambda: sim.healthy_on(FRACTION, g) < 100, 30)
    assert sim.admit("after", FRACTION, 10)


def test_stream_end_marks_unhealthy_and_agent_registers_again(sim: Sim) -> None:
    k = sim.kubelet
    before = len(k.registrations(FRACTION))
    k.drop_stream(FRACTION)
    k.wait_for(lambda: len(k.registrations(FRACTION)) > before, 30)
    sim.wait_registered(30)
    # the new stream's first snapshot brings every device back Healthy
    k.wait_for(lambda: k.allocatable(FRACTION) == 800, 30)
    assert sim.admit("after-drop", FRACTION, 30)


def test_unregistered_resource_and_exhaustion_errors(sim: Sim) -> None:
    with pytest.raises(AdmissionError) as exc:
        sim.kubelet.admit(Pod("default", "x", [Container("main", {"example.com/none": 1})]))
    assert exc.value.message == (
        "Allocate failed due to cannot allocate unregistered device example.com/none, which is unexpected"
    )
    with pytest.raises(AdmissionError) as exc:
        sim.admit("huge", MEMORY, 10_000)
    assert "requested number of devices unavailable for gpufrac.dev/gpu-memory. Requested: 10000" in str(
        exc.value
    )


def test_pod_resources_lists_pods_and_agent_releases_deleted_ones(sim: Sim) -> None:
    a = sim.admit("a", FRACTION, 40)
    b = sim.admit("b", MEMORY, 8)

    async def ask() -> tuple[list, dict]:
        client = PodResourcesClient(str(sim.kubelet.pod_resources_socket))
        try:
            return await client.list(), await client.allocatable()
        finally:
            await client.close()

    listed, alloc = asyncio.run(ask())
    assert {(c.pod, c.container, c.resource, len(c.device_ids)) for c in listed} == {
        ("a", "main", FRACTION, 40),
        ("b", "main", MEMORY, 8),
    }
    assert len(alloc[FRACTION]) == sim.kubelet.allocatable(FRACTION)
    k = sim.kubelet
    # Like the kubelet, the emulator lists one device per entry. The agent still sees two
    # containers of 40 and 8 slices, bound to their pods, across reconciles; reading each
    # entry as a container released both and booked 48 one-slice containers in their place.
    with grpc.insecure_channel(f"unix://{k.pod_resources_socket}") as ch:
        raw = pr_grpc.PodResourcesListerStub(ch).List(pr.ListPodResourcesRequest(), timeout=30)
    (pod_a,) = [p for p in raw.pod_resources if p.name == "a"]
    assert [len(d.device_ids) for d in pod_a.containers[0].devices] == [1] * 40
    k.wait_for(
        lambda: (
            sorted((x["pod"], len(x["device_ids"])) for x in sim.agent.state()["allocations"])
            == [("a", 40), ("b", 8)]
        ),
        30,
    )
    assert len(sim.agent.container_dirs()) == 2
    (g,) = sim.gpus_of(a)
    k.delete(a)  # no RPC: the agent learns it from pod-resources
    k.wait_for(lambda: len(sim.agent.container_dirs()) == 1, 30)
    k.wait_for(lambda: sim.healthy_on(FRACTION, g) == 100 or g in sim.gpus_of(b), 30)
    # The state file follows through the agent's persist loop, a moment after the release.
    k.wait_for(lambda: [x["pod"] for x in sim.agent.state()["allocations"]] == ["b"], 30)


def test_a_refused_pod_resources_call_leaves_the_calls_beside_it_alone() -> None:
    """The kubelet rate-limits pod-resources (burst 10). The agent's calls overlap (Allocate,
    the reconcile loop, identity): a refusal of one must not cancel the others, as closing
    their shared channel did; an Allocate handler cancelled that way never answered."""

    async def scenario(k: KubeletEmulator) -> tuple[list[object], object]:
        client = PodResourcesClient(str(k.pod_resources_socket))
        try:
            await client.list()  # connected before the storm
            results = await asyncio.gather(*(client.list() for _ in range(40)), return_exceptions=True)
            await asyncio.sleep(0.2)  # the limiter refills
            return results, await client.list()
        finally:
            await client.close()

    with tempfile.TemporaryDirectory(prefix="gfk", dir="/tmp") as root, KubeletEmulator(root) as k:
        results, after = asyncio.run(scenario(k))
    refused = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
    answered = [r for r in results if isinstance(r, list)]
    assert refused and answered, results
    assert all(r.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for r in refused)
    assert len(refused) + len(answered) == len(results), [type(r).__name__ for r in results]
    assert after == []  # the same client goes on working


def test_slices_of_a_deleted_pod_go_to_the_next_pod_at_once(make_sim: Callable[..., Sim]) -> None:
    # No periodic release in this test: Allocate itself must notice the old holder is gone.
    # Two GPUs, both booked: the kubelet has nothing else to hand out, whatever the agent prefers.
    sim = make_sim("a100x2-nvlink", reconcile_interval=300, release_grace=300)
    k = sim.kubelet
    old = sim.admit("old", FRACTION, 100)
    filler = sim.admit("filler", FRACTION, 100)
    old_devices = k.pod_devices(old.uid)
    k.delete(old)
    new = sim.admit("new", FRACTION, 100)
    assert k.pod_devices(new.uid) == old_devices
    k.delete(filler)
    part = sim.admit("part", FRACTION, 30)  # the deleted filler's slices: all that is left
    part_ids = set(k.pod_devices(part.uid)["main"][FRACTION])
    k.delete(part)
    again = sim.admit("again", FRACTION, 80)  # 70 unbooked slices, then 10 of the deleted pod's
    again_ids = set(k.pod_devices(again.uid)["main"][FRACTION])
    assert len(again_ids & part_ids) == 10
    k.wait_for(lambda: sorted(str(a["pod"]) for a in sim.agent.state()["allocations"]) == ["again", "new"])
    assert len(sim.agent.container_dirs()) == 2


def test_slices_a_deleted_pod_still_books_are_preferred_last(make_sim: Callable[..., Sim]) -> None:
    # The agent has not released the deleted pod yet (no reconcile ran). Its slices make their
    # GPU look fullest, so binpack alone would pick exactly them, and Allocate would first have
    # to ask pod-resources who holds them. Other slices fit, so the next pod gets those.
    sim = make_sim(reconcile_interval=300, release_grace=300)
    k = sim.kubelet
    old = sim.admit("old", MEMORY, 4)
    old_ids = set(k.pod_devices(old.uid)["main"][MEMORY])
    old_gpus = sim.gpus_of(old)
    k.delete(old)
    new = sim.admit("new", MEMORY, 4)
    assert not old_ids & set(k.pod_devices(new.uid)["main"][MEMORY])
    assert sim.gpus_of(new) == old_gpus  # still binpack: the same GPU, its other slices


def test_a_started_container_is_released_at_the_next_reconcile(make_sim: Callable[..., Sim]) -> None:
    # The grace protects an Allocate the kubelet has not recorded yet. Once PreStartContainer
    # has come, the kubelet holds it: missing from a later List means deleted, and its memory
    # goes back then, not after the grace (300 s here).
    sim = make_sim(reconcile_interval=0.2, release_grace=300)
    k = sim.kubelet
    pod = sim.admit("short", MEMORY, 8)
    gpu = sim.gpus_of(pod).pop()
    before = sim.healthy_on(FRACTION, gpu)
    k.delete(pod)
    k.wait_for(lambda: sim.agent.state()["allocations"] == [], 20)
    k.wait_for(lambda: sim.healthy_on(FRACTION, gpu) > before, 20)
