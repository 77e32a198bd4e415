"""memguard limits across the processes of a container: sharing one limit,
concurrency, killed processes, live limit changes, bad files.

Real processes under the real shim on a simulated node (see test_memguard.py).
Every case runs against the release and the ASan+UBSan builds (`flavour`).
"""

from __future__ import annotations

import mmap
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpufrac.memguard import abi, wire
from gpufrac.simgpu.nodestate import NodeState
from gpufrac.simgpu.workload import RESULT_BYTES, WorkloadProcess
from tests.fixtures.memguard import (
    CUDA_ERROR_OUT_OF_MEMORY,
    LIMIT,
    REQUEST,
    TIMEOUT,
    Container,
    MiB,
    Shim,
    grant_burst,
    read_line,
)
from tests.fixtures.polling import until


@pytest.fixture
def app(shim: Shim) -> Iterator[Callable[[Container], WorkloadProcess]]:
    """app(container) -> the GPU workload (gpufrac.simgpu.workload) running in it under the shim."""
    started: list[WorkloadProcess] = []

    def start(c: Container) -> WorkloadProcess:
        w = WorkloadProcess.spawn(shim.env(c), name=f"app{len(started)}", timeout=TIMEOUT)
        started.append(w)
        return w

    yield start
    for w in started:
        w.close()


def info(w: WorkloadProcess) -> tuple[int, int]:
    """cuMemGetInfo in the workload: (free, total)."""
    _, free, _, total = w.do("info").split()
    return int(free), int(total)


def nvml(w: WorkloadProcess) -> list[int]:
    """nvmlDeviceGetMemoryInfo in the workload: v1 total, free, used; v2 total, free, used, reserved."""
    return [int(t) for t in w.do("nvml").split() if t.isdigit()]


def exit_cleanly(w: WorkloadProcess) -> None:
    w.close()
    assert w.proc.returncode == 0, f"{w.name} exited with {w.proc.returncode}"


# --------------------------------------------------------------- one limit


def test_two_processes_share_one_limit_and_see_the_container(
    container: Callable[..., Container], app: Callable[[Container], WorkloadProcess]
) -> None:
    c = container(request=LIMIT, limit=LIMIT)
    a, b = app(c), app(c)
    base = 2 * RESULT_BYTES  # what each workload holds from its start
    assert a.do(f"alloc {60 * MiB}") == "ok 1"
    # The second process sees what is left of the container, not a GPU of its own.
    assert info(b) == (LIMIT - 60 * MiB - base, LIMIT)
    assert b.do(f"alloc {40 * MiB}") == "oom"  # CUDA_ERROR_OUT_OF_MEMORY
    assert b.do(f"alloc {30 * MiB}") == "ok 1"
    assert info(a) == (LIMIT - 90 * MiB - base, LIMIT)
    assert c.total() == 90 * MiB + base
    assert sorted(s.used_bytes for s in c.live_slots()) == [30 * MiB + RESULT_BYTES, 60 * MiB + RESULT_BYTES]
    assert a.do("free 1") == "ok"
    assert b.do(f"alloc {40 * MiB}") == "ok 2"
    exit_cleanly(a)
    exit_cleanly(b)
    assert c.total() == 0 and not c.live_slots()


def test_nvml_and_cuda_agree(
    container: Callable[..., Container], app: Callable[[Container], WorkloadProcess]
) -> None:
    c = container(request=LIMIT, limit=LIMIT)
    a, b = app(c), app(c)
    assert a.do(f"alloc {20 * MiB}") == "ok 1"
    assert b.do(f"alloc {10 * MiB}") == "ok 1"
    free, total = info(b)
    t1, f1, u1, t2, f2, u2, r2 = nvml(b)
    assert (free, total) == (LIMIT - 30 * MiB - 2 * RESULT_BYTES, LIMIT)
    assert (t1, f1, u1) == (total, free, total - free)
    assert (t2, f2, u2, r2) == (total, free, total - free, 0)
    assert t2 == f2 + u2 + r2


def test_past_the_limit_is_out_of_memory_not_a_crash(shim: Shim, container: Callable[..., Container]) -> None:
    c = container()
    lines = shim.ctest(c, "alloc", LIMIT + 1, "alloc", REQUEST + MiB, "alloc", 10 * MiB, "used")
    rcs = [ln.rc for ln in lines if ln.cmd == "alloc"]
    # Past the limit: refused. Past the request without an arbiter: refused too.
    assert rcs == [CUDA_ERROR_OUT_OF_MEMORY, CUDA_ERROR_OUT_OF_MEMORY, 0]
    used = lines[-1]
    assert used.int("mine") == used.int("total") == 10 * MiB
    assert used.int("refusals") == 2


