"""The idle reaper's `swap` action on a simulated node: real cuda-python processes under the
real shim in real cgroups, the fake driver's checkpoint API across processes, the arbiter
(and its swap resolver) on its socket, pods and Events on kmock's apiserver.

An idle interactive pod that allows swapping is warned, then its GPU memory goes to host
RAM through the swap resolver's one swap-out path (the pod stays Running); its next launch
brings the memory back through the shim's SWAP_IN with every byte intact. A pod that cannot
be swapped gets the notify fallback, naming why. The swap resolver's `swap_out` refuses,
saying why, what it must not swap."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_swap import (  # noqa: F401 (pytest fixtures node_file, sim_state)
    RESULT,
    TIMEOUT,
    WORKLOAD,
    Gpu,
    events,
    gpu_pids,
    make_node,
    node_file,
    sim_state,
)

from gpufrac.agent.arbiter.swap import resolver as swap_mod
from gpufrac.agent.booking.ledger import ContainerAlloc
from gpufrac.agent.gpu.activity import ActivityTracker
from gpufrac.agent.idle.actions import swap_via
from gpufrac.agent.idle.reaper import IdleReaper
from gpufrac.core import annotations
from gpufrac.core.slices import FRACTION, FRACTION_SLICES, device_id
from gpufrac.memguard import abi
from gpufrac.simgpu.nodestate import NodeState
from tests.fixtures.arbiter_harness import ArbiterNode, Box, GiB, MiB
from tests.fixtures.kube import KubeServer, kube_server, request_order  # noqa: F401 (pytest fixture)
from tests.fixtures.memguard import read_line

# Short durations: warned after 2 s without GPU work, acted on 1 s later.
IDLE = {"interval": "100ms", "action": "swap", "idleTimeout": "2s", "gracePeriod": "1s"}
INTERACTIVE = {annotations.WORKLOAD_CLASS: "interactive"}
SWAPPABLE = {annotations.SWAPPABLE: "true"}


def annotate(node: ArbiterNode, box: Box, ann: dict[str, str]) -> None:
    """The pod's annotations change; the agent applies its new policy to the container."""
    node.v1.patch_namespaced_pod(box.pod, "default", {"metadata": {"annotations": ann}})

    def seen() -> bool:
        pod = node.identity.pods.by_uid(box.uid)  # type: ignore[union-attr]
        return pod is not None and all(pod.annotations.get(k) == v for k, v in ann.items())

    node.until(seen, what=f"{box.pod}'s annotations in the pod cache")
    node.on_loop(lambda: node.identity.resolve(node.listing))


@contextlib.contextmanager
def reaping(node: ArbiterNode) -> Iterator[IdleReaper]:
    """The agent's idle task on the node's loop: activity from the usage files and NVML, the
    reaper swapping through the arbiter's swap resolver as the agent wires it (gpufrac.agent.main)."""

    async def start() -> tuple[IdleReaper, asyncio.Task[None]]:
        tracker = await asyncio.to_thread(ActivityTracker.with_nvml)
        reaper = IdleReaper(
            node.cfg,
            node.ledger,
            tracker,
            node.identity,
            swapper=lambda alloc, reason: swap_via(node.arbiter, alloc, reason),
            metrics=node.metrics,
        )
        return reaper, asyncio.create_task(reaper.run())

    reaper, task = node.on_loop(start)

    async def stop() -> None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.to_thread(reaper.tracker.close)

    try:
        yield reaper
    finally:
        node.on_loop(stop)


@pytest.fixture
def idle_node(sim_state: Path, kube_server: KubeServer) -> Iterator[ArbiterNode]:  # noqa: F811
    n = make_node(kube_server, idle=IDLE)
    try:
        yield n
    finally:
        n.close()


def swap_resolver(node: ArbiterNode) -> swap_mod.SwapResolver:
    assert node.arbiter.swap is not None
    return node.arbiter.swap


def apiserver_order(kube: KubeServer) -> list[str]:
    """Event reasons (and evictions) in the order the apiserver received them."""
    return request_order(kube)


