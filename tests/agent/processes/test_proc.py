"""What /proc says of a process, read the way the shim names it (processes/proc.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpufrac.agent.processes.proc import proc_identity

pytestmark = pytest.mark.unit


def test_process_identity_matches_the_shims_naming() -> None:
    pid = os.getpid()
    ns_pid, start = proc_identity(pid)  # type: ignore[misc]
    assert ns_pid == pid  # no pid namespace between this test and itself
    stat = Path(f"/proc/{pid}/stat").read_text()
    assert start == int(stat[stat.rfind(")") + 2 :].split()[19])
    assert proc_identity(2**22 + 12345) is None  # above pid_max: no such process
