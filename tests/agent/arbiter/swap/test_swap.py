"""Swap on a simulated node: real cuda-python processes under the real shim in real cgroups,
the fake driver's checkpoint API across processes, the arbiter on its socket.

A burst that does not fit swaps an idle, swappable container to host RAM (NVML stops
showing its memory, its pod stays Running); the victim's next launch asks for its memory
back, the arbiter arbitrates that like any burst, and its buffers hold the same bytes."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pynvml
import pytest

from gpufrac.agent.arbiter.swap import resolver as swap_mod
from gpufrac.agent.arbiter.swap.checkpoint import Support
from gpufrac.agent.arbiter.swap.files import Swapped
from gpufrac.agent.arbiter.swap.resolver import SwapResolver
from gpufrac.agent.kube.events import REASON_FREED_BY_SWAP
from gpufrac.agent.processes.proc import proc_identity
from gpufrac.core import native
from gpufrac.memguard import abi
from gpufrac.simgpu.nodestate import NodeState
from gpufrac.simgpu.workload import RESULT_BYTES
from tests.fixtures.arbiter_harness import ArbiterNode, Box, CudaApp, GiB, MiB
from tests.fixtures.kube import KubeServer
from tests.fixtures.polling import until
from tests.fixtures.simnode import nvml_node

TIMEOUT = 120.0
RESULT = RESULT_BYTES  # every workload also holds check_u32's result buffer


# -- for test_idle_swap.py, which imports these (its owner moves it to arbiter_harness.start_cuda) --
# The same real workload, answering the older aggregate protocol: "alloc N V" -> "ok"/"oom",
# "check" (every buffer) -> "checked <mismatches>", "free" (every buffer) -> "ok".
WORKLOAD = "import runpy; runpy.run_module('gpufrac.simgpu.workload', run_name='__main__')"


class Gpu:
    def __init__(self, node: ArbiterNode, box: Box, sim_state: Path) -> None:
        self.app = node.start_cuda(box, sim_state, TIMEOUT)
        self.c, self.pid = self.app.c, self.app.pid
        self.ids: list[str] = []

    def do(self, cmd: str, timeout: float = TIMEOUT) -> str:
        word, *_ = cmd.split()
        if word == "check":
            answers = [self.app.do(f"check {i}", timeout) for i in self.ids]
            return f"checked {sum(int(a.split()[1]) if a != 'ok' else 0 for a in answers)}"
        if word == "free":
            answers = [self.app.do(f"free {i}", timeout) for i in self.ids]
            self.ids.clear()
            return "ok" if all(a == "ok" for a in answers) else " ".join(answers)
        answer = self.app.do(cmd, timeout)
        if word == "alloc" and answer.startswith("ok "):
            self.ids.append(answer.split()[1])
            return "ok"
        return answer


@pytest.fixture(scope="module")
def node_file(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    import ctypes

    # The agent's side of the checkpoint API is cuda-python in this process: the fake
    # libcuda.so.1 loaded first is what it finds by soname. Its cuInit binds one node
    # state per process, so the tests of this module share one node, reset for each.
    ctypes.CDLL(str(native.library(native.FAKE_CUDA)), mode=ctypes.RTLD_GLOBAL)
    # Contexts cost nothing on this node: the tests follow a victim's bytes through swap-out
    # and back to the byte, and size bursts against a GPU filled to a few GiB.
    with nvml_node(tmp_path_factory.mktemp("swap"), context_memory=0) as path:
        yield path


@pytest.fixture
def sim_state(node_file: Path) -> Path:
    """The module's node as new: no processes (the last test's are gone), nothing used,
    the checkpoint API on."""
    with NodeState(node_file) as st:
        for slot in st.node.procs:
            slot.used_bytes = slot.swapped_bytes = slot.ckpt_state = slot.api_inflight = 0
            slot.pid = 0
        for i in range(st.node.gpu_count):
            st.node.gpus[i].used_bytes = 0
        st.node.checkpoint_supported = 1
        del slot
    return node_file


def make_node(kube: KubeServer, **extra: Any) -> ArbiterNode:
    overrides: dict[str, Any] = {
        "paths": {"shimHostPath": str(native.library(native.SHIM))},
        "resolvers": ["swap", "evict", "wait"],
        "swap": {"idleThreshold": "1s"},
    }
    overrides.update(extra)
    return ArbiterNode(kube, overrides)


@pytest.fixture
def node(sim_state: Path, kube_server: KubeServer) -> Iterator[ArbiterNode]:
    n = make_node(kube_server)
    try:
        yield n
    finally:
        n.close()


def fill_gpu(node: ArbiterNode, sim_state: Path, leave_free: int) -> None:
    """Something outside gpufrac takes all but `leave_free` of GPU 0 (NVML shows it), and the
    arbiter has seen it: it trusts an NVML reading for up to a second (arbiter.NVML_STALE)."""
    with NodeState(sim_state) as st:
        g = st.gpus[0]
        g.used_bytes += g.total_bytes - g.reserved_bytes - g.used_bytes - leave_free
        del g  # the mapping closes only when no structure points into it
    alloc = node.boxes[0].alloc
    until(
        lambda: node.on_loop(lambda: node.arbiter.grantable(alloc)) <= leave_free,
        what="the arbiter to see it",
    )


def gpu_pids() -> dict[int, int]:
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    return {p.pid: p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)}


def idle(node: ArbiterNode, box: Box) -> None:
    threshold = node.cfg.swap.idle_threshold
    node.until(
        lambda: any(
            h.alloc.key == box.alloc.key and h.idle_s >= threshold
            for h in node.arbiter.resolution.holdings(node.gpu)
        ),
        timeout=TIMEOUT,
        what=f"{box.pod} idle for {threshold}s",
    )


def swap_victim_out(node: ArbiterNode, sim_state: Path) -> tuple[Box, CudaApp, CudaApp, SwapResolver]:
    """A swappable victim holding 6 GiB (two buffers, 1111 and 2222) swapped out, on a GPU
    filled from outside, for a requester's 4 GiB burst: the victim's box and app, the
    requester's app (holding buffers 1 and 2) and the swap resolver."""
    victim = node.add("victim", 2, "8Gi", start=False)
    node.swappable(victim)
    v = node.start_cuda(victim, sim_state)
    assert v.do(f"alloc {2 * GiB} 1111") == "ok 1"
    assert v.do(f"alloc {4 * GiB} 2222") == "ok 2"
    requester = node.add("requester", 2, "8Gi", start=False)
    r = node.start_cuda(requester, sim_state)
    assert r.do(f"alloc {2 * GiB} 3333") == "ok 1"
    fill_gpu(node, sim_state, leave_free=2 * GiB)
    idle(node, victim)
    assert r.do(f"alloc {4 * GiB} 4444") == "ok 2"  # the victim is swapped out for it
    swap = node.arbiter.swap
    assert swap is not None and swap.is_swapped(victim.alloc.key)
    return victim, v, r, swap


