"""memguard: stream-ordered memory pools, counted by what the pool really holds.

A pool keeps the memory of freed blocks reserved (NVML shows it used) until it
gives it back: at a synchronize, down to its CU_MEMPOOL_ATTR_RELEASE_THRESHOLD
(PyTorch's cudaMallocAsync backend sets UINT64_MAX: never), at cuMemPoolTrimTo,
or when the pool is destroyed. So the container is charged for a pool's idle
reservation (reserved - used) on top of its live allocations, and uncharged
exactly when the driver releases it: never above the limit through pools,
never counted twice, never below zero.

Real processes under the real shim on a simulated node (see test_memguard.py),
against the release and the ASan+UBSan builds (`flavour`).
"""

from __future__ import annotations

import itertools
import socket
import subprocess
import threading
from collections.abc import Callable

from gpufrac.memguard import abi, wire
from gpufrac.simgpu.nodestate import NodeState
from tests.fixtures.memguard import (
    CUDA_ERROR_OUT_OF_MEMORY,
    Container,
    Line,
    MiB,
    Shim,
    answer_bursts,
    read_line,
)

KEEP_ALL = (1 << 64) - 1  # release threshold UINT64_MAX: the pool never gives memory back on its own
OOM = CUDA_ERROR_OUT_OF_MEMORY


def totals(lines: list[Line]) -> list[int]:
    return [ln.int("total") for ln in lines if ln.cmd == "used"]


def rcs(lines: list[Line], cmd: str) -> list[int]:
    return [ln.rc for ln in lines if ln.cmd == cmd]


def let_go(p: subprocess.Popen[str]) -> None:
    """End an mg_ctest `hold`: it exits cleanly (its destructor gives its slot back)."""
    assert p.stdin is not None
    p.stdin.write("\n")
    p.stdin.close()
    assert p.wait(timeout=120) == 0


def held_while(shim: Shim, c: Container, *script: object) -> tuple[list[str], int, int]:
    """Run `script` then hold: the lines printed, the bytes the fake driver holds
    for the process at that moment (what NVML shows), and the container's count."""
    node = NodeState(shim.sim_env["SIMGPU_STATE"])
    p = shim.ctest_popen(c, *script, "hold")
    try:
        lines: list[str] = []
        while not lines or not lines[-1].startswith("hold"):
            line = read_line(p)
            assert line, f"mg_ctest ended early: {lines}"
            lines.append(line)
        physical = sum(pr.used_bytes for pr in node.live_procs() if pr.pid == p.pid)
        counted = c.total()
        let_go(p)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        node.close()
    return lines, physical, counted


# --------------------------------------------------- pools that keep what they free


def test_pools_that_keep_freed_memory_cannot_exceed_the_limit(
    shim: Shim, container: Callable[..., Container]
) -> None:
    """Five pools with release threshold UINT64_MAX, each allocating and freeing
    60 MiB, under a 96 MiB limit: the pool keeps the first 60 MiB reserved after
    the free (and after a synchronize), so it stays counted and every later pool
    gets CUDA_ERROR_OUT_OF_MEMORY. The driver never holds more than the limit."""
    c = container(request=96 * MiB, limit=96 * MiB)
    script = [x for _ in range(5) for x in ("mkpool", KEEP_ALL, "palloc", 60 * MiB, "afree", "ssync", "used")]
    lines, physical, counted = held_while(shim, c, *script)
    allocs = [ln.split()[1] for ln in lines if ln.startswith("palloc ")]
    used = [int(ln.split("total=")[1].split()[0]) for ln in lines if ln.startswith("used ")]
    assert allocs == ["0"] + [str(OOM)] * 4, lines
    assert used == [60 * MiB] * 5  # the idle reservation stays counted
    assert physical == 60 * MiB <= 96 * MiB
    assert counted >= physical
    assert c.total() == 0 and not c.live_slots()  # the exit gave it back


