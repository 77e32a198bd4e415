"""A tenant's own usage file cannot hurt the agent or its neighbours.

The usage file is mounted read-write into the container (every process of it charges it),
so the container may truncate it or fill it with anything. The agent reads it by copy
(pread after fstat, never a mapping that a truncation would turn into SIGBUS), validates
size, magic and version, and clamps every byte counter (gpufrac.memguard.abi.read_usage,
parse_usage).

End to end: one 1 GiB GPU (960 MiB allocatable, 64 MiB units), the real agent, real
workload processes under the real shim (tests/fixtures/e2e.py).
"""

from __future__ import annotations

import ctypes
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpufrac.memguard import abi
from tests.fixtures.e2e import E2ENode, MiB
from tests.fixtures.hostile_tenant import agent_alive, agent_config

pytestmark = pytest.mark.security

MakeNode = Callable[..., E2ENode]


def test_truncating_its_own_usage_file_does_not_kill_the_agent(e2e_node: MakeNode) -> None:
    node = e2e_node(**agent_config())
    attacker = node.run_pod("a", 2, "256Mi")
    neighbour = node.run_pod("b", 2, "512Mi", wait_timeout="10s")
    assert attacker.alloc(64 * MiB) == "ok 1"
    # The neighbour bursts past its 128 MiB request: the arbiter reads every usage file on the GPU.
    assert neighbour.alloc(100 * MiB) == "ok 1" and neighbour.alloc(100 * MiB) == "ok 2"
    assert neighbour.grant() > 0

    os.truncate(attacker.host_dir / abi.USAGE_FILE, 0)

    # Another burst of the neighbour: the agent reads the attacker's (now empty) file again.
    assert neighbour.alloc(100 * MiB, 3) == "ok 3"
    assert neighbour.app.do("check 3") == "ok"
    assert agent_alive(node), node.sim.agent.log()[-3000:]
    # Named once in the log: whose file, and what is wrong with it.
    log = node.sim.agent.log()
    lines = [ln for ln in log.splitlines() if "usage file of pod default/a" in ln]
    assert len(lines) == 1 and "truncated" in lines[0], lines
    # The agent still serves everyone: a new pod is admitted and bursts.
    late = node.run_pod("c", 2, "256Mi", wait_timeout="10s")
    assert late.alloc(150 * MiB) == "ok 1"
    assert agent_alive(node)


# -- the reader, fuzzed ------------------------------------------------------------------------

SIZE = abi.USAGE_SIZE


def header(total: int = 0, returned: int = 0, magic: int = abi.USAGE_MAGIC) -> bytes:
    return abi.USAGE_HEADER.pack(magic, abi.ABI_VERSION, SIZE, total, returned)


def check_clean(data: bytes) -> None:
    """parse_usage on `data`: a clamped copy or FormatError, nothing else (and the header-only
    reader the arbiter uses per request agrees on the total)."""
    try:
        total = abi.parse_usage_total(data)
    except abi.FormatError:
        total = None
    try:
        u = abi.parse_usage(data)
    except abi.FormatError:
        return
    assert len(data) >= SIZE and data[:8] == abi.USAGE_MAGIC.to_bytes(8, "little")
    assert 0 <= u.total_used <= abi.USAGE_MAX_BYTES and total == u.total_used
    assert 0 <= u.grant_returned <= abi.USAGE_MAX_BYTES
    for s in u.slots:
        assert 0 <= s.used_bytes <= abi.USAGE_MAX_BYTES and 0 <= s.peak_bytes <= abi.USAGE_MAX_BYTES


u64 = st.integers(0, (1 << 64) - 1)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=SIZE + 64))
def test_any_bytes_are_a_clean_result_or_a_format_error(data: bytes) -> None:
    check_clean(data)


@settings(max_examples=300, deadline=None)
@given(
    total=u64,
    returned=u64,
    slots=st.dictionaries(st.integers(0, abi.MAX_PROCS - 1), st.tuples(u64, u64), max_size=8),
    tail=st.binary(max_size=64),
    cut=st.integers(0, SIZE + 64),
)
def test_a_valid_header_with_any_counters_is_clamped(
    total: int, returned: int, slots: dict[int, tuple[int, int]], tail: bytes, cut: int
) -> None:
    blank = bytes(SIZE - abi.USAGE_HEADER.size)
    u = abi.UsageStruct.from_buffer_copy(header(total, returned) + blank)
    for i, (used, peak) in slots.items():
        u.slots[i].pid, u.slots[i].used_bytes, u.slots[i].peak_bytes = i + 1, used, peak
    data = (bytes(u) + tail)[:cut]
    check_clean(data)
    if len(data) < SIZE:
        return
    got = abi.parse_usage(data)
    # A huge or "negative" (>= 2**63) counter reads as the cap, never as 0: garbage hides nothing.
    cap = abi.USAGE_MAX_BYTES
    assert (got.total_used, got.grant_returned) == (min(total, cap), min(returned, cap))
    for i, (used, peak) in slots.items():
        assert (got.slots[i].used_bytes, got.slots[i].peak_bytes) == (min(used, cap), min(peak, cap))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=SIZE + 64), st.sampled_from(["file", "empty", "dir", "missing"]))
def test_read_usage_on_any_file_is_a_clean_result_or_a_format_error(data: bytes, kind: str) -> None:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / abi.USAGE_FILE
        if kind == "file":
            path.write_bytes(data)
        elif kind == "empty":
            path.write_bytes(b"")
        elif kind == "dir":
            path.mkdir()
        try:
            u = abi.read_usage(d)
        except abi.FormatError:
            return
        assert kind == "file" and 0 <= u.total_used <= abi.USAGE_MAX_BYTES
        assert abi.read_usage_total(d) == u.total_used


def test_a_fifo_in_place_of_the_usage_file_does_not_block_the_reader(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / abi.USAGE_FILE)
    for read in (abi.read_usage, abi.read_usage_total):
        try:
            read(tmp_path)
        except abi.FormatError as e:
            assert "not a regular file" in str(e)
        else:
            raise AssertionError("a FIFO was read as a usage file")


def test_the_header_reader_matches_the_structure() -> None:
    assert abi.USAGE_HEADER.size == abi.UsageStruct.slots.offset
    assert ctypes.sizeof(abi.UsageStruct) == SIZE


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.integers(0, abi.MAX_PROCS - 1), st.integers(-(2**31), 2**31 - 1), max_size=12))
def test_live_slots_are_the_slots_naming_a_process(pids: dict[int, int]) -> None:
    """The agent's hot paths take a file's live slots without walking all 256 (abi.live_slots):
    the same slots, in the same order, as the walk, whatever pids a tenant wrote."""
    u = abi.UsageStruct()
    for i, pid in pids.items():
        u.slots[i].pid, u.slots[i].launches = pid, i + 1
    got = [(s.pid, s.launches) for s in abi.live_slots(u)]
    assert got == [(s.pid, s.launches) for s in u.slots if s.pid > 0]