def events(kube: KubeServer, reason: str, pod: str) -> list[dict[str, Any]]:
    return [
        e for e in kube.events("default") if e.get("reason") == reason and e["involvedObject"]["name"] == pod
    ]


def test_swap_frees_the_victim_and_it_resumes_with_its_bytes(
    node: ArbiterNode,
    sim_state: Path,
    kube_server: KubeServer,
) -> None:
    victim = node.add("victim", 2, "8Gi", start=False)
    node.swappable(victim)
    v = node.start_cuda(victim, sim_state)
    assert v.do(f"alloc {2 * GiB} 1111") == "ok 1"  # guarantee
    assert v.do(f"alloc {4 * GiB} 2222") == "ok 2"  # burst, granted: the GPU is empty
    requester = node.add("requester", 2, "8Gi", start=False)
    r = node.start_cuda(requester, sim_state)
    assert r.do(f"alloc {2 * GiB} 3333") == "ok 1"
    fill_gpu(node, sim_state, leave_free=2 * GiB)  # a 4 GiB burst does not fit any more
    assert gpu_pids()[v.pid] == 6 * GiB + RESULT
    idle(node, victim)

    # The requester's burst swaps the idle victim out and is granted.
    assert r.do(f"alloc {4 * GiB} 4444") == "ok 2"
    swap = node.arbiter.swap
    assert swap is not None and swap.is_swapped(victim.alloc.key)
    assert v.pid not in gpu_pids()  # NVML: the victim holds no GPU memory any more
    assert gpu_pids()[r.pid] == 6 * GiB + RESULT
    assert v.c.alive()
    assert node.v1.read_namespaced_pod("victim", "default").status.phase == "Running"
    assert swap.host_ram_used == 6 * GiB + RESULT
    assert victim.config().grant_bytes == 0  # its burst is arbitrated again on the way back
    node.until(lambda: bool(events(kube_server, swap_mod.REASON_SWAPPED_OUT, "victim")), what="Event")
    node.until(lambda: bool(events(kube_server, REASON_FREED_BY_SWAP, "requester")), what="Event")
    (out,) = events(kube_server, swap_mod.REASON_SWAPPED_OUT, "victim")
    assert "6.0Gi" in out["message"] and "default/requester" in out["message"]

    # The victim's next launch needs its 6 GiB back: they are free once the requester is done.
    v.send("check 1")
    assert r.do("free 1") == "ok" and r.do("free 2") == "ok"
    r.c.stop()
    assert v.line() == "ok"  # its buffers' bytes as they were written
    assert v.do("check 2") == "ok"
    assert not swap.is_swapped(victim.alloc.key)
    assert gpu_pids()[v.pid] == 6 * GiB + RESULT
    assert victim.config().grant_bytes == 4 * GiB + RESULT  # its burst, granted again
    assert all(s.swapped == 0 for s in abi.read_usage(victim.alloc.directory).slots)
    node.until(lambda: bool(events(kube_server, swap_mod.REASON_SWAPPED_IN, "victim")), what="Event")
    assert swap.stats.swapped_out == 1 and swap.stats.swapped_in == 1


