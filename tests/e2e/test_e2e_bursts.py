"""Bursts end to end: real CUDA processes under the real shim, the real agent deciding.

Each pod's container is gpufrac.simgpu.workload (cuda-python over the fake libcuda) with
LD_PRELOAD of build/native/libmemguard.so, in a real cgroup, started from the kubelet
emulator's Allocate response; the agent is a subprocess with its device plugin, pod
identity (apiserver emulator) and arbiter. One 1 GiB GPU: 960 MiB allocatable in
64 MiB units, grant margin 16 MiB. Every workload holds an 8-byte result buffer, so a
container's usage is its buffers + 8 bytes.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable

import psutil

from gpufrac.agent.arbiter.resolvers import REASON_EVICTED, REASON_PREEMPTED
from gpufrac.memguard import abi
from gpufrac.simgpu import runtime as runtime_mod
from gpufrac.simgpu.workload import RESULT_BYTES, WorkloadProcess
from tests.fixtures.e2e import TIMEOUT, E2ENode, MiB, PodRun
from tests.fixtures.polling import until

MakeNode = Callable[..., E2ENode]
RESULT_BUF = RESULT_BYTES  # the workload's result buffer, allocated at start


def info(p: PodRun) -> tuple[int, int]:
    """cuMemGetInfo as the app sees it: (free, total)."""
    words = p.app.do("info").split()
    assert words[0] == "free" and words[2] == "total", words
    return int(words[1]), int(words[3])


def held_requests(node: E2ENode, pod: PodRun) -> int:
    """Requests the agent holds open on pod's own arbiter socket (accepted connections)."""
    sock = str(pod.host_dir / abi.SOCKET_DIR / abi.SOCKET_FILE)
    conns = psutil.Process(node.sim.agent.pid).net_connections("unix")
    return sum(1 for c in conns if c.laddr == sock) - 1  # less the listener


def test_burst_within_limit_is_granted_when_memory_is_free(e2e_node: MakeNode) -> None:
    node = e2e_node()
    a = node.run_pod("a", 4, "512Mi")  # request 256 MiB
    # What the app sees from the start: its limit, not the GPU.
    assert info(a) == (512 * MiB - RESULT_BUF, 512 * MiB)
    assert a.alloc(200 * MiB) == "ok 1"  # within the request: the fast path
    assert a.grant() == 0
    assert a.alloc(200 * MiB, 7) == "ok 2"  # 400 MiB: past the request, within the limit
    cfg = a.config()
    used = a.used()
    assert used == 400 * MiB + RESULT_BUF
    # The grant the agent published covers what the container uses, and stays within the limit.
    assert cfg.request_bytes == 256 * MiB
    assert cfg.request_bytes < used <= cfg.request_bytes + cfg.grant_bytes <= cfg.limit_bytes
    assert info(a) == (512 * MiB - used, 512 * MiB)
    assert a.app.do("check 2") == "ok"


def test_allocation_past_the_limit_fails_with_oom_and_the_process_goes_on(e2e_node: MakeNode) -> None:
    node = e2e_node()
    a = node.run_pod("a", 4, "512Mi")
    assert a.alloc(300 * MiB, 3) == "ok 1"
    assert a.alloc(300 * MiB) == "oom"  # 600 MiB > 512 MiB: CUDA_ERROR_OUT_OF_MEMORY, no crash
    assert a.alive()
    assert a.used() == 300 * MiB + RESULT_BUF  # the refused bytes were never counted
    slots = [s for s in abi.read_usage(a.host_dir).slots if s.pid > 0]
    assert [int(s.oom_refusals) for s in slots] == [1]
    # Still usable: its buffer is intact, and what fits the limit is still granted.
    assert a.app.do("check 1") == "ok"
    assert a.alloc(200 * MiB, 4) == "ok 2"
    assert a.app.do("check 2") == "ok"
    assert info(a)[1] == 512 * MiB


def hog(node: E2ENode, wait_timeout: str = "0s") -> PodRun:
    """Pod "a": bursts to 600 MiB of its 896 MiB limit, which leaves about 100 MiB of the
    GPU's 960 MiB for the bursts of a 256 MiB pod started next."""
    a = node.run_pod("a", 4, "896Mi", wait_timeout=wait_timeout)
    assert a.alloc(200 * MiB) == "ok 1"
    assert a.alloc(400 * MiB) == "ok 2"  # a burst of 344 MiB: granted
    return a


