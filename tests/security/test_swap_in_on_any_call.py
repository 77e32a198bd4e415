"""A swapped-out container comes back on its next GPU work, whatever that call is.

An idle notebook is swapped to host RAM; its user then copies a tensor to the host
(`t.cpu()`: cuMemcpyDtoH, no kernel launched) or synchronizes. The driver blocks every CUDA
call of a locked process until it is restored (simgpu's fake libcuda does the same), and
only the shim can ask for that: so the copy or the wait must pass the shim's swap-in gate
and come back within the container's wait timeout, with its bytes intact.

Every part real (tests/fixtures/e2e.py): the agent a subprocess, cuda-python under the
memguard shim (every function through cuGetProcAddress_v2), the fake driver's checkpoint API.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from gpufrac.memguard import abi
from tests.fixtures.e2e import E2ENode
from tests.fixtures.swapping import swapped_out

WAIT_TIMEOUT = 20.0  # the victim's gpufrac.dev/wait-timeout: its swap-in is arbitrated within it


@pytest.mark.parametrize("first_call", ["read", "sync"])  # cuMemcpyDtoH, cuCtxSynchronize
def test_a_swapped_out_container_whose_next_call_is_not_a_launch_comes_back(
    e2e_node: Callable[..., E2ENode], first_call: str
) -> None:
    node = e2e_node(resolvers=["swap", "wait"], swap={"idleThreshold": "1s"})
    victim, guarantee, burst = swapped_out(node, wait_timeout=f"{WAIT_TIMEOUT:g}s")
    log = node.sim.agent.log
    if first_call == "read":
        assert victim.app.do(f"read {burst[1]}", WAIT_TIMEOUT) == "value 2222", log()[-3000:]
    else:
        assert victim.app.do("sync", WAIT_TIMEOUT) == "ok", log()[-3000:]
    assert not any(s.swapped for s in abi.read_usage(victim.host_dir).slots)
    assert victim.app.do(f"read {guarantee[1]}", WAIT_TIMEOUT) == "value 1111"
    assert victim.app.do(f"check {guarantee[1]}") == "ok" and victim.app.do(f"check {burst[1]}") == "ok"
    assert victim.alive()