def test_double_free_and_foreign_free_never_underflow(
    shim: Shim, container: Callable[..., Container]
) -> None:
    c = container()
    lines = shim.ctest(
        c, "alloc", 4 * MiB, "free", "refree", "freeptr", "0x7f0000001000", "used", "alloc", 5 * MiB, "used"
    )
    used = [ln for ln in lines if ln.cmd == "used"]
    assert used[0].int("total") == 0  # not 2**64 - 4 MiB
    assert used[1].int("total") == used[1].int("mine") == 5 * MiB
    assert c.total() == 0


def test_a_limit_raised_by_the_agent_applies_at_the_next_allocation(
    shim: Shim, container: Callable[..., Container]
) -> None:
    c = container(request=32 * MiB, limit=32 * MiB)
    p = shim.ctest_popen(c, "alloc", 24 * MiB, "alloc", 24 * MiB, "hold", "alloc", 24 * MiB, "used")
    try:
        assert read_line(p).startswith("init 0")
        assert read_line(p).startswith("alloc 0")
        assert read_line(p).startswith(f"alloc {CUDA_ERROR_OUT_OF_MEMORY}")
        assert read_line(p).startswith("hold 0")
        c.set(request_bytes=64 * MiB, limit_bytes=64 * MiB)  # the agent, in place
        assert p.stdin is not None
        p.stdin.write("\n")
        p.stdin.close()
        after, used = read_line(p), read_line(p)
        assert p.wait(timeout=120) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert after.startswith("alloc 0")
    assert f"mine={48 * MiB}" in used


