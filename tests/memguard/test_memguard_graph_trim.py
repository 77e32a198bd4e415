"""memguard: a graph whose memory a trim took is held to the limit again at its next launch.

cuDeviceGraphMemTrim gives back the graph pool's memory that no graph running or
queued uses, including what idle executable graphs hold; their next launch takes
it again. That launch must be checked against the limit like a first one: else a
tenant could launch, trim, allocate the freed room elsewhere and launch again,
holding more than its limit while its count shows less than NVML.

Real processes under the real shim on a simulated node, release and ASan+UBSan builds.
"""

from __future__ import annotations

from collections.abc import Callable

from test_memguard_graphs import graph_body

from tests.fixtures.memguard import Container, MiB, Shim

OOM = 2


def test_a_trimmed_graph_is_checked_again_at_its_next_launch(
    shim: Shim, container: Callable[..., Container]
) -> None:
    """96 MiB container: a graph with a 64 MiB memory node runs (64 MiB counted);
    a trim while it is idle gives the memory back (0 counted, as NVML shows); with
    64 MiB allocated elsewhere its next launch would take the container to 128 MiB:
    it fails with OUT_OF_MEMORY and runs nothing; once that memory is freed it runs
    and is counted again. The count always equals NVML's figure."""
    out = shim.python(
        container(request=96 * MiB, limit=96 * MiB),
        graph_body(
            """
        g, node, ptr = graph_with_alloc(64 * 2**20)
        e = chk(cu.cuGraphInstantiate(g, 0))
        s = chk(cu.cuStreamCreate(0))
        chk(cu.cuGraphLaunch(e, s))
        chk(cu.cuStreamSynchronize(s))
        out["ran"] = [used(), nvml()]
        chk(cu.cuDeviceGraphMemTrim(dev))
        out["trimmed"] = [used(), nvml()]
        other = chk(cu.cuMemAlloc(64 * 2**20))
        out["relaunch"] = rc(cu.cuGraphLaunch(e, s))
        out["refused"] = [used(), nvml()]
        chk(cu.cuMemFree(other))
        out["after_free"] = rc(cu.cuGraphLaunch(e, s))
        chk(cu.cuStreamSynchronize(s))
        out["ran_again"] = [used(), nvml()]
        chk(cu.cuGraphExecDestroy(e))
        chk(cu.cuDeviceGraphMemTrim(dev))
        out["gone"] = [used(), nvml()]
        """
        ),
    )
    m64 = 64 * MiB
    assert out == {
        "ran": [m64, m64],
        "trimmed": [0, 0],
        "relaunch": OOM,
        "refused": [m64, m64],
        "after_free": 0,
        "ran_again": [m64, m64],
        "gone": [0, 0],
    }
