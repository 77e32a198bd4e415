"""memguard: how long counted memory lives, against the real driver's rules.

* exec() keeps the pid and start time, runs no destructor, and the driver frees
  the old image's memory: the new image must not inherit its bytes.
* A full arbiter backlog is waited out within arbiter_timeout_ms
  (docs/arbiter-protocol.md), not refused at once.
* A cuMemCreate allocation lives until its handle is released AND every
  mapping is unmapped; cuMemRetainAllocationHandle adds a handle reference.

Real processes under the real shim on a simulated node (see test_memguard.py),
against the release and the ASan+UBSan builds (`flavour`).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

from gpufrac.memguard import abi, wire
from tests.fixtures.memguard import (
    CUDA_ERROR_OUT_OF_MEMORY,
    REQUEST,
    Container,
    MiB,
    Shim,
    answer_bursts,
    held,
    read_line,
)

# ------------------------------------------------------------------ exec


def test_exec_gives_back_the_old_images_bytes(shim: Shim, container: Callable[..., Container]) -> None:
    """48 MiB held, then exec: the new image (same pid, same start time) starts
    at zero and gets the whole 64 MiB request."""
    c = container(request=REQUEST, limit=REQUEST)
    lines = shim.ctest(c, "alloc", 48 * MiB, "used", "exec", "used", "alloc", REQUEST, "used")
    allocs = [ln.rc for ln in lines if ln.cmd == "alloc"]
    used = [ln for ln in lines if ln.cmd == "used"]
    assert [ln.cmd for ln in lines].count("init") == 2  # two images ran
    assert used[0].int("total") == 48 * MiB
    assert used[1].int("total") == 0  # given back as the new image started, before it allocated
    assert allocs == [0, 0], lines
    assert used[2].int("total") == used[2].int("mine") == REQUEST
    assert c.total() == 0 and not c.live_slots()


# ------------------------------------------------------------------ full backlog


def _full_backlog(path: str) -> tuple[socket.socket, list[socket.socket]]:
    """A listening unix socket whose accept queue is full: a non-blocking
    connect to it fails with EAGAIN."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    fillers: list[socket.socket] = []
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setblocking(False)
        try:
            s.connect(path)
        except BlockingIOError:
            s.close()
            return server, fillers
        fillers.append(s)


def test_burst_waits_out_a_full_arbiter_backlog(shim: Shim, container: Callable[..., Container]) -> None:
    """The agent's backlog is full when the burst asks; it starts accepting a
    moment later, well within arbiter_timeout_ms: the burst is granted."""
    c = container(arbiter_timeout_ms=10_000)
    server, fillers = _full_backlog(str(c.dir / abi.SOCKET_FILE))
    asked, done = threading.Event(), threading.Event()
    served: list[wire.BurstRequest] = []
    server.settimeout(0.1)  # the agent thread never outlives the test, even a failing one

    def agent() -> None:
        asked.wait(60)
        time.sleep(0.3)  # the shim has long found the backlog full
        for f in fillers:
            f.close()  # their queued connections read as EOF
        answer_bursts(server, c, served, lambda: bool(served) or done.is_set())

    t = threading.Thread(target=agent, daemon=True)
    t.start()
    p = shim.ctest_popen(c, "alloc", REQUEST, "hold", "alloc", 8 * MiB, "used")
    try:
        assert [read_line(p).split()[:2] for _ in range(3)] == [["init", "0"], ["alloc", "0"], ["hold", "0"]]
        assert p.stdin is not None
        p.stdin.write("\n")
        p.stdin.flush()
        asked.set()
        burst, used = read_line(p).split(), read_line(p)
        p.stdin.close()
        assert p.wait(timeout=120) == 0
    finally:
        asked.set()
        if p.poll() is None:
            p.kill()
            p.wait()
        done.set()
        t.join(timeout=60)
        server.close()
    assert burst[:2] == ["alloc", "0"], burst  # granted, not refused at once
    assert served and served[0].op == wire.BURST_OP_BURST and served[0].bytes == 8 * MiB
    assert f"total={REQUEST + 8 * MiB}" in used


def test_burst_against_a_backlog_that_stays_full_is_refused_after_the_timeout(
    shim: Shim, container: Callable[..., Container]
) -> None:
    """Nobody ever accepts: refused (not hung), and only once the arbiter timeout passed."""
    c = container(arbiter_timeout_ms=400, wait_timeout_ms=0)
    server, fillers = _full_backlog(str(c.dir / abi.SOCKET_FILE))
    try:
        p = shim.ctest_popen(c, "alloc", REQUEST, "hold", "alloc", 8 * MiB)
        assert [read_line(p).split()[:2] for _ in range(3)] == [["init", "0"], ["alloc", "0"], ["hold", "0"]]
        assert p.stdin is not None
        start = time.monotonic()
        p.stdin.write("\n")
        p.stdin.close()
        line = read_line(p)
        waited = time.monotonic() - start
        assert p.wait(timeout=120) == 0
    finally:
        for f in fillers:
            f.close()
        server.close()
    assert line.split()[:2] == ["alloc", str(CUDA_ERROR_OUT_OF_MEMORY)]
    assert waited >= 0.35  # a lower bound only: it waited, a loaded box cannot make that flaky


# ------------------------------------------------------------------ VMM lifetimes


def test_vmm_memory_stays_counted_while_mapped(shim: Shim, container: Callable[..., Container]) -> None:
    """vectorAddMMAP's order: reserve, create, map, release the handle at once.
    The mapping keeps the memory (the driver frees it at the unmap), so it stays
    counted; ten such 32 MiB allocations cannot fit a 96 MiB limit."""
    c = container(request=96 * MiB, limit=96 * MiB)
    # physical: what the fake driver really holds for this process while mapped.
    lines, physical, counted, rest = held(
        shim, c, *["mapped", 32 * MiB, "used"] * 10, then=("unmapall", "used")
    )
    rcs = [ln.split()[1] for ln in lines if ln.startswith("mapped ")]
    unmapped, after = rest[0].split(), rest[1]
    assert rcs == ["0"] * 3 + [str(CUDA_ERROR_OUT_OF_MEMORY)] * 7, lines
    assert counted == 96 * MiB
    assert physical >= counted  # the driver still holds what is counted
    assert unmapped[:2] == ["unmapall", "0"]
    assert "total=0 " in after  # the unmap freed it: uncounted then
    assert c.total() == 0


def test_vmm_release_retain_unmap_counts_each_reference(
    shim: Shim, container: Callable[..., Container]
) -> None:
    """Bytes go only when the last reference goes: cuMemCreate's handle, a
    retained handle, and the mapping, dropped in any order."""
    c = container()
    n = 16 * MiB
    lines = shim.ctest(
        c,
        *("vmm", n, "retain", "used"),
        *("release", "used"),  # the retained handle
        *("unmaponly", "used"),  # the mapping
        *("releasevmm", "used"),  # cuMemCreate's handle: the last one
        *("vmm", n, "retain", "releasevmm", "unmaponly", "used", "release", "used"),
    )
    assert all(ln.rc == 0 for ln in lines), lines
    assert [ln.int("total") for ln in lines if ln.cmd == "used"] == [n, n, n, 0, n, 0]
    assert c.total() == 0