def test_many_processes_and_threads_never_exceed_the_limit_and_end_at_zero(
    shim: Shim, container: Callable[..., Container]
) -> None:
    limit = 48 * MiB
    c = container(request=limit, limit=limit)
    node = NodeState(shim.sim_env["SIMGPU_STATE"])
    procs = [
        subprocess.Popen(
            shim.ctest_cmd("stress", 4, 3000, 6 * MiB, seed),
            env=shim.env(c),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed in range(4)
    ]
    pids = {p.pid for p in procs}
    peak_counted = peak_physical = 0
    while any(p.poll() is None for p in procs):
        peak_counted = max(peak_counted, c.total())
        # What the fake driver really handed out to these processes.
        physical = sum(pr.used_bytes for pr in node.live_procs() if pr.pid in pids)
        peak_physical = max(peak_physical, physical)
        time.sleep(0.005)
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    ok = sum(int(o.split("ok=")[1].split()[0]) for o, _ in outs)
    oom = sum(int(o.split("oom=")[1].split()[0]) for o, _ in outs)
    other = sum(int(o.split("other=")[1].split()[0]) for o, _ in outs)
    assert ok > 0 and oom > 0 and other == 0  # the limit was reached, and nothing else failed
    assert peak_counted <= limit and peak_physical <= limit
    assert c.total() == 0 and not c.live_slots()
    node.close()


def test_sigkill_during_allocation_deadlocks_nobody_and_is_reclaimed(
    shim: Shim, container: Callable[..., Container]
) -> None:
    c = container(request=LIMIT, limit=LIMIT)
    # A victim allocating and freeing in a loop, plus one holding memory.
    looper = shim.ctest_popen(c, "loop", 10_000_000, 8 * MiB)
    holder = shim.ctest_popen(c, "alloc", 40 * MiB, "hold")
    assert read_line(holder).startswith("init 0") and read_line(holder).startswith("alloc 0")
    until(lambda: any(s.pid == looper.pid and s.peak_bytes for s in c.live_slots()), what="looper allocating")
    looper.send_signal(signal.SIGKILL)
    holder.send_signal(signal.SIGKILL)
    looper.wait()
    holder.wait()
    # Nobody is stuck behind them: a new process gets the whole limit (it
    # reclaims the dead processes' bytes before refusing), exactly once.
    lines = shim.ctest(c, "alloc", LIMIT, "used", "free", "used")
    assert [ln.rc for ln in lines] == [0, 0, 0, 0, 0]
    assert lines[2].int("total") == LIMIT
    assert lines[4].int("total") == 0
    assert not [s for s in c.live_slots() if s.pid in (looper.pid, holder.pid)]


def _bump_config_seq(c: Container) -> None:
    """One step of the config's seqlock, as the agent's writer takes it."""
    with open(c.dir / abi.CONFIG_FILE, "r+b") as f, mmap.mmap(f.fileno(), 0) as mm:
        st = abi.ConfigStruct.from_buffer(mm)
        st.seq += 1
        del st  # release the buffer before the mapping closes


def test_agent_killed_mid_update_blocks_nobody(shim: Shim, container: Callable[..., Container]) -> None:
    """The agent dies half-way through a config update (seqlock left odd): the
    container's processes are refused, said once, not hung; once the config is
    consistent again, allocations go through."""
    c = container()
    _bump_config_seq(c)  # odd: the writer began and never finished
    p = subprocess.run(
        shim.ctest_cmd("alloc", MiB, "alloc", MiB, "info"),
        env=shim.env(c),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    assert [ln.split()[:2] for ln in p.stdout.splitlines()[1:3]] == [["alloc", "2"], ["alloc", "2"]]
    assert "free=0 " in p.stdout
    assert p.stderr.count("never completed") == 1
    _bump_config_seq(c)  # even: consistent again
    assert [ln.rc for ln in shim.ctest(c, "alloc", MiB, "free")] == [0, 0, 0]


# ------------------------------------------------------------- slow path and VMM


def _burst_server(path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.listen(8)
    return s


def test_reserve_counts_nothing_create_counts(shim: Shim, container: Callable[..., Container]) -> None:
    lines = shim.ctest(
        container(), "reserve", 1 << 36, "used", "vmm", 8 * MiB, "used", "unvmm", "used", "unreserve"
    )
    assert all(ln.rc == 0 for ln in lines), lines
    assert [ln.int("total") for ln in lines if ln.cmd == "used"] == [0, 8 * MiB, 0]


def test_burst_granted_by_the_agent_is_used(shim: Shim, container: Callable[..., Container]) -> None:
    """The agent's side of the slow path, done by hand: raise the grant in the
    config, then answer GRANTED; the shim retries within the new grant."""
    import threading

    c = container(arbiter_timeout_ms=5000)
    server = _burst_server(c.dir / abi.SOCKET_FILE)

    def agent() -> None:
        conn, _ = server.accept()
        with conn:
            grant_burst(c, conn)

    t = threading.Thread(target=agent)
    t.start()
    try:
        lines = shim.ctest(c, "alloc", REQUEST, "alloc", 8 * MiB, "used")
    finally:
        t.join(timeout=60)
        server.close()
    assert [ln.rc for ln in lines[:3]] == [0, 0, 0]
    assert lines[3].int("total") == REQUEST + 8 * MiB


def test_free_hands_unused_grant_back_to_the_agent(shim: Shim, container: Callable[..., Container]) -> None:
    """A free that leaves much of the grant unused tells the agent at once (op
    RELEASE, without waiting for a reply), once per config generation; with no
    agent to tell, the usage file's grant_returned counter says it instead."""
    grant = 128 * MiB
    c = container(limit=REQUEST + 2 * grant, grant_bytes=grant)
    server = _burst_server(c.dir / abi.SOCKET_FILE)
    try:
        # Within request + grant: the fast path; the two frees leave it all unused.
        lines = shim.ctest(c, "alloc", REQUEST + grant // 2, "free", "alloc", MiB, "free")
        server.setblocking(False)  # the workload has exited: what it sent is queued
        conn, _ = server.accept()
        req = wire.BurstRequest.from_buffer_copy(conn.recv(64))
        conn.close()
        with pytest.raises(BlockingIOError):  # the second free, same generation: no resend
            server.accept()
    finally:
        server.close()
    assert all(ln.rc == 0 for ln in lines), lines
    assert (req.magic, req.op) == (wire.BURST_MAGIC, wire.BURST_OP_RELEASE)
    assert (req.bytes, req.total_after, req.generation) == (grant, 0, abi.generation(c.dir))
    before = int(c.usage().grant_returned)  # the exit added what it left unused
    (c.dir / abi.SOCKET_FILE).unlink()  # the agent is away
    p = shim.ctest_popen(c, "alloc", REQUEST + grant // 2, "free", "hold")
    try:
        assert [read_line(p).split()[:2] for _ in range(4)] == [
            ["init", "0"],
            ["alloc", "0"],
            ["free", "0"],
            ["hold", "0"],
        ]
        assert int(c.usage().grant_returned) > before  # said by the free, before any exit
        assert p.stdin is not None
        p.stdin.close()  # let it exit, so a sanitizer report would fail it
        assert p.wait(timeout=120) == 0, p.stderr.read() if p.stderr else ""
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


# ------------------------------------------------------------- policy flags and damaged files


def test_whole_gpu_is_counted_but_not_limited(shim: Shim, container: Callable[..., Container]) -> None:
    c = container(request=8 * MiB, limit=8 * MiB, flags=abi.FLAG_WHOLE_GPU)
    lines = shim.ctest(c, "alloc", 64 * MiB, "used", "info")
    assert lines[1].rc == 0 and lines[2].int("total") == 64 * MiB
    assert lines[3].int("total") > 8 * MiB  # the real GPU, not the container's request


def test_disabled_container_gets_nothing(shim: Shim, container: Callable[..., Container]) -> None:
    c = container(flags=abi.FLAG_DISABLED)
    lines = shim.ctest(c, "alloc", MiB, "info")
    assert lines[1].rc == CUDA_ERROR_OUT_OF_MEMORY
    assert lines[2].int("free") == 0


def test_no_config_passes_through_with_one_warning(shim: Shim, tmp_path: Path) -> None:
    p = subprocess.run(
        shim.ctest_cmd("alloc", 256 * MiB, "alloc", MiB, "info", "free", "free"),
        env=shim.env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    assert "alloc 0" in p.stdout and "alloc 2" not in p.stdout
    warnings = [ln for ln in p.stderr.splitlines() if "memguard" in ln]
    assert len(warnings) == 1 and "not limited" in warnings[0] and str(tmp_path) in warnings[0]


@pytest.mark.parametrize("damage", ["missing", "truncated", "foreign"])
def test_damaged_usage_file_refuses_with_a_clear_message(
    shim: Shim, container: Callable[..., Container], damage: str
) -> None:
    c = container()
    usage = c.dir / abi.USAGE_FILE
    if damage == "missing":
        usage.unlink()
    elif damage == "truncated":
        os.truncate(usage, 100)
    else:
        usage.write_bytes(b"\xff" * usage.stat().st_size)
    p = subprocess.run(
        shim.ctest_cmd("alloc", MiB, "info"), env=shim.env(c), capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0, p.stderr  # refused, not crashed
    assert f"alloc {CUDA_ERROR_OUT_OF_MEMORY}" in p.stdout
    assert "free=0 " in p.stdout
    assert str(usage) in p.stderr and "refusing GPU allocations" in p.stderr


def test_damaged_config_refuses_with_a_clear_message(shim: Shim, container: Callable[..., Container]) -> None:
    c = container()
    cfg = c.dir / abi.CONFIG_FILE
    cfg.write_bytes(b"\0" * 64)
    p = subprocess.run(
        shim.ctest_cmd("alloc", MiB), env=shim.env(c), capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0 and f"alloc {CUDA_ERROR_OUT_OF_MEMORY}" in p.stdout
    assert str(cfg) in p.stderr and "refusing" in p.stderr


def test_burst_with_a_silent_arbiter_is_refused_after_the_timeout(
    shim: Shim, container: Callable[..., Container]
) -> None:
    """An agent that accepts but never answers: the burst is refused once
    arbiter + wait timeouts pass, and the request says what was asked."""
    c = container(arbiter_timeout_ms=200, wait_timeout_ms=300)
    server = _burst_server(c.dir / abi.SOCKET_FILE)
    try:
        lines = shim.ctest(c, "alloc", REQUEST - MiB, "alloc", 4 * MiB, "alloc", MiB)
        conn, _ = server.accept()
        req = wire.BurstRequest.from_buffer_copy(conn.recv(64))
        conn.close()
    finally:
        server.close()
    assert [ln.rc for ln in lines] == [0, 0, CUDA_ERROR_OUT_OF_MEMORY, 0]
    assert (req.magic, req.op, req.bytes) == (wire.BURST_MAGIC, wire.BURST_OP_BURST, 4 * MiB)
    assert req.total_after == REQUEST + 3 * MiB
