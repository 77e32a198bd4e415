"""A container is judged by what it holds on each GPU, however many allocations it has.

The watchdog and the driver's count resolve a process to its pod and container, then to the
allocations that container holds on that GPU (gpufrac.agent.processes.callers.PeerLookup.owner): a
container that asked for both resources holds two (its limit there is theirs summed, its
memory split between them), and another container of a gpufrac pod that asked for none (a
sidecar that sees the GPUs) holds none: its limit there is 0, and its memory is its own.
Were either taken for "no gpufrac container", it would be reported and never killed, its
memory counted for nobody, and a neighbour's allocation inside its guarantee would fail.

One 1 GiB GPU (992 MiB usable, 960 MiB allocatable, 64 MiB units; gpu-fraction slices of
9.6 MiB); the real agent, real shim, real workload processes in real cgroups
(tests/fixtures/e2e.py).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from gpufrac.agent.kube.events import REASON_EVICTED, REASON_LIMIT_ENFORCED, REASON_OVER_LIMIT
from gpufrac.core import annotations as ann
from gpufrac.core.slices import FRACTION, MEMORY
from gpufrac.memguard import abi
from gpufrac.simgpu.kubelet import Container as KContainer
from gpufrac.simgpu.kubelet import Pod
from gpufrac.simgpu.runtime import mounts_of
from gpufrac.simgpu.workload import WorkloadProcess
from tests.fixtures.e2e import NODE, E2ENode, MiB, PodRun
from tests.fixtures.hostile_tenant import agent_alive, agent_config
from tests.fixtures.kube import pod_manifest
from tests.fixtures.pod_containers import set_statuses, start_in_pod
from tests.fixtures.polling import until

pytestmark = pytest.mark.security

MakeNode = Callable[..., E2ENode]


def run_with_both_resources(node: E2ENode, name: str) -> tuple[PodRun, list[Path]]:
    """A pod whose one container asks for 2 gpu-memory units (128 MiB) and 10 gpu-fraction
    slices (96 MiB): the kubelet allocates each resource, the agent books two allocations.
    Its process runs without the shim. Returns it and its two host directories."""
    annotations = {ann.PREEMPTIBLE: "true"}
    pod = Pod("default", name, [KContainer("main", {MEMORY: 2, FRACTION: 10})], annotations=annotations)
    node.v1.create_namespaced_pod(
        "default", pod_manifest(name, node=NODE, annotations=annotations, uid=pod.uid)
    )
    node.sim.kubelet.admit(pod)
    envs: dict[str, str] = {}
    mounts = []
    dirs = []
    for resource in (MEMORY, FRACTION):
        resp = node.sim.kubelet.allocate_response(pod.uid, "main", resource)
        envs.update(resp.envs)  # the kubelet merges the plugins' envs, the later winning
        mounts += mounts_of(resp)
        config = next(m for m in resp.mounts if m.container_path.endswith("/" + abi.CONFIG_FILE))
        dirs.append(Path(config.host_path).parent)
    c, app = start_in_pod(node, pod, "main", envs=envs, mounts=mounts, shim=False)
    set_statuses(node, pod, {"main": (c, 0)})
    until(
        lambda: all(abi.read_config(d).pod_uid == pod.uid for d in dirs),
        what=f"{name}'s two allocations tied to its container",
    )
    return PodRun(name, pod, dirs[0], c, app), dirs


def sidecar_of(node: E2ENode, pod: PodRun) -> WorkloadProcess:
    """A second container of `pod` that asked for no GPU memory, without the shim, which
    sees the GPU all the same (NVIDIA_VISIBLE_DEVICES=all on a real node)."""
    c, app = start_in_pod(node, pod.pod, "sidecar", shim=False)
    set_statuses(node, pod.pod, {"main": (pod.container, 0), "sidecar": (c, 0)})
    return app


def killed_for_it(node: E2ENode, pod: PodRun) -> list[dict[str, object]]:
    return node.events(pod, REASON_LIMIT_ENFORCED) + node.events(pod, REASON_EVICTED)


def test_a_container_holding_two_allocations_is_held_to_them(e2e_node: MakeNode) -> None:
    node = e2e_node(**agent_config())
    a, _ = run_with_both_resources(node, "a")  # limits 128 + 96 MiB on the GPU
    b = node.run_pod("b", 8, None, wait_timeout="20s")  # request 512 MiB
    # All the free memory, past both limits (224 MiB + the 16 MiB allowance).
    assert a.app.do(f"alloc {700 * MiB} 1") in ("ok 1", "<exited>")
    # b allocates inside its guarantee: a's memory must go, within the interval.
    assert b.alloc(480 * MiB) == "ok 1"
    assert b.app.do("check 1") == "ok"
    until(lambda: not a.alive(), what="a's process to be killed")
    until(lambda: killed_for_it(node, a), what="the Event on a")
    assert killed_for_it(node, b) == []
    assert agent_alive(node)


def test_a_sidecar_without_an_allocation_has_a_limit_of_0(e2e_node: MakeNode) -> None:
    node = e2e_node(**agent_config())
    a = node.run_pod("a", 2, "256Mi")  # its main container: request 128 MiB, limit 256 MiB
    b = node.run_pod("b", 8, None, wait_timeout="20s")  # request 512 MiB
    sidecar = sidecar_of(node, a)
    assert sidecar.do(f"alloc {700 * MiB} 1") in ("ok 1", "<exited>")
    assert b.alloc(480 * MiB) == "ok 1"
    assert b.app.do("check 1") == "ok"
    until(lambda: sidecar.proc.poll() is not None, what="the sidecar's process to be killed")
    # By b's reclaim at admission or by the watchdog, whichever came first: an Event on a.
    (ev,) = until(lambda: killed_for_it(node, a), what="the Event on a")
    assert f"process {sidecar.proc.pid}" in str(ev["message"]), ev
    assert "sidecar" in str(ev["message"]) and "no gpufrac allocation" in str(ev["message"]), ev
    # Its pod's main container, within its own limit, is not touched.
    assert a.alive() and a.alloc(64 * MiB) == "ok 1"
    assert killed_for_it(node, b) == []
    assert agent_alive(node)


def sidecars_of(node: E2ENode, pod: PodRun, n: int) -> list[WorkloadProcess]:
    """`n` more containers of `pod` that asked for no GPU memory (sidecars), without the shim."""
    started = {"main": (pod.container, 0)}
    apps = []
    for i in range(n):
        c, app = start_in_pod(node, pod.pod, f"sidecar{i}", shim=False)
        started[f"sidecar{i}"] = (c, 0)
        apps.append(app)
    set_statuses(node, pod.pod, started)
    return apps


@pytest.mark.parametrize("mode", ["enforce", "report"])
def test_three_sidecars_cannot_cost_a_neighbour_its_guarantee(e2e_node: MakeNode, mode: str) -> None:
    """Three sidecars of a's pod hold 15 MiB each, each within what an allowance per container
    gave (16 MiB here): 45 MiB booked to nobody, more than the GPU's 32 MiB nobody may book.
    A sidecar has no allowance (none for a container holding no allocation on the GPU), and a
    guarantee's reclaim takes such memory back first, whatever the watchdog's mode: b's
    allocation of its whole request succeeds. In enforce mode the watchdog kills the sidecars;
    in report mode it reports them, and b's reclaim kills as many as it needs, newest first."""
    node = e2e_node(**agent_config(watchdog={"mode": mode}))
    a = node.run_pod("a", 2, "256Mi")  # its main container: request 128 MiB, limit 256 MiB
    b = node.run_pod("b", 13, None, wait_timeout="20s")  # request 832 MiB: the GPU's last unit
    # Within its request (each workload process holds a few bytes of its own from its start).
    assert a.alloc(127 * MiB) == "ok 1"
    sidecars = sidecars_of(node, a, 3)
    for s in sidecars:
        assert s.do(f"alloc {15 * MiB} 1") in ("ok 1", "<exited>")
    if mode == "report":
        # The agent knows them for a's sidecars, each over its limit of 0: reported, not killed.
        until(
            lambda: len(node.events(a, REASON_OVER_LIMIT)) >= 3,
            what="the three sidecars reported over their limit of 0",
        )
        assert all(s.proc.poll() is None for s in sidecars)
    # 992 - 127 - 45 = 820 MiB free: b's 824 MiB, within its request, need 4 MiB of theirs
    # (29 MiB with the grant margin and what a and b may still charge within their requests).
    assert b.alloc(824 * MiB) == "ok 1"
    assert b.app.do("check 1") == "ok"
    if mode == "report":
        # Killed as needed, newest first: two of them (30 MiB); the first is left alone.
        until(
            lambda: sidecars[2].proc.poll() is not None and sidecars[1].proc.poll() is not None,
            what="the two newest sidecars killed",
        )
        assert sidecars[0].proc.poll() is None
        evicted = until(lambda: node.events(a, REASON_EVICTED), what="the Event on a's pod")
        assert any("no gpufrac allocation" in str(e["message"]) for e in evicted), evicted
    else:
        until(lambda: all(s.proc.poll() is not None for s in sidecars), what="the sidecars killed")
    # a's main container, within its limit, is not touched, nor is b.
    assert a.alive() and a.app.do("check 1") == "ok"
    assert killed_for_it(node, b) == []
    assert agent_alive(node)
