"""simgpu's fake libcuda.so.1: the process checkpoint API across processes — what
the agent's swap resolver does to an idle workload (lock, checkpoint; restore,
unlock), with the workload's buffers intact and the node state following."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from gpufrac.simgpu.nodestate import NodeState
from tests.fixtures.fakecuda import MIB, Workload, gpu_used, ok, run_py, slot_fields
from tests.fixtures.simnode import SimNode

TARGET = """
import time
dev, ctx = setup(0)
k = kernels()
n = (256 << 20) // 4
buf = ck(d.cuMemAlloc(n * 4))
fill(k, buf, n, 0xFEED)
ck(d.cuCtxSynchronize())
say(ready=True, buf=int(buf))
wait_for("alloc")
p = ck(d.cuMemAlloc(1 << 20))        # blocks at the API gate while locked or checkpointed
say(alloc_done_ns=time.time_ns())
wait_for("check")
base, size = ck(d.cuMemGetAddressRange(buf))
say(bad=mismatches(k, buf, n, 0xFEED), same=int(base) == int(buf))
"""


def agent(pid: int) -> str:
    """The agent's side, through cuda-python, one step per 'go' on stdin."""
    return f"""
import time
pid = {pid}
ck(d.cuInit(0))
def state():
    return int(ck(d.cuCheckpointProcessGetState(pid)))
args = d.CUcheckpointLockArgs()
args.timeoutMs = 30000
ck(d.cuCheckpointProcessLock(pid, args))
say(step="locked", state=state(), again=err(d.cuCheckpointProcessLock(pid, args)))
wait_for("go")
ck(d.cuCheckpointProcessCheckpoint(pid, None))
say(step="checkpointed", state=state())
wait_for("go")
say(step="restore-full", err=err(d.cuCheckpointProcessRestore(pid, None)), state=state())
wait_for("go")
ck(d.cuCheckpointProcessRestore(pid, None))
say(step="restored", state=state())
wait_for("go")
unlock_ns = time.time_ns()
ck(d.cuCheckpointProcessUnlock(pid, None))
say(step="unlocked", state=state(), unlock_ns=unlock_ns)
"""


@pytest.mark.parametrize("flavour", ["release", "asan"])
def test_lock_checkpoint_restore_unlock_from_another_process(
    make_sim_node: Callable[..., SimNode], flavour: str
) -> None:
    # Contexts cost nothing here: the test counts the GPU's used memory to the byte through
    # checkpoint and restore, and fills the GPU to all but 128 MiB with a third process.
    node = make_sim_node("pcie-l4x4", flavour=flavour, context_memory=0)
    cap = (23034 - 318) * MIB
    target = Workload(node, TARGET)
    filler = ag = None
    try:
        assert target.read()["ready"]
        pid = target.p.pid
        assert gpu_used(node) == 256 * MIB
        ag = Workload(node, agent(pid))
        r = ag.read()
        assert r == {"step": "locked", "state": 1, "again": 401}  # LOCKED; locking twice: ILLEGAL_STATE
        target.send("alloc")  # its next API call now waits at the gate
        ag.send("go")
        assert ag.read() == {"step": "checkpointed", "state": 2}
        (slot,) = slot_fields(node, pid)
        assert (slot["used_bytes"], slot["swapped_bytes"]) == (0, 256 * MIB)
        assert gpu_used(node) == 0  # NVML no longer counts it
        # Someone else takes nearly all the GPU: the restore cannot fit.
        filler = Workload(
            node, f"setup(0)\np = ck(d.cuMemAlloc({cap - 128 * MIB}))\nsay(held=True)\nwait_for('exit')\n"
        )
        assert filler.read()["held"]
        ag.send("go")
        assert ag.read() == {
            "step": "restore-full",
            "err": 2,
            "state": 2,
        }  # OUT_OF_MEMORY, still CHECKPOINTED
        assert gpu_used(node) == cap - 128 * MIB
        filler.send("exit")
        filler.finish()
        ag.send("go")
        assert ag.read() == {"step": "restored", "state": 1}
        (slot,) = slot_fields(node, pid)
        assert (slot["used_bytes"], slot["swapped_bytes"]) == (256 * MIB, 0)
        ag.send("go")
        unlocked = ag.read()
        assert unlocked["state"] == 0
        ag.finish()
        # The call that waited at the gate went through only after the unlock.
        assert target.read()["alloc_done_ns"] >= unlocked["unlock_ns"]
        target.send("check")
        assert target.read() == {"bad": 0, "same": True}  # bytes and addresses intact
        assert gpu_used(node) == 257 * MIB
        target.finish()
    finally:
        for w in (target, ag, filler):
            if w:
                w.kill()


def test_lock_times_out_while_a_call_is_in_progress(sim_node: SimNode) -> None:
    target = Workload(
        sim_node,
        """
        dev, ctx = setup(0)
        k = kernels()
        ck(d.cuLaunchKernel(k["busy_us"], 1, 1, 1, 1, 1, 1, 0, 0, ((60_000_000,), (U64,)), 0))
        say(syncing=True)
        ck(d.cuCtxSynchronize())     # in the driver for a minute
        """,
    )
    try:
        assert target.read()["syncing"]
        pid = target.p.pid
        r = run_py(
            sim_node,
            f"""
            ck(d.cuInit(0))
            args = d.CUcheckpointLockArgs()
            args.timeoutMs = 300
            say(lock=err(d.cuCheckpointProcessLock({pid}, args)),
                state=int(ck(d.cuCheckpointProcessGetState({pid}))))
            """,
        )
        # The in-flight call never drains in time: CUDA_ERROR_TIMEOUT, left RUNNING.
        assert ok(r) == [{"lock": 909, "state": 0}]
    finally:
        target.kill()


def test_checkpoint_refused_when_unsupported_or_unknown(sim_node: SimNode) -> None:
    holder = Workload(sim_node, "setup(0)\nsay(ready=True)\nwait_for('exit')\n")
    try:
        holder.read()
        code = f"""
            ck(d.cuInit(0))
            say(state=err(d.cuCheckpointProcessGetState({holder.p.pid})),
                unknown=err(d.cuCheckpointProcessGetState(2 ** 22 + 7)),
                unlock_running=err(d.cuCheckpointProcessUnlock({holder.p.pid}, None)))
            """
        assert ok(run_py(sim_node, code)) == [{"state": 0, "unknown": 500, "unlock_running": 401}]
        with NodeState(sim_node.path) as st:
            st.node.checkpoint_supported = 0
        (res,) = ok(run_py(sim_node, code))
        assert res["state"] == 801  # CUDA_ERROR_NOT_SUPPORTED: the swap resolver reports itself unavailable
        holder.send("exit")
        holder.finish()
    finally:
        holder.kill()
