"""A swapped-out container comes back on its next GPU work, whatever that call is.

An idle notebook is swapped to host RAM; its user then copies a tensor to the host
(`t.cpu()`: cuMemcpyDtoH, no kernel launched) or synchronizes; a stream-ordered pool
(PyTorch's cudaMallocAsync backend, RAPIDS) serves its next tensor from bytes the pool holds
idle, which the shim counted already and never charges again; PyTorch's expandable segments
give memory back in `empty_cache()` by cuMemUnmap and cuMemRelease. The driver blocks every
CUDA call of a locked process until it is restored (simgpu's fake libcuda does the same), and
only the shim can ask for that: so each of these calls must pass the shim's swap-in gate and
come back within the container's wait timeout, with its bytes intact.

Every part real (tests/fixtures/e2e.py): the agent a subprocess, cuda-python under the
memguard shim (every function through cuGetProcAddress_v2), the fake driver's checkpoint API.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from gpufrac.memguard import abi
from tests.fixtures.e2e import E2ENode, MiB, PodRun
from tests.fixtures.swapping import swapped_out

pytestmark = pytest.mark.security

WAIT_TIMEOUT = 20.0  # the victim's gpufrac.dev/wait-timeout: its swap-in is arbitrated within it
EXTRA = 64 * MiB  # the pool's idle bytes, the VMM mapping: room for both on the 1 GiB GPU


@pytest.mark.parametrize(
    "first_call",
    [
        "read",  # cuMemcpyDtoH
        "sync",  # cuCtxSynchronize
        "pool",  # cuMemAllocAsync served wholly from the pool's idle bytes (no charge)
        "vmm",  # cuMemUnmap, then cuMemRelease
    ],
)
def test_a_swapped_out_container_whose_next_call_is_not_a_launch_comes_back(
    e2e_node: Callable[..., E2ENode], first_call: str
) -> None:
    node = e2e_node(resolvers=["swap", "wait"], swap={"idleThreshold": "1s"})
    mapping: list[str] = []

    def prepare(victim: PodRun) -> None:
        if first_call == "pool":
            assert victim.app.do(f"pool {EXTRA}") == "ok"
        elif first_call == "vmm":
            answer = victim.app.do(f"vmm {EXTRA}").split()
            assert answer[0] == "ok", answer
            mapping.append(answer[1])

    victim, guarantee, burst = swapped_out(node, wait_timeout=f"{WAIT_TIMEOUT:g}s", then=prepare)
    log = node.sim.agent.log
    if first_call == "read":
        assert victim.app.do(f"read {burst[1]}", WAIT_TIMEOUT) == "value 2222", log()[-3000:]
    elif first_call == "sync":
        assert victim.app.do("sync", WAIT_TIMEOUT) == "ok", log()[-3000:]
    elif first_call == "pool":
        assert victim.app.do(f"palloc {EXTRA}", WAIT_TIMEOUT).startswith("ok "), log()[-3000:]
    else:
        assert victim.app.do(f"vfree {mapping[0]}", WAIT_TIMEOUT) == "ok", log()[-3000:]
    assert not any(s.swapped for s in abi.read_usage(victim.host_dir).slots)
    assert victim.app.do(f"read {guarantee[1]}", WAIT_TIMEOUT) == "value 1111"
    assert victim.app.do(f"check {guarantee[1]}") == "ok" and victim.app.do(f"check {burst[1]}") == "ok"
    assert victim.alive()