def test_swap_unavailable_is_said_once_and_the_chain_moves_on(
    node: ArbiterNode, sim_state: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with NodeState(sim_state) as st:
        st.node.checkpoint_supported = 0  # a driver without the checkpoint API
    victim = node.add("victim", 2, "8Gi", start=False)
    node.swappable(victim)
    v = node.start_cuda(victim, sim_state)
    assert v.do(f"alloc {4 * GiB} 1") == "ok 1"
    requester = node.add("requester", 2, "8Gi", wait_timeout="1s", start=False)
    r = node.start_cuda(requester, sim_state)
    fill_gpu(node, sim_state, leave_free=GiB)
    idle(node, victim)
    with caplog.at_level(logging.WARNING):
        # Swap steps aside; evict has no lower-priority burst to take; wait times out.
        assert r.do(f"alloc {4 * GiB} 2") == "oom"
        assert r.do(f"alloc {4 * GiB} 2") == "oom"
    said = [m for m in caplog.messages if "swap" in m and "unavailable" in m]
    # Two collisions, one warning from each layer (the swap resolver, the resolver chain), with the why.
    assert len(said) == len(set(said)) == 2 and all("not supported" in m for m in said), said
    assert len([m for m in said if m.startswith("swap:")]) == 1
    assert gpu_pids()[v.pid] == 4 * GiB + RESULT  # nothing was swapped
    assert node.arbiter.swap is not None and not node.arbiter.swap.swapped


def test_host_ram_budget_bounds_what_is_swapped(sim_state: Path, kube_server: KubeServer) -> None:
    node = make_node(kube_server, swap={"idleThreshold": "1s", "hostRamBudget": "5Gi"})
    try:
        victim = node.add("victim", 2, "8Gi", start=False)
        node.swappable(victim)
        v = node.start_cuda(victim, sim_state)
        assert v.do(f"alloc {6 * GiB} 1") == "ok 1"  # 6 GiB would not fit in the 5 GiB budget
        requester = node.add("requester", 2, "8Gi", wait_timeout="1s", start=False)
        r = node.start_cuda(requester, sim_state)
        fill_gpu(node, sim_state, leave_free=GiB)
        idle(node, victim)
        assert r.do(f"alloc {4 * GiB} 2") == "oom"
        assert gpu_pids()[v.pid] == 6 * GiB + RESULT
        assert node.arbiter.swap is not None and node.arbiter.swap.host_ram_used == 0
    finally:
        node.close()


class NoopCheckpointer:
    """The checkpoint API as a no-op: for swap-outs and swap-ins of the stand-in workload."""

    available = True

    def detect(self) -> Support:
        return Support(True, driver_version=12080)

    def swap_out(self, pids: list[int], lock_ms: int) -> None:
        pass

    def swap_in(self, pids: list[int], gone: Callable[[int], bool] = lambda pid: False) -> list[int]:
        return pids


def test_a_swap_out_undone_is_not_counted_or_announced_as_a_swap_in(
    node: ArbiterNode, monkeypatch: pytest.MonkeyPatch
) -> None:
    box = node.add("victim", 2, "8Gi")
    assert box.workload is not None and box.workload.do(f"alloc {64 * MiB}") == "fast"
    assert box.container is not None
    swap = node.arbiter.swap
    assert swap is not None
    swap.ckpt = NoopCheckpointer()  # type: ignore[assignment]
    pid = box.container.proc.pid
    monkeypatch.setattr(swap, "_prepare", lambda alloc: [(pid, (1, 1))])
    monkeypatch.setattr(swap_mod, "launches_of", lambda directory, slots: 1)  # it launched meanwhile
    posted: list[str] = []
    monkeypatch.setattr(
        node.arbiter.resolution, "event", lambda alloc, type_, reason, message: posted.append(reason)
    )
    (h,) = [
        h
        for h in node.on_loop(lambda: node.arbiter.resolution.holdings(node.gpu))
        if h.alloc.key == box.alloc.key
    ]
    with pytest.raises(swap_mod._Skip, match="became active"):
        node.on_loop(lambda: swap._swap_out(h, node.gpu, "a test", needed_by="a test"))
    assert swap.stats.reverted == 1
    assert (swap.stats.swapped_out, swap.stats.swapped_in) == (0, 0)
    assert posted == []  # neither SwappedOut nor SwappedIn: for its pod nothing happened
    assert not swap.is_swapped(box.alloc.key)


@pytest.mark.parametrize(
    ("slices", "swapped", "restored_at_once"),
    [
        # v asks for 2 GiB of burst back (4 GiB swapped, 2 GiB request): it queues behind a
        # (same priority, earlier) instead of being restored at once.
        (2, 4 * GiB, False),
        # v was swapped holding no more than its 8 GiB request: what it asks back is guaranteed,
        # and a guarantee never waits, whoever queues for a burst.
        (8, 2 * GiB, True),
    ],
)
def test_a_swap_in_queues_behind_a_waiter_for_burst_bytes_only(
    node: ArbiterNode, slices: int, swapped: int, restored_at_once: bool
) -> None:
    # a waits for 8 GiB with 4 GiB free when the swapped-out v asks to come back.
    filler = node.add("filler", 30, "78Gi", priority=1000, preemptible=False)
    a = node.add("a", 2, "20Gi", wait_timeout="120s")
    v = node.add("v", slices, "8Gi", wait_timeout="500ms")  # within the head-of-line bound (1 s)
    for box in (filler, a, v):
        assert box.workload is not None and box.workload.do(f"alloc {box.alloc.request_bytes}") == "fast"
    free = node.on_loop(lambda: node.arbiter.grantable(filler.alloc))
    assert filler.workload is not None and filler.workload.do(f"alloc {free - 4 * GiB}") == "granted"
    assert a.workload is not None and v.container is not None
    a.workload.send(f"alloc {8 * GiB}")
    node.until(lambda: sum(len(w) for w in node.arbiter.queue.waiters.values()) == 1, what="a waiting")
    swap = node.arbiter.swap
    assert swap is not None
    swap.ckpt = NoopCheckpointer()  # type: ignore[assignment]
    ident = proc_identity(v.container.proc.pid)
    assert ident is not None
    entry = Swapped(v.alloc, node.gpu, swapped, (v.container.proc.pid,), (ident,))
    node.on_loop(lambda: swap.swapped.__setitem__(v.alloc.key, entry))
    try:
        # Not restored: it waited its 0.5 s behind a, with no burst granted.
        assert node.on_loop(lambda: swap.swap_in(v.alloc)) is restored_at_once
        assert swap.is_swapped(v.alloc.key) is not restored_at_once
        assert restored_at_once or v.config().grant_bytes == 0
    finally:
        node.on_loop(lambda: swap.swapped.pop(v.alloc.key, None))
    assert filler.workload.do(f"free {5 * GiB}") == "granted"
    assert a.workload.line() == "granted"


def test_a_new_container_on_a_swapped_out_ones_slices_is_not_taken_for_it(node: ArbiterNode) -> None:
    """Keys are the device set's: a container booked on the slices of one that went while
    swapped out (not yet pruned) has its key. It is not swapped: its usage counts as it is."""
    box = node.add("new", 2, "8Gi")
    assert box.workload is not None and box.workload.do(f"alloc {GiB}") == "fast"
    swap = node.arbiter.swap
    assert swap is not None
    gone = dataclasses.replace(box.alloc)  # the released container that held these slices
    entry = Swapped(gone, node.gpu, 4 * GiB, (1,), ())
    node.on_loop(lambda: swap.swapped.__setitem__(box.alloc.key, entry))
    try:
        assert not swap.is_swapped(box.alloc.key)
        assert node.on_loop(lambda: node.arbiter.resolution.used(box.alloc)) == GiB
    finally:
        node.on_loop(lambda: swap.swapped.pop(box.alloc.key, None))


def test_an_agent_after_a_restart_takes_over_a_swapped_container_once(
    node: ArbiterNode, sim_state: Path
) -> None:
    """A new agent knows nothing of a container the previous one swapped out: the first
    SWAP_IN finds it from its usage file. Two processes of it asking at once must restore it
    once, and both go on."""
    victim, v, r, swap = swap_victim_out(node, sim_state)
    assert r.do("free 1") == "ok" and r.do("free 2") == "ok"
    r.c.stop()

    async def two_at_once() -> list[bool]:
        swap.swapped.clear()  # what an agent started afresh knows
        return list(await asyncio.gather(swap.swap_in(victim.alloc), swap.swap_in(victim.alloc)))

    assert node.on_loop(two_at_once) == [True, True]
    assert not swap.is_swapped(victim.alloc.key) and not swap._busy
    assert swap.stats.swapped_in == 1
    assert v.do("check 1") == "ok" and v.do("check 2") == "ok"
    assert gpu_pids()[v.pid] == 6 * GiB + RESULT
