"""A process's first memory query is exact after a predecessor was killed.

SIGKILL runs no destructor, so a killed process leaves its slot in the usage
file holding its bytes (the driver freed the memory as it died). The next
process of the container gives such slots back as it starts, so the first
cuMemGetInfo, before any allocation, already shows the memory free.
"""

from __future__ import annotations

from collections.abc import Callable

from tests.fixtures.memguard import LIMIT, Container, MiB, Shim, read_line


def _killed_holding(shim: Shim, c: Container, nbytes: int) -> int:
    """A process that allocated `nbytes` and was SIGKILLed (and waited for); its pid."""
    p = shim.ctest_popen(c, "alloc", nbytes, "hold")
    try:
        assert [read_line(p).split()[:2] for _ in range(3)] == [["init", "0"], ["alloc", "0"], ["hold", "0"]]
        assert c.total() == nbytes
    finally:
        p.kill()
        p.wait()
    return p.pid


def test_first_query_after_a_kill_is_exact(shim: Shim, container: Callable[..., Container]) -> None:
    c = container()
    dead = _killed_holding(shim, c, 32 * MiB)
    assert [s.pid for s in c.live_slots()] == [dead]  # nobody has noticed yet
    (info,) = [ln for ln in shim.ctest(c, "info", "info1") if ln.cmd == "info"]
    assert info.rc == 0
    assert info.int("total") == LIMIT
    assert info.int("free") == LIMIT  # not LIMIT - 32 MiB: the dead slot was given back at start
    assert c.total() == 0
    assert c.live_slots() == []


def test_first_query_through_cuda_python_and_nvml(shim: Shim, container: Callable[..., Container]) -> None:
    """The same for a Python program: cuda-python's cuMemGetInfo and pynvml's memory
    info, its first calls after cuInit."""
    c = container()
    _killed_holding(shim, c, 48 * MiB)
    out = shim.python(
        c,
        """
        import pynvml
        f, t = chk(cu.cuMemGetInfo())
        pynvml.nvmlInit()
        m = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0))
        out.update(free=int(f), total=int(t), nvml_free=m.free, nvml_used=m.used)
        """,
    )
    assert out == {"free": LIMIT, "total": LIMIT, "nvml_free": LIMIT, "nvml_used": 0}
    assert c.total() == 0
