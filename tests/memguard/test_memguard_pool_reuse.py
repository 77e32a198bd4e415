"""memguard pools: a block that comes straight back is counted without asking the driver.

When the block freed into a pool last is handed out again for an allocation of
the same size, the shim knows the pool did not grow and by how much USED rose,
so it reads nothing (bench/shim.py measures that path). These check that the
count stays what the pool really holds through long runs of such reuse, mixed
with the cases that must read the pool instead: another size, a synchronize
that gave the block back (the next one may get the same address from a pool
that had to grow again), a trim.
"""

from __future__ import annotations

from collections.abc import Callable

from tests.fixtures.memguard import Container, Line, MiB, Shim, held, parse_ctest

KEEP_ALL = (1 << 64) - 1
KiB = 1 << 10


def _held(shim: Shim, c: Container, *script: object) -> tuple[list[Line], int, int]:
    """Run `script`, then hold: its lines, what the fake driver holds for the
    process then (NVML's per-process figure) and the container's count."""
    out, physical, counted, _ = held(shim, c, *script)
    return parse_ctest("".join(out)), physical, counted


def _ok(lines: list[Line]) -> None:
    bad = [ln for ln in lines if ln.rc != 0]
    assert not bad, bad


def test_reused_blocks_keep_the_count_exact(shim: Shim, container: Callable[..., Container]) -> None:
    """Hundreds of alloc/free cycles of one size on the default pool, freed memory
    kept (threshold UINT64_MAX): what is counted is what the pool holds."""
    c = container(request=96 * MiB, limit=96 * MiB)
    cycle = ["async", 4 * KiB, "freeasync", "async", 64 * KiB, "freeasync"]
    lines, physical, counted = _held(shim, c, "defpool", "thresh", KEEP_ALL, *cycle * 200, "used", "poolinfo")
    _ok(lines)
    info = [ln for ln in lines if ln.cmd == "poolinfo"][-1]
    assert info.int("used") == 0
    assert counted == info.int("reserved") == physical  # all idle in the pool, all counted


def test_reuse_with_one_allocation_live(shim: Shim, container: Callable[..., Container]) -> None:
    """A live allocation is counted at its size, the rest of what the pool holds as idle."""
    c = container(request=96 * MiB, limit=96 * MiB)
    cycle = ["async", 4 * KiB, "freeasync"]
    lines, physical, counted = _held(
        shim, c, "defpool", "thresh", KEEP_ALL, *cycle * 100, "async", 4 * KiB, "poolinfo"
    )
    _ok(lines)
    info = [ln for ln in lines if ln.cmd == "poolinfo"][-1]
    assert counted == 4 * KiB + info.int("reserved") - info.int("used")
    assert physical == info.int("reserved")


def test_blocks_given_back_at_a_synchronize_are_not_taken_for_reuse(
    shim: Shim, container: Callable[..., Container]
) -> None:
    """Threshold 0: each synchronize gives the freed block back to the GPU, and the
    next allocation grows the pool again (often at the same address): the count
    follows, up and down, and ends at zero."""
    c = container(request=96 * MiB, limit=96 * MiB)
    cycle = ["async", 4 * KiB, "freeasync", "ssync", "async", 4 * KiB, "freeasync", "async", 4 * KiB]
    cycle += ["used", "freeasync", "sync", "used"]
    lines, physical, counted = _held(shim, c, "defpool", *cycle * 30, "trim", 0, "used")
    _ok(lines)
    used = [ln.int("total") for ln in lines if ln.cmd == "used"]
    cycles, last = used[:-1], used[-1]
    assert cycles[0::2] == [4 * KiB] * 30  # one live allocation, nothing idle
    assert cycles[1::2] == [0] * 30 and last == 0  # synchronized: given back
    assert counted == physical == 0
