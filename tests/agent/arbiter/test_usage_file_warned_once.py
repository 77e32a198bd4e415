"""A tenant flipping its usage file between readable and broken gets one warning, not a flood.

A usage file the agent cannot use (a bad magic, a short file) is logged with the container
and the reason, and only that container's bursts are refused. The warning used to be said
again every time the file read well in between: a tenant rewriting its header between a good
and a bad one wrote a WARNING into the agent's log about once a second. Now it is said once
per container and kind of fault per hour (gpufrac.agent.arbiter.usage.ContainerFiles), the
numbers in the reason (which the tenant writes) left out of what makes a kind.

Real sockets, real agent loop (tests/fixtures/arbiter_harness.py); the tenants are processes
in their pods' real cgroups, speaking the shim's protocol.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable

import pytest

from gpufrac.memguard import abi
from tests.fixtures.arbiter_harness import ArbiterNode, Box, GiB

pytestmark = pytest.mark.security

Make = Callable[..., ArbiterNode]


MAGIC = abi.UsageStruct.magic


def write_magic(box: Box, value: int) -> None:
    """Overwrite the magic of the container's usage file, as any of its processes can."""
    fd = os.open(os.path.join(box.alloc.directory, abi.USAGE_FILE), os.O_WRONLY)
    try:
        os.pwrite(fd, value.to_bytes(MAGIC.size, sys.byteorder), MAGIC.offset)
    finally:
        os.close(fd)


def warnings_about(caplog: pytest.LogCaptureFixture, box: Box) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING
        and "usage file" in r.getMessage()
        and f"/{box.pod} " in r.getMessage()
    ]


def test_a_usage_file_flipping_between_good_and_broken_is_warned_about_once(
    make_node: Make, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="gpufrac.agent.arbiter")
    node = make_node()
    t = node.add("t", 2, "8Gi")
    n = node.add("n", 2, "8Gi")
    tw, nw = t.workload, n.workload
    assert tw is not None and nw is not None
    good = abi.USAGE_MAGIC
    for i in range(6):
        write_magic(t, 0xBAD0 + i)  # a different bad magic each time
        assert tw.do(f"burst {GiB} {3 * GiB}") == "denied"  # its file cannot be read: its burst is refused
        write_magic(t, good)
        # Read well again, as the grant sweep reads every file each second.
        assert node.on_loop(lambda: node.arbiter.files.usage_of(t.alloc)) is not None
        assert tw.do(f"burst {GiB} {3 * GiB}") == "granted"
        assert tw.do(f"free {GiB}") == "granted"
    said = warnings_about(caplog, t)
    assert len(said) == 1, said
    assert "bad magic" in said[0]
    # Another container's broken file is its own warning.
    write_magic(n, 0)
    assert nw.do(f"burst {GiB} {3 * GiB}") == "denied"
    assert len(warnings_about(caplog, n)) == 1
    assert len(warnings_about(caplog, t)) == 1


@pytest.mark.parametrize("fault", ["truncated", "bad magic"])
def test_one_fault_read_by_header_and_whole_file_is_one_warning(
    make_node: Make, caplog: pytest.LogCaptureFixture, fault: str
) -> None:
    """A burst reads only the file's header, the grant sweep the whole file: one broken file is
    one warning whichever reads it first (both used to word a short file differently)."""
    caplog.set_level(logging.WARNING, logger="gpufrac.agent.arbiter")
    node = make_node()
    t = node.add("t", 2, "8Gi")
    tw = t.workload
    assert tw is not None
    if fault == "truncated":
        os.truncate(os.path.join(t.alloc.directory, abi.USAGE_FILE), 0)
    else:
        write_magic(t, 0xBAD0)
    assert tw.do(f"burst {GiB} {3 * GiB}") == "denied"  # the header read
    assert node.on_loop(lambda: node.arbiter.files.usage_of(t.alloc)) is None  # the whole file
    assert tw.do(f"burst {GiB} {3 * GiB}") == "denied"
    said = warnings_about(caplog, t)
    assert len(said) == 1, said
    assert fault in said[0]
