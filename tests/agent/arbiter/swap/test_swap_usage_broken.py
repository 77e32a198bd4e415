"""A victim that breaks its usage file while it is being swapped out is restored, not lost.

The swap resolver flags the victim's slots, checkpoints its processes, then reads its launch
counters to see whether it woke up meanwhile. The file is the container's: if it breaks the
magic right then, the swap-out is undone (its processes restored and running, its memory
back on the GPU) and the resolver goes on with a clean "not swapped", instead of an
exception escaping with the victim checkpointed and recorded nowhere (its host RAM counted by
nobody, its memory back only if someone asks). Real cuda-python processes under the real
shim, the fake driver's checkpoint API (tests/agent/arbiter/swap/test_swap.py's node).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable
from pathlib import Path

import pytest
from test_swap import RESULT, gpu_pids, idle, node, node_file, sim_state  # noqa: F401

from gpufrac.agent.arbiter.swap import resolver as swap_mod
from gpufrac.agent.arbiter.swap.checkpoint import ProcessState, process_state
from gpufrac.agent.arbiter.swap.files import SlotId
from gpufrac.memguard import abi
from tests.fixtures.arbiter_harness import ArbiterNode, GiB
from tests.fixtures.hostile_tenant import break_magic


def test_a_victim_that_breaks_its_usage_file_mid_swap_out_is_restored(
    node: ArbiterNode,  # noqa: F811
    sim_state: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    victim = node.add("victim", 2, "8Gi", start=False)
    node.swappable(victim)
    v = node.start_cuda(victim, sim_state)
    assert v.do(f"alloc {3 * GiB} 1111") == "ok 1"
    idle(node, victim)
    swap = node.arbiter.swap
    assert swap is not None and node.on_loop(swap.detect).available
    real_launches_of = swap_mod.launches_of

    def broken_meanwhile(directory: str, slots: Iterable[SlotId]) -> int:
        break_magic(Path(directory))  # the tenant, right after its checkpoint
        return real_launches_of(directory, slots)

    monkeypatch.setattr(swap_mod, "launches_of", broken_meanwhile)
    (h,) = [
        h
        for h in node.on_loop(lambda: node.arbiter.resolution.holdings(node.gpu))
        if h.alloc.key == victim.alloc.key
    ]
    with pytest.raises(swap_mod._Skip, match="usage file became unreadable"):
        node.on_loop(lambda: swap._swap_out(h, node.gpu, "a test", needed_by="a test"))

    # Undone: running in the driver, its memory on the GPU, nothing of it in host RAM.
    assert process_state(v.pid, swap.ckpt) == ProcessState.RUNNING
    assert gpu_pids()[v.pid] == 3 * GiB + RESULT
    assert not swap.is_swapped(victim.alloc.key) and swap.host_ram_used == 0
    assert swap.stats.reverted == 1 and swap.stats.swapped_out == 0
    assert not os.path.exists(os.path.join(victim.alloc.directory, "swapped-bytes"))

    # It mends its file: its flag (which nobody could clear in a broken file) brings it to the
    # agent, which finds it running and lets it go on, bytes intact.
    fd = os.open(os.path.join(victim.alloc.directory, abi.USAGE_FILE), os.O_WRONLY)
    try:
        os.pwrite(fd, struct.pack("<Q", abi.USAGE_MAGIC), 0)
    finally:
        os.close(fd)
    assert v.do("check 1") == "ok"
    assert not any(s.swapped for s in abi.read_usage(victim.alloc.directory).slots)