def test_waiting_burst_gets_memory_the_holder_frees(e2e_node: MakeNode) -> None:
    node = e2e_node()
    b = node.run_pod("b", 4, "768Mi", wait_timeout="90s")
    a = hog(node)
    assert b.alloc(200 * MiB, 5) == "ok 1"  # within b's request
    b.send(f"alloc {200 * MiB} 6")  # b's burst does not fit: it waits in the agent
    until(lambda: held_requests(node, b) >= 1, what="b's burst held by the agent")
    assert b.app.proc.poll() is None
    # a frees its burst: the shim gives the grant back at once, and b's allocation goes through.
    assert a.app.do("free 2") == "ok"
    assert b.app.line(TIMEOUT) == "ok 2"
    until(lambda: a.grant() == 0, what="a's grant returned")
    assert b.used() == 400 * MiB + RESULT_BUF <= b.config().request_bytes + b.grant()
    assert b.app.do("check 1") == "ok" and b.app.do("check 2") == "ok"
    assert a.app.do("check 1") == "ok"
    # It came back through the shim's release, not the agent's stale-grant sweep (10 s).
    assert "taking back" not in node.sim.agent.log()


def test_holder_exiting_without_freeing_gives_its_grant_back(e2e_node: MakeNode) -> None:
    node = e2e_node()
    b = node.run_pod("b", 4, "768Mi", wait_timeout="90s")
    a = hog(node)
    assert b.alloc(200 * MiB) == "ok 1"
    b.send(f"alloc {200 * MiB}")
    until(lambda: held_requests(node, b) >= 1, what="b's burst held by the agent")
    # a's stdin closes: the workload returns with its buffers still allocated. The shim's
    # exit hands the grant back (usage.grant_returned), the driver frees the memory.
    assert a.app.proc.stdin is not None
    a.app.proc.stdin.close()
    until(lambda: not a.alive(), what="a exited")
    assert a.container.proc.returncode == 0
    assert b.app.line(TIMEOUT) == "ok 2"
    until(lambda: a.grant() == 0, what="a's grant returned")
    assert "taking back" not in node.sim.agent.log()  # not the agent's 10 s stale-grant sweep


def test_waiting_burst_times_out_into_oom(e2e_node: MakeNode) -> None:
    node = e2e_node()
    b = node.run_pod("b", 4, "768Mi", wait_timeout="2s")
    a = hog(node)
    assert b.alloc(200 * MiB) == "ok 1"
    # Nobody frees: after its wait timeout b's allocation fails with OOM (no hang, no crash).
    assert b.alloc(200 * MiB) == "oom"
    assert b.alive() and b.used() == 200 * MiB + RESULT_BUF
    assert b.app.do("check 1") == "ok"
    assert a.app.do("check 2") == "ok" and a.used() == 600 * MiB + RESULT_BUF


def test_evict_kills_the_lower_priority_borrower_only(e2e_node: MakeNode) -> None:
    node = e2e_node(resolvers=["evict", "wait"])
    # c: guaranteed memory only. d: a burst, but not preemptible. a: a preemptible burst.
    c = node.run_pod("c", 2, None)
    assert c.alloc(100 * MiB, 11) == "ok 1"
    d = node.run_pod("d", 2, "384Mi", preemptible=False)
    assert d.alloc(100 * MiB, 12) == "ok 1" and d.alloc(150 * MiB, 13) == "ok 2"
    a = node.run_pod("a", 2, "640Mi", preemptible=True)
    assert a.alloc(100 * MiB) == "ok 1" and a.alloc(300 * MiB) == "ok 2"
    d_grant = d.grant()
    assert d_grant > 0 and a.grant() > 0
    # h: high priority; its burst does not fit in what is left (about 54 MiB).
    h = node.run_pod("h", 2, "512Mi", priority=1000, wait_timeout="60s")
    assert h.alloc(100 * MiB, 14) == "ok 1"
    assert h.alloc(200 * MiB, 15) == "ok 2"
    # a, the preemptible lower-priority borrower, was killed; its burst went to h.
    until(lambda: not a.alive(), what="a's process killed")
    assert a.container.proc.returncode == -9
    assert a.grant() == 0
    assert h.used() == 300 * MiB + RESULT_BUF <= h.config().request_bytes + h.grant()
    # Nobody else was touched: guaranteed memory, and the non-preemptible burst.
    assert c.alive() and c.app.do("check 1") == "ok"
    assert d.alive() and d.app.do("check 1") == "ok" and d.app.do("check 2") == "ok"
    assert d.grant() == d_grant
    assert h.app.do("check 2") == "ok"
    # Both pods were told, in Events: who needed the memory, and from whom it was taken.
    evicted = until(lambda: node.events(a, REASON_EVICTED), what="the Evicted event on a")
    preempted = until(lambda: node.events(h, REASON_PREEMPTED), what="the Preempted event on h")
    assert evicted[0]["type"] == "Warning" and "pod default/h" in evicted[0]["message"]
    assert "pod default/a" in preempted[0]["message"]
    assert not node.events(c, REASON_EVICTED) and not node.events(d, REASON_EVICTED)


