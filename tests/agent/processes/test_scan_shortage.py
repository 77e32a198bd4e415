"""A /proc scan the agent could not finish for want of files never passes for a complete one.

A container's processes are found by a scan of /proc, one cgroup file per process
(gpufrac.agent.processes.callers.scan_pids), for a kill, a swap-out and a swap takeover. A process whose
cgroup file the agent could not open (out of files, out of memory) is not "not the
container's": leaving it out would let a kill count a victim done with a process of it left
(gpufrac.agent.processes.kill: never "already gone" for a shortage) and a swap miss one. So the scan
raises AgentOutOfResources, and its callers say they cannot tell (kill: KillFailed; swap: not
swapped; takeover: looked at again later).

Real processes in real cgroups (gpufrac.simgpu.runtime), a real file limit.
"""

from __future__ import annotations

import contextlib
import sys
import uuid

import pytest

from gpufrac.agent.processes.callers import AgentOutOfResources, CgroupIdentity, scan_pids
from gpufrac.simgpu.runtime import ContainerRuntime
from tests.fixtures.descriptors import no_free_descriptor

pytestmark = pytest.mark.security


def test_a_scan_that_runs_out_of_files_raises_instead_of_leaving_processes_out(
    runtime: ContainerRuntime,
) -> None:
    pod = str(uuid.uuid4())
    first = runtime.start(pod, "main", [sys.executable, "-c", "import time; time.sleep(120)"])
    runtime.wait_entered(first)
    # Started after it (a higher pid, listed after it): the process the scan cannot look at.
    later = runtime.start(pod, "main", [sys.executable, "-c", "import time; time.sleep(120)"])
    runtime.wait_entered(later)
    assert first.proc.pid < later.proc.pid, "pids wrapped: run again"
    # Both are found while the agent has files.
    assert {first.proc.pid, later.proc.pid} <= set(scan_pids(lambda c: c.pod_uid == pod))
    with contextlib.ExitStack() as short:
        ran_out: list[int] = []

        def match(ident: CgroupIdentity) -> bool:
            # Once the scan has reached the first container process, the agent runs out of files.
            if ident.pod_uid == pod and not ran_out:
                short.enter_context(no_free_descriptor())
                ran_out.append(1)
            return ident.pod_uid == pod

        with pytest.raises(AgentOutOfResources, match="cannot read"):
            scan_pids(match)
    assert ran_out