def test_another_process_sees_a_pools_idle_reservation(
    shim: Shim, container: Callable[..., Container]
) -> None:
    """Usage is per container: while one process's pool keeps 60 MiB reserved, a
    second process of the container cannot allocate another 60 MiB."""
    c = container(request=96 * MiB, limit=96 * MiB)
    p = shim.ctest_popen(c, "mkpool", KEEP_ALL, "palloc", 60 * MiB, "afree", "sync", "used", "hold")
    try:
        lines = [read_line(p) for _ in range(7)]
        assert lines[-1].startswith("hold"), lines
        assert f"total={60 * MiB}" in lines[-2]
        other = shim.ctest(c, "alloc", 60 * MiB, "async", 60 * MiB, "used")
        let_go(p)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert rcs(other, "alloc") == [OOM] and rcs(other, "async") == [OOM]
    assert totals(other) == [60 * MiB]
    assert c.total() == 0


def test_growing_a_pool_past_the_limit_asks_for_a_burst(
    shim: Shim, container: Callable[..., Container]
) -> None:
    """Past request + grant a pool's growth goes through the arbiter like any
    other allocation: the agent grants, the second pool gets its 60 MiB."""
    c = container(request=64 * MiB, limit=192 * MiB)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(c.dir / abi.SOCKET_FILE))
    server.listen(8)
    server.settimeout(0.1)
    served: list[wire.BurstRequest] = []
    done = threading.Event()

    def agent() -> None:
        answer_bursts(server, c, served, done.is_set)  # a BURST is granted; a RELEASE only recorded

    t = threading.Thread(target=agent, daemon=True)
    t.start()
    try:
        lines = shim.ctest(
            c,
            *("mkpool", KEEP_ALL, "palloc", 60 * MiB, "afree", "ssync", "used"),
            *("mkpool", KEEP_ALL, "palloc", 60 * MiB, "used"),
        )
    finally:
        done.set()
        t.join(timeout=60)
        server.close()
    assert rcs(lines, "palloc") == [0, 0], lines
    assert totals(lines) == [60 * MiB, 120 * MiB]
    bursts = [r for r in served if r.op == wire.BURST_OP_BURST]
    assert [(r.bytes, r.total_after) for r in bursts] == [(60 * MiB, 120 * MiB)]


# ------------------------------------------------------------------ giving it back


def test_trim_and_destroy_give_the_bytes_back(shim: Shim, container: Callable[..., Container]) -> None:
    """The bytes are uncounted when the pool releases them (cuMemPoolTrimTo,
    cuMemPoolDestroy), and an allocation that fits the limit then succeeds."""
    c = container(request=96 * MiB, limit=96 * MiB)
    lines = shim.ctest(
        c,
        *("mkpool", KEEP_ALL, "palloc", 60 * MiB, "afree", "used"),  # 60 idle
        *("mkpool", KEEP_ALL, "palloc", 60 * MiB, "rmpool"),  # refused: 120 > 96
        *("trim", 16 * MiB, "used", "poolinfo"),  # released to <= 16 MiB: the one 60 MiB block goes
        *("mkpool", KEEP_ALL, "palloc", 60 * MiB, "used"),  # fits now
        *("afree", "used", "rmpool", "used"),  # destroyed: its 60 idle go
        *("mkpool", KEEP_ALL, "palloc", 90 * MiB, "used"),  # fits again
        *("afree", "trim", 0, "used"),
    )
    assert rcs(lines, "palloc") == [0, OOM, 0, 0], lines
    assert all(ln.rc == 0 for ln in lines if ln.cmd in ("mkpool", "rmpool", "trim", "afree", "poolinfo")), (
        lines
    )
    assert totals(lines) == [60 * MiB, 0, 60 * MiB, 60 * MiB, 0, 90 * MiB, 0]
    (info,) = [ln for ln in lines if ln.cmd == "poolinfo"]
    assert info.int("reserved") == 0
    assert c.total() == 0