def test_forged_identity_gets_nothing_for_the_container(e2e_node: MakeNode) -> None:
    node = e2e_node()
    a = node.run_pod("a", 4, "768Mi")
    b = node.run_pod("b", 4, "768Mi")
    before = a.config()
    gen = abi.generation(a.host_dir)
    # Outside any pod's cgroup, with a's environment (its config, usage file and the socket).
    outsider = WorkloadProcess(
        subprocess.Popen(
            WorkloadProcess.argv(), env=a.container.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE
        ),
        "outsider",
        TIMEOUT,
    )
    try:
        assert outsider.do(f"alloc {400 * MiB}") == "oom"  # a burst for a: refused
    finally:
        outsider.close()
    assert a.config() == before and abi.generation(a.host_dir) == gen  # nothing granted to a
    # Inside b's container (it enters b's cgroup as the runtime's processes do), reaching a's files
    # and socket: it acts for b, never for a.
    procs = str(b.container.cgroup_dir / "cgroup.procs")
    env = {**a.container.env, "GPUFRAC_RUNTIME_CGROUP_PROCS": procs}
    inside_b = WorkloadProcess(
        subprocess.Popen(
            ["/bin/sh", "-c", runtime_mod._ENTER, "sh", *WorkloadProcess.argv()],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        ),
        "inside-b",
        TIMEOUT,
    )
    try:
        assert inside_b.proc.pid in b.container.pids()
        assert inside_b.do(f"alloc {400 * MiB}") == "oom"  # a's config never carries a grant for it
    finally:
        inside_b.close()
    assert a.config() == before and abi.generation(a.host_dir) == gen
    # a itself is still served.
    assert a.alloc(400 * MiB) == "ok 1"
    assert a.grant() > 0


def test_agent_killed_while_a_burst_waits(e2e_node: MakeNode) -> None:
    node = e2e_node()
    b = node.run_pod("b", 4, "768Mi", wait_timeout="30s")
    a = hog(node)
    assert b.alloc(100 * MiB, 2) == "ok 1"
    b.send(f"alloc {300 * MiB}")
    until(lambda: held_requests(node, b) >= 1, what="b's burst held by the agent")
    node.sim.agent.kill()  # kill -9 while b's thread waits
    # The connection closed with the agent: b's allocation fails with OOM now, not at its timeout.
    assert b.app.line(TIMEOUT) == "oom"
    assert b.alive()
    # While the agent is away, the fast path goes on; bursts are refused, never granted blindly.
    assert b.alloc(100 * MiB, 3) == "ok 2"
    assert b.app.do("check 1") == "ok" and b.app.do("check 2") == "ok"
    assert a.app.do("free 2") == "ok"  # its release cannot reach anyone
    assert b.alloc(200 * MiB) == "oom"
    assert b.grant() == 0
    node.sim.restart_agent()
    # Back: a's unused grant is taken back, and b's bursts are granted again.
    until(lambda: a.grant() == 0, what="a's unused grant reconciled")
    until(lambda: b.alloc(200 * MiB, 4) == "ok 3", what="b's burst granted by the restarted agent")
    assert b.used() == 400 * MiB + RESULT_BUF <= b.config().request_bytes + b.grant()
    assert b.app.do("check 3") == "ok"
