"""In a pod's own pid namespace, every process's context is charged exactly what the driver
shows for it, whatever a neighbour allocates meanwhile, and NVML lists the pod's processes.

NVML names processes by their host pids; a process in a pod's pid namespace knows only its
own namespace's pid, and its /proc shows nothing of the host. It used to learn which NVML
entry was its own only if NVML's list and figures held still while it looked: under a
neighbour's allocation churn it could not, and its context was charged the device-wide
change instead, the neighbour's allocations included (49 to 167 MiB too much in four runs,
starts refused inside their guarantee), and NVML's lists through the shim showed nothing.
Now each process asks the agent for its host pid (op IDENTIFY, answered from SO_PEERCRED on
its own connection) before its first context, and reads the driver's per-process figure.

Every part real (tests/fixtures/e2e.py): the agent a subprocess; two pods whose processes run
under the real shim in real cgroups, the pod in a pid and mount namespace of its own (the
runtime emulator's, as a container runtime makes them); the neighbour churning GiBs through
cuda-python; each charge compared with the simulated driver's per-process figure (NVML's).
On the shim before the fix (three runs): NVML's list was empty every time; in the run that
went through five rounds, the second round charged one start 0 (a negative device-wide
change is dropped) and another 1 GiB (the ceiling of a context measured device-wide).
"""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Callable

import pytest

from gpufrac.agent.processes.proc import proc_identity
from gpufrac.memguard import abi
from gpufrac.simgpu.nodestate import NodeState
from tests.fixtures.e2e import TIMEOUT, E2ENode, MiB, PodRun

pytestmark = pytest.mark.security

CTX = 256 * MiB  # each context, per process, on this node
STARTS, ROUNDS = 4, 5  # processes started at once in the pod, and how many times

NODE = {
    "node_name": "sim-pidns",
    "gpus": [
        {
            "model": "NVIDIA H100 80GB HBM3",
            "memory": "24Gi",
            "reserved": "0",
            "pci_bus_id": "00000000:18:00.0",
            "context_memory": "256Mi",
        }
    ],
}

PRE = """
import os, select, subprocess, sys
from cuda.bindings import driver as cu
def chk(r):
    err, *rest = r if isinstance(r, tuple) else (r,)
    if int(err) != 0:
        raise SystemExit(f"CUDA error {r!r}")
    return rest[0] if len(rest) == 1 else rest
"""

# A well-behaved neighbour: 256 MiB allocated after another, as fast as it can, up to 12 GiB,
# then all freed, again, until told to stop: the device's used memory swings by GiBs within
# any context creation next to it (and NVML's figures never hold still for long).
CHURN = (
    PRE
    + """
chk(cu.cuInit(0))
chk(cu.cuCtxSetCurrent(chk(cu.cuDevicePrimaryCtxRetain(chk(cu.cuDeviceGet(0))))))
print("ready", flush=True)
held = []
while not select.select([sys.stdin], [], [], 0)[0]:
    if len(held) < 48:
        held.append(chk(cu.cuMemAlloc(256 << 20)))
    else:
        for p in held:
            chk(cu.cuMemFree(p))
        held = []
for p in held:
    chk(cu.cuMemFree(p))
sys.stdin.readline()
print("bye", flush=True)
"""
)

# The pod's first process: on "start N" it starts N processes at once, each of which creates
# its context and answers its pid (this namespace's); "nvml" lists GPU 0's compute processes
# through the shim; "stop" ends the started ones.
CHILD = (
    PRE
    + """
chk(cu.cuInit(0))
chk(cu.cuDevicePrimaryCtxRetain(chk(cu.cuDeviceGet(0))))
print("up", os.getpid(), flush=True)
sys.stdin.readline()
"""
)
POD = (
    PRE
    + f"""
CHILD = {CHILD!r}
print("ready", flush=True)
kids = []
for line in sys.stdin:
    cmd, *a = line.split()
    if cmd == "start":
        new = [subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True) for _ in range(int(a[0]))]
        ups = [k.stdout.readline().split() for k in new]
        kids += new
        print(" ".join(["up"] + [u[1] if len(u) == 2 else "failed" for u in ups]), flush=True)
    elif cmd == "nvml":
        import pynvml
        pynvml.nvmlInit()
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(pynvml.nvmlDeviceGetHandleByIndex(0))
        print(" ".join(["pids"] + sorted(str(p.pid) for p in procs)), flush=True)
        pynvml.nvmlShutdown()
    elif cmd in ("stop", "exit"):
        for k in kids:
            k.stdin.close()
            k.wait()
        kids = []
        print("ok" if cmd == "stop" else "bye", flush=True)
        if cmd == "exit":
            break
"""
)


def host_pids(pod: PodRun) -> dict[int, int]:
    """The pod's processes: pid in its own namespace -> host pid (as the host's /proc says)."""
    out = {}
    for host in pod.container.pids():
        ident = proc_identity(host)
        if ident is not None:
            out[ident[0]] = host
    return out


def driver_figures(node: E2ENode) -> dict[int, int]:
    """What the simulated driver holds per host pid: NVML's per-process figure."""
    with NodeState(node.sim.node_state) as st:
        return {int(p.pid): int(p.used_bytes) for p in st.live_procs()}


@pytest.mark.slow
def test_in_a_pods_own_pid_namespace_every_context_is_charged_exactly_and_nvml_lists_the_pod(
    e2e_node: Callable[..., E2ENode],
) -> None:
    node = e2e_node(node_spec=NODE)
    neighbour = node.run_pod("neighbour", 224, argv=[sys.executable, "-c", CHURN])  # 14 GiB
    pod = node.run_pod("pod", 32, pid_namespace=True, argv=[sys.executable, "-c", textwrap.dedent(POD)])
    assert 1 in host_pids(pod)  # its first process is pid 1 there: a namespace of its own
    for _ in range(ROUNDS):
        answer = pod.app.do(f"start {STARTS}", TIMEOUT).split()
        assert answer[0] == "up" and "failed" not in answer, f"{answer}\n{node.sim.agent.log()[-3000:]}"
        started = sorted(int(p) for p in answer[1:])
        where = host_pids(pod)
        counted = {int(s.pid): int(s.used_bytes) for s in abi.read_usage(pod.host_dir).slots if s.pid > 0}
        truth = driver_figures(node)
        # Every start: what the shim counted for the process is the driver's figure for it,
        # byte for byte, its context alone, while the neighbour's GiBs come and go.
        charges = {p: (counted.get(p), truth.get(where[p])) for p in started}
        assert all(c == t == CTX for c, t in charges.values()), charges
        # NVML through the shim lists the pod's GPU processes, by the pids the pod knows them by.
        assert pod.app.do("nvml", TIMEOUT) == " ".join(["pids", *sorted(str(p) for p in started)])
        assert pod.app.do("stop", TIMEOUT) == "ok"
    assert neighbour.alive(), "the neighbour stopped churning"
    assert pod.used() == 0  # each context gave back exactly what it was charged