def test_destroying_a_pool_with_live_allocations(shim: Shim, container: Callable[..., Container]) -> None:
    """cuMemPoolDestroy returns at once while allocations are outstanding; the
    pool's memory goes when the last of them is freed: counted until then."""
    c = container(request=96 * MiB, limit=96 * MiB)
    lines = shim.ctest(
        c,
        *("mkpool", KEEP_ALL, "palloc", 20 * MiB, "palloc", 30 * MiB, "afree", "used"),  # 20 live + 30 idle
        *("rmpool", "used"),
        *("afree", "used"),  # the last one: the pool is gone
        *("mkpool", KEEP_ALL, "palloc", 96 * MiB, "used", "afree", "rmpool", "used"),
    )
    assert all(ln.rc == 0 for ln in lines), lines
    used = totals(lines)
    assert used[0] == 50 * MiB
    assert 20 * MiB <= used[1] <= 50 * MiB  # the live block, maybe the released idle too (never less)
    assert used[2:] == [0, 96 * MiB, 0]
    assert c.total() == 0


def test_synchronize_releases_down_to_the_threshold(shim: Shim, container: Callable[..., Container]) -> None:
    """At stream, event and context synchronize the pool releases what it holds
    above its threshold; the count follows the driver, whichever sync it was."""
    c = container(request=96 * MiB, limit=96 * MiB)
    lines = shim.ctest(
        c,
        *("mkpool", 32 * MiB, "palloc", 40 * MiB, "palloc", 20 * MiB, "afree", "afree", "used", "poolinfo"),
        *("ssync", "used", "poolinfo"),  # 60 > 32: the 40 MiB block goes, 20 stay
        *("thresh", 10 * MiB, "esync", "used"),  # 20 > 10: released at the event sync
        *("palloc", 8 * MiB, "afree", "thresh", 0, "sync", "used"),  # and at a context sync
        *("defpool", "thresh", KEEP_ALL, "async", 30 * MiB, "afree", "sync", "used"),  # the default pool too
        *("thresh", 0, "ssync", "used"),
    )
    assert all(ln.rc == 0 for ln in lines), lines
    info = [ln for ln in lines if ln.cmd == "poolinfo"]
    assert (info[0].int("reserved"), info[0].int("used")) == (60 * MiB, 0)
    assert info[1].int("reserved") == 20 * MiB
    assert totals(lines) == [60 * MiB, 20 * MiB, 0, 0, 30 * MiB, 0]


def test_default_pool_threshold_zero_counts_until_the_synchronize(
    shim: Shim, container: Callable[..., Container]
) -> None:
    """The default pool (threshold 0) keeps a freed block only until the next
    synchronize: counted while the driver holds it, then gone. Many rounds of
    alloc, free, sync leave nothing behind."""
    c = container()
    lines = shim.ctest(
        c,
        *("async", 10 * MiB, "used", "afree", "used", "ssync", "used"),
        *["async", 48 * MiB, "freeasync"] * 50,
        *("pool", 1 * MiB, "used", "freeasync", "used"),
    )
    assert all(ln.rc == 0 for ln in lines), lines
    assert totals(lines) == [10 * MiB, 10 * MiB, 0, 1 * MiB, 0]
    assert c.total() == 0


def test_a_fragmented_pool_cannot_grow_past_the_limit(
    shim: Shim, container: Callable[..., Container]
) -> None:
    """Two idle 30 MiB blocks cannot serve 60 MiB: the pool would have to grow to
    120 MiB, past the 96 MiB limit. Refused, and the pool is back to what it held."""
    c = container(request=96 * MiB, limit=96 * MiB)
    lines = shim.ctest(
        c,
        *("mkpool", KEEP_ALL, "palloc", 30 * MiB, "palloc", 30 * MiB, "afree", "afree", "used"),
        *("palloc", 60 * MiB, "used", "poolinfo"),
        *("palloc", 30 * MiB, "palloc", 30 * MiB, "used"),  # served from what the pool holds
    )
    assert rcs(lines, "palloc") == [0, 0, OOM, 0, 0], lines
    assert totals(lines) == [60 * MiB, 60 * MiB, 60 * MiB]
    (info,) = [ln for ln in lines if ln.cmd == "poolinfo"]
    assert info.int("reserved") == 60 * MiB


