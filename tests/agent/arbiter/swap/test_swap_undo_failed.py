"""A swap-out that fails and cannot be undone leaves the victim held by the driver: its flags
must stay set (it is kept as swapped out, and restored on its next GPU call) rather than be
cleared over a locked process, which would then block in the driver with nobody to ask.

The arbiter's node of tests/agent/arbiter/swap/test_swap.py with the stand-in workload; the
checkpoint API is a stand-in that fails the checkpoint and leaves the process locked (a
real driver's failed undo).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from test_swap import node, node_file, sim_state  # noqa: F401

from gpufrac.agent.arbiter.swap import resolver as swap_mod
from gpufrac.agent.arbiter.swap.checkpoint import CheckpointError, ProcessState, Support
from gpufrac.memguard import abi
from tests.fixtures.arbiter_harness import ArbiterNode, Box, MiB


class StuckCheckpointer:
    """Checkpoint fails after the lock, and the unlock of the undo fails too: the process
    stays LOCKED until a swap-in restores it."""

    available = True

    def __init__(self) -> None:
        self.locked: set[int] = set()
        self.swapped_in: list[list[int]] = []

    def detect(self) -> Support:
        return Support(True, driver_version=12080)

    def state(self, pid: int) -> ProcessState:
        return ProcessState.LOCKED if pid in self.locked else ProcessState.RUNNING

    def swap_out(self, pids: list[int], lock_ms: int) -> None:
        self.locked.update(pids)
        raise CheckpointError(f"cuCheckpointProcessCheckpoint(pid {pids[0]}): CUDA_ERROR_UNKNOWN")

    def swap_in(self, pids: list[int], gone: Callable[[int], bool] = lambda pid: False) -> list[int]:
        self.swapped_in.append(list(pids))
        self.locked.difference_update(pids)
        return pids


class UndoneCheckpointer(StuckCheckpointer):
    """The lock times out: the process was never locked, and runs on."""

    def swap_out(self, pids: list[int], lock_ms: int) -> None:
        raise CheckpointError(f"cuCheckpointProcessLock(pid {pids[0]}): CUDA_ERROR_TIMEOUT")


def swap_out_victim(
    node: ArbiterNode,  # noqa: F811
    ckpt: StuckCheckpointer,
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[swap_mod.SwapResolver, Box, int, Callable[[], object]]:
    """A victim holding memory, the swap resolver on `ckpt`, and its swap-out to call."""
    box = node.add("victim", 2, "8Gi")
    assert box.workload is not None and box.workload.do(f"alloc {64 * MiB}") == "fast"
    assert box.container is not None
    swap = node.arbiter.swap
    swap.ckpt = ckpt  # type: ignore[assignment]
    pid = box.container.proc.pid
    (slot,) = [
        (int(s.pid), int(s.start_time)) for s in abi.read_usage(box.alloc.directory).slots if s.pid > 0
    ]
    monkeypatch.setattr(swap, "_prepare", lambda alloc: [(pid, slot)])
    (h,) = [
        h
        for h in node.on_loop(lambda: node.arbiter.resolution.holdings(node.gpu))
        if h.alloc.key == box.alloc.key
    ]
    return (
        swap,
        box,
        pid,
        lambda: node.on_loop(lambda: swap._swap_out(h, node.gpu, "a test", needed_by="a test")),
    )


def test_a_failed_swap_out_that_leaves_the_process_locked_keeps_it_flagged(
    node: ArbiterNode,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ckpt = StuckCheckpointer()
    swap, box, pid, swap_out = swap_out_victim(node, ckpt, monkeypatch)
    swap_out()
    # Kept as swapped out, its flag set: its next GPU call asks for it back.
    assert swap.is_swapped(box.alloc.key)
    assert [s.swapped for s in abi.read_usage(box.alloc.directory).slots if s.pid > 0] == [1]

    assert node.on_loop(lambda: swap.swap_in(box.alloc)) is True
    assert ckpt.swapped_in == [[pid]] and not ckpt.locked
    assert not swap.is_swapped(box.alloc.key)
    assert [s.swapped for s in abi.read_usage(box.alloc.directory).slots if s.pid > 0] == [0]


def test_a_failed_swap_out_that_was_undone_clears_the_flag(
    node: ArbiterNode,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    swap, box, _, swap_out = swap_out_victim(node, UndoneCheckpointer(), monkeypatch)
    with pytest.raises(swap_mod._Skip, match="CUDA_ERROR_TIMEOUT"):
        swap_out()
    assert not swap.is_swapped(box.alloc.key)
    assert [s.swapped for s in abi.read_usage(box.alloc.directory).slots if s.pid > 0] == [0]
