"""The shim's launch pace: how a container is held to its compute share (docs/compute.md).

The agent publishes a pace in the container's config; while it is non-zero every launch of the
container (any entry point, any thread, any process) takes the next slot of the container's
launch clock, at least a pace after the one before, and sleeps until it. These tests play the
agent (Container.pace) and check what the shim does with it: that nothing is held while the pace
is 0, that every launch path takes slots, that the slots are the container's (threads and
processes together), and that a paced process always gets on: fork, exit and SIGKILL while
threads sleep in launches, many threads, a pace lifted, a clock the tenant wrote far ahead.
Elapsed times are only ever lower bounds (a loaded machine makes them longer, never shorter).
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable

import pytest

from tests.fixtures.memguard import Container, Shim, parse_ctest, read_line, until_hold
from tests.fixtures.polling import until

MS = 1_000_000


def launched(lines: list, cmd: str = "lstress") -> tuple[int, float]:
    (line,) = [ln for ln in lines if ln.cmd == cmd]
    assert line.rc == 0
    return line.int("ok"), float(line.kv["ms"])


def test_unpaced_launches_take_no_slot(shim: Shim, container: Callable[..., Container]) -> None:
    c = container()
    ok, _ = launched(shim.ctest(c, "lstress", "launch", 4, 50, 1))
    assert ok == 200
    comp = c.compute()
    assert (comp.paced_launches, comp.held_launches, comp.held_ns) == (0, 0, 0)


@pytest.mark.parametrize("kind", ["launch", "launchex", "coop", "graph"])
def test_every_launch_entry_point_is_paced(
    shim: Shim, container: Callable[..., Container], kind: str
) -> None:
    c = container()
    c.pace(5 * MS)
    ok, ms = launched(shim.ctest(c, "lstress", kind, 1, 10, 1))
    assert ok == 10 and ms >= 9 * 5
    assert c.compute().paced_launches == 10


@pytest.mark.parametrize("flavour", ["release"], indirect=True)
def test_slots_are_the_containers_across_threads_and_processes(
    shim: Shim, container: Callable[..., Container]
) -> None:
    """Two processes of 4 threads each share one clock: their 40 launches need 39 paces."""
    c = container()
    c.pace(5 * MS)
    procs = [shim.ctest_popen(c, "hold", "lstress", "launch", 4, 5, 1) for _ in range(2)]
    try:
        for p in procs:
            until_hold(p)
        t0 = time.monotonic()
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("\n")
            p.stdin.flush()
        lines = [parse_ctest(read_line(p)) for p in procs]
        for p in procs:
            assert p.wait(timeout=120) == 0
        took = time.monotonic() - t0
    finally:
        for p in procs:
            p.kill()
    assert [launched(ln)[0] for ln in lines] == [20, 20]
    assert took >= 39 * 0.005
    assert c.compute().paced_launches == 40


def test_fork_many_threads_and_a_lifted_pace(shim: Shim, container: Callable[..., Container]) -> None:
    c = container()
    c.pace(2 * MS)
    # fork while a thread sleeps in a paced launch: the child's new image launches too
    lines = shim.ctest(c, "forklaunch", 5)
    (fork,) = [ln for ln in lines if ln.cmd == "forklaunch"]
    assert fork.rc == 0 and fork.int("child") == 0
    assert launched(lines)[0] == 5
    # 32 threads: every launch gets its slot, none is lost or stuck
    ok, ms = launched(shim.ctest(c, "lstress", "launch", 32, 5, 1))
    assert ok == 160 and ms >= 159 * 2
    # the pace lifted: launches pass at once again
    c.pace(0)
    before = c.compute().paced_launches
    ok, _ = launched(shim.ctest(c, "lstress", "launch", 4, 25, 1))
    assert ok == 100 and c.compute().paced_launches == before


def test_sigkill_and_exit_while_threads_sleep_in_launches(
    shim: Shim, container: Callable[..., Container]
) -> None:
    """A process killed, or exiting, while its threads wait for their slots holds nothing: the
    container's next process gets its slots after the ones the dead took, no later."""
    c = container()
    c.pace(50 * MS)
    victim = shim.ctest_popen(c, "lstress", "launch", 8, 100, 1)
    try:
        until(lambda: c.compute().held_launches >= 2, what="threads held in paced launches")
        victim.send_signal(signal.SIGKILL)
        assert victim.wait(timeout=60) == -signal.SIGKILL
    finally:
        victim.kill()
    ok, _ = launched(shim.ctest(c, "lstress", "launch", 2, 2, 1))
    assert ok == 4
    # exit from the main thread while 4 threads sleep in paced launches: the process ends
    out = shim.python(
        c,
        """
        import threading, time
        k = chk(cu.cuModuleGetFunction(chk(cu.cuModuleLoadData(b"SIMGPU-MODULE\\0")), b"busy_us"))
        def launch():
            chk(cu.cuCtxSetCurrent(ctx))
            while True:
                chk(cu.cuLaunchKernel(k, 1, 1, 1, 1, 1, 1, 0, 0, ((1,), (ctypes.c_uint64,)), 0))
        for _ in range(4):
            threading.Thread(target=launch, daemon=True).start()
        while abi.read_compute(DIR).held_launches < 8:
            time.sleep(0.01)
        out["exiting"] = True
        """,
    )
    assert out == {"exiting": True}


def test_a_clock_written_far_ahead_does_not_stall_the_tenant(
    shim: Shim, container: Callable[..., Container]
) -> None:
    """The compute file is the tenant's: a clock an hour ahead is garbage, restarted at now."""
    c = container()
    c.pace(1 * MS)
    from gpufrac.memguard import abi

    path = c.dir / abi.COMPUTE_FILE
    raw = bytearray(path.read_bytes())
    ahead = time.monotonic_ns() + 3600 * 1_000_000_000
    raw[abi.ComputeStruct.next_ns.offset : abi.ComputeStruct.next_ns.offset + 8] = ahead.to_bytes(8, "little")
    path.write_bytes(bytes(raw))
    ok, _ = launched(shim.ctest(c, "lstress", "launch", 1, 5, 1))
    assert ok == 5
    assert c.compute().held_ns < 60 * 1_000_000_000


def test_without_a_compute_file_each_process_paces_itself(
    shim: Shim, container: Callable[..., Container]
) -> None:
    """A container an older agent admitted has no compute file: its processes are still paced."""
    c = container()
    (c.dir / "compute").unlink()
    c.pace(5 * MS)
    p = subprocess.run(
        shim.ctest_cmd("lstress", "launch", 2, 5, 1),
        env=shim.env(c),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    ok, ms = launched(parse_ctest(p.stdout))
    assert ok == 10 and ms >= 9 * 5
    assert "launches are paced per process" not in p.stderr  # absent is expected, not a broken file
