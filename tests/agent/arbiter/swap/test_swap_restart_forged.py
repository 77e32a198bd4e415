"""After an agent restart, a swapped-out container's size is the agent's record, not its file.

A new agent finds a container a previous one swapped out from its usage file's flags; how
much of its memory sits in host RAM it must not take from that file, which the container
writes. A huge value there would fill the host-RAM budget (no other swap for anyone's burst)
and make its own swap-in impossible; a small one would bring its memory back onto the GPU
without the room for it being arbitrated. Real cuda-python processes under the real shim,
the fake driver's checkpoint API (tests/agent/arbiter/swap/test_swap.py's node).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from test_swap import RESULT, gpu_pids, node, node_file, sim_state, swap_victim_out  # noqa: F401

from gpufrac.agent.arbiter.swap import files as swap_files
from gpufrac.memguard import abi
from tests.fixtures.arbiter_harness import ArbiterNode, GiB


@pytest.mark.parametrize(("forged", "record"), [(1 << 62, True), (0, True), (1 << 62, False)])
def test_a_swapped_container_cannot_resize_itself_across_an_agent_restart(
    node: ArbiterNode,  # noqa: F811
    sim_state: Path,  # noqa: F811
    forged: int,
    record: bool,
) -> None:
    """`record`: False plays an agent that kept no record (one from before it did): the
    container then counts at most at its limit, the most it may hold."""
    victim, v, r, swap = swap_victim_out(node, sim_state)
    moved = swap.swapped[victim.alloc.key].bytes
    assert r.do("free 2") == "ok"

    # The agent restarts (it knows nothing of the swap-out), and the tenant, whose usage
    # file is its own, writes a size of its choice into it meanwhile.
    node.on_loop(swap.swapped.clear)
    usage = abi.UsageFile(victim.alloc.directory)
    usage.usage.total_used = forged
    usage.close()
    if not record:
        os.unlink(os.path.join(victim.alloc.directory, swap_files.SIZE_RECORD))
        moved = 8 * GiB

    async def take_over() -> int:
        entry = await swap._rediscover(victim.alloc)
        assert entry is not None
        swap.swapped[victim.alloc.key] = entry
        return swap.host_ram_used

    # The new agent counts what the old one moved, whatever the file says.
    assert node.on_loop(take_over) == moved
    if not record:
        return  # it asked for its limit's room to come back: its own doing
    # And the container comes back on its next GPU call, bytes intact.
    assert v.do("check 1") == "ok" and v.do("check 2") == "ok"
    assert not swap.is_swapped(victim.alloc.key) and swap.host_ram_used == 0
    assert gpu_pids()[v.pid] == 6 * GiB + RESULT