def test_a_small_allocation_from_a_big_idle_block(shim: Shim, container: Callable[..., Container]) -> None:
    """A 2 MiB allocation carved out of an idle 60 MiB block leaves 58 MiB idle in
    the pool: still counted, so another pool cannot take 60 MiB more."""
    c = container(request=96 * MiB, limit=96 * MiB)
    lines = shim.ctest(
        c,
        *("mkpool", KEEP_ALL, "palloc", 60 * MiB, "afree", "palloc", 2 * MiB, "used"),
        *("mkpool", KEEP_ALL, "palloc", 60 * MiB, "used"),
    )
    assert rcs(lines, "palloc") == [0, 0, OOM], lines
    assert totals(lines) == [60 * MiB, 60 * MiB]


def test_pool_accounting_matches_the_driver_and_never_goes_below_zero(
    shim: Shim, container: Callable[..., Container]
) -> None:
    """After every step the count is exactly the live allocations plus the
    pool's idle reservation as the driver reports it (never twice, never
    negative), through a double free, frees after a destroy, and trims."""
    c = container(request=96 * MiB, limit=96 * MiB)
    lines = shim.ctest(
        c,
        *("mkpool", KEEP_ALL, "palloc", 10 * MiB, "palloc", 6 * MiB, "used", "poolinfo"),
        *("afree", "used", "poolinfo"),
        *("refree", "used"),  # a double free: refused by the driver, nothing given back twice
        *("trim", 0, "used", "poolinfo"),
        *("afree", "used", "poolinfo"),
        *("trim", 0, "used", "poolinfo"),
        *("trim", 0, "ssync", "sync", "used"),
        *("palloc", 4 * MiB, "rmpool", "afree", "used"),
        *("afree", "used"),  # nothing left to free: still 0, not "17 TB"
    )
    assert rcs(lines, "refree") != [0]
    checked = ("palloc", "trim", "poolinfo", "rmpool", "ssync", "sync")
    assert all(ln.rc == 0 for ln in lines if ln.cmd in checked)
    # Each poolinfo right after a `used`: count == live + reserved - used, as the driver says.
    live = iter([16 * MiB, 10 * MiB, 10 * MiB, 0, 0])
    for before, info in itertools.pairwise(lines):
        if info.cmd == "poolinfo":
            assert before.cmd == "used"
            assert before.int("total") == next(live) + info.int("reserved") - info.int("used"), (before, info)
    assert totals(lines) == [16 * MiB, 16 * MiB, 16 * MiB, 10 * MiB, 10 * MiB, 0, 0, 0, 0]
    assert c.total() == 0


def test_pool_stress_from_many_threads_leaves_nothing_behind(
    shim: Shim, container: Callable[..., Container]
) -> None:
    """Threads allocating and freeing from shared pools (threshold UINT64_MAX and
    0, and the default pool) while synchronizing and trimming: afterwards the
    count is exactly the pools' idle reservation as the driver reports it, and
    zero once they are trimmed and destroyed."""
    c = container(request=96 * MiB, limit=96 * MiB)
    lines = shim.ctest(c, "pstress", 8, 400, 6 * MiB, 7, "used")
    (st,) = [ln for ln in lines if ln.cmd == "pstress"]
    assert st.rc == 0 and int(st.kv["ok"]) > 0 and st.kv["other"] == "0", st
    assert st.int("counted") == st.int("truth"), st  # nothing counted twice, nothing missed
    assert st.int("truth") <= 96 * MiB, st
    assert totals(lines) == [0]
    assert c.total() == 0