def test_idle_swappable_pod_is_warned_swapped_and_resumes_with_its_bytes(
    idle_node: ArbiterNode,
    sim_state: Path,  # noqa: F811
    kube_server: KubeServer,  # noqa: F811
) -> None:
    node = idle_node
    nb = node.add("nb", 2, "8Gi", start=False)
    annotate(node, nb, {**INTERACTIVE, **SWAPPABLE})
    assert nb.config().flags & abi.FLAG_SWAPPABLE
    w = Gpu(node, nb, sim_state)
    assert w.do(f"alloc {GiB} 1111") == "ok"  # within its guarantee
    assert w.do(f"alloc {2 * GiB} 2222") == "ok"  # a burst, granted: the GPU is empty
    held = 3 * GiB + RESULT
    assert gpu_pids()[w.pid] == held and nb.config().grant_bytes > 0
    swap = swap_resolver(node)

    with reaping(node) as reaper:
        node.until(lambda: swap.is_swapped(nb.alloc.key), timeout=TIMEOUT, what="nb swapped out")
        node.until(lambda: bool(events(kube_server, "IdleSwapped", "nb")), timeout=TIMEOUT, what="Event")
        assert reaper.records.get("IdleSwapped") == 1

    # NVML no longer counts its memory; host RAM holds it; the pod is Running, not evicted.
    assert w.pid not in gpu_pids()
    assert swap.host_ram_used == held
    assert nb.config().grant_bytes == 0  # its burst is arbitrated again on the way back
    assert w.c.alive()
    assert node.v1.read_namespaced_pod("nb", "default").status.phase == "Running"
    order = apiserver_order(kube_server)
    assert order.index("IdleWarning:nb") < order.index("IdleSwapped:nb")
    assert not [o for o in order if o.startswith("eviction:")]
    (warned,) = events(kube_server, "IdleWarning", "nb")
    assert "will swap it to host RAM" in warned["message"]
    (record,) = events(kube_server, "IdleSwapped", "nb")
    assert "idle-timeout 2s from node config idle.idleTimeout" in record["message"]
    assert "3.0Gi of GPU memory of pod default/nb container main swapped to host RAM" in record["message"]
    node.until(lambda: bool(events(kube_server, swap_mod.REASON_SWAPPED_OUT, "nb")), what="Event")
    (out,) = events(kube_server, swap_mod.REASON_SWAPPED_OUT, "nb")
    assert "idle reaper" in out["message"] and "no GPU work for" in out["message"]

    # Asked again while swapped: refused, saying so.
    ok, why = node.on_loop(lambda: swap.swap_out(nb.alloc, "test"))
    assert not ok and "already in host RAM" in why

    # Its next launch asks for the memory back (the shim's SWAP_IN), which is free.
    assert w.do("check") == "checked 0"  # every word of both buffers as it was written
    assert not swap.is_swapped(nb.alloc.key)
    assert gpu_pids()[w.pid] == held
    assert nb.config().grant_bytes == held - 2 * GiB  # its burst above the 2 GiB guarantee, granted again
    assert all(s.swapped == 0 for s in abi.read_usage(nb.alloc.directory).slots)
    node.until(lambda: bool(events(kube_server, swap_mod.REASON_SWAPPED_IN, "nb")), what="Event")
    assert swap.stats.swapped_out == 1 and swap.stats.swapped_in == 1


def test_idle_pod_that_cannot_be_swapped_is_notified_with_the_reason(
    idle_node: ArbiterNode,
    sim_state: Path,  # noqa: F811
    kube_server: KubeServer,  # noqa: F811
) -> None:
    node = idle_node
    nb = node.add("nb", 2, "8Gi", start=False)
    annotate(node, nb, INTERACTIVE)  # interactive, but it does not allow swapping
    assert not nb.config().flags & abi.FLAG_SWAPPABLE
    w = Gpu(node, nb, sim_state)
    assert w.do(f"alloc {GiB} 7") == "ok"

    with reaping(node) as reaper:
        node.until(lambda: bool(events(kube_server, "IdleNotify", "nb")), timeout=TIMEOUT, what="IdleNotify")
        assert reaper.records == {"IdleNotify": 1}

    (record,) = events(kube_server, "IdleNotify", "nb")
    assert record["type"] == "Warning"
    assert "swap to host RAM failed" in record["message"]
    assert f"does not allow swapping (annotation {annotations.SWAPPABLE}" in record["message"]
    assert "notified only" in record["message"]
    assert gpu_pids()[w.pid] == GiB + RESULT  # its memory untouched, on the GPU
    assert not swap_resolver(node).swapped
    assert events(kube_server, swap_mod.REASON_SWAPPED_OUT, "nb") == []
    assert w.do("check") == "checked 0"


def test_idle_pod_on_a_node_that_cannot_swap_is_notified_with_the_reason(
    idle_node: ArbiterNode,
    sim_state: Path,  # noqa: F811
    kube_server: KubeServer,  # noqa: F811
) -> None:
    node = idle_node
    with NodeState(sim_state) as st:
        st.node.checkpoint_supported = 0  # a driver without the checkpoint API
    nb = node.add("nb", 2, "8Gi", start=False)
    annotate(node, nb, {**INTERACTIVE, **SWAPPABLE})
    w = Gpu(node, nb, sim_state)
    assert w.do(f"alloc {GiB} 7") == "ok"

    with reaping(node):
        node.until(lambda: bool(events(kube_server, "IdleNotify", "nb")), timeout=TIMEOUT, what="IdleNotify")

    msg = events(kube_server, "IdleNotify", "nb")[0]["message"]
    assert "swap to host RAM is unavailable on this node" in msg and "not supported" in msg
    ok, why = node.on_loop(lambda: swap_resolver(node).swap_out(nb.alloc, "test"))
    assert not ok and why.startswith("swap to host RAM is unavailable on this node")
    assert gpu_pids()[w.pid] == GiB + RESULT


def bare_process(box: Box) -> subprocess.Popen[str]:
    """A second CUDA process in the box's container (its cgroup), started without the shim,
    as a program that drops LD_PRELOAD (or a static binary) would run."""
    assert box.container is not None
    env = {k: v for k, v in box.container.env.items() if k != "LD_PRELOAD"}
    procs = env["GPUFRAC_RUNTIME_CGROUP_PROCS"]
    enter = 'echo $$ > "$0" && exec "$@"'  # into the container's cgroup before any CUDA call
    p = subprocess.Popen(
        ["/bin/sh", "-c", enter, procs, sys.executable, "-c", WORKLOAD],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert read_line(p, TIMEOUT).strip() == "ready"  # it holds a CUDA context
    return p


def test_swap_out_refuses_what_it_must_not_swap(
    sim_state: Path,  # noqa: F811
    kube_server: KubeServer,  # noqa: F811
) -> None:
    node = make_node(kube_server, swap={"hostRamBudget": "1Gi"})
    swap = swap_resolver(node)
    whole: ContainerAlloc | None = None
    bare: subprocess.Popen[str] | None = None

    def swap_out(alloc: ContainerAlloc) -> tuple[bool, str]:
        return node.on_loop(lambda: swap.swap_out(alloc, "a test asked"))

    try:
        # A whole GPU is never swapped.
        gpu1 = node.ledger.inventory.gpus[1].uuid
        ids = [device_id(gpu1, FRACTION, i) for i in range(FRACTION_SLICES)]
        whole = node.on_loop(lambda: node.ledger.allocate(FRACTION, ids))
        assert whole.whole_gpu
        ok, why = swap_out(whole)
        assert not ok and "whole GPU" in why

        # More than the host-RAM budget allows.
        big = node.add("big", 2, "8Gi", start=False)
        annotate(node, big, SWAPPABLE)
        b = Gpu(node, big, sim_state)
        assert b.do(f"alloc {2 * GiB} 3") == "ok"
        ok, why = swap_out(big.alloc)
        assert not ok and "would not fit in the host RAM left for swap" in why
        assert "swap.hostRamBudget 1Gi" in why
        assert gpu_pids()[b.pid] == 2 * GiB + RESULT

        # A CUDA process of the container outside the shim could never ask to come back.
        mixed = node.add("mixed", 1, "2Gi", start=False)
        annotate(node, mixed, SWAPPABLE)
        m = Gpu(node, mixed, sim_state)
        assert m.do(f"alloc {256 * MiB} 4") == "ok"
        bare = bare_process(mixed)
        ok, why = swap_out(mixed.alloc)
        assert not ok and f"process {bare.pid} uses CUDA outside the memguard shim" in why
        assert m.pid in gpu_pids() and bare.pid in gpu_pids()  # both left running on the GPU
        assert not swap.swapped and swap.stats.swapped_out == 0
        assert all(s.swapped == 0 for s in abi.read_usage(mixed.alloc.directory).slots)
        assert m.do("check") == "checked 0"
    finally:
        if bare is not None:
            bare.kill()
            bare.wait(30)
        if whole is not None:
            node.on_loop(lambda: node.ledger.release(whole.key))
        node.close()
