"""What a dead agent's compute shares left behind, undone by the next agent as it starts
(docs/compute.md, "How it is held", step 6, Stopping).

An agent killed (SIGKILL, OOM, a node's agent pod deleted by force) while it held a container
from outside (compute/hold.py) leaves that container's GPU processes stopped, and one killed
while it paced a container leaves the pace in its config. Nothing else ever continues or lifts
them: the next agent does it once, at its start, before anything else of it may stop or pace a
container, whether or not it runs compute shares itself (compute.enabled: false, NVML without
per-process utilisation), and without waiting for pod identity (an apiserver slow or away at its
start) where the state file knows the pod; where it does not (the agent was killed before its
batched state save recorded the pod), once pod identity binds the booking to its pod.

What is continued rests on what the driver and the kernel report, never on a tenant's files: a
process NVML lists on a GPU of a container the restored ledger books, whose cgroup (the
kernel's) names that container's pod, and that is stopped by a signal now (state T in
/proc/<pid>/stat; a process stopped by a debugger is in state t and left alone). Which of the
pod's containers it is in cannot be told before the pod's status is read; a process of the same
pod (the tenant's own) on that GPU is continued as well. Every booked container's pace is set to
0: the agent owns the config files, and a compute loop that runs writes its own pace at its
first period.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection, Sequence
from typing import Protocol

from gpufrac.agent.booking.ledger import ContainerAlloc
from gpufrac.agent.compute import hold
from gpufrac.agent.gpu.processes import GpuProcess, read_gpu_processes
from gpufrac.agent.processes.callers import CgroupIdentity, PeerError, read_cgroup

log = logging.getLogger(__name__)


class Booked(Protocol):
    """The restored bookings and their configs' paces (gpufrac.agent.booking.ledger.Ledger)."""

    def containers(self) -> Sequence[ContainerAlloc]: ...

    def get(self, key: str) -> ContainerAlloc | None: ...

    def compute_pace(self, key: str) -> int: ...

    def set_compute_pace(self, key: str, pace_ns: int) -> None: ...


def booked_gpus(containers: Collection[ContainerAlloc]) -> frozenset[tuple[str, str]]:
    """(pod UID, GPU UUID) for every GPU a booking holds for a pod it serves (a device-plugin
    container's pod; each consumer's pod of a claim). A booking whose pod is not known yet
    gives none (a hold needs the pod to place a process: `Leftovers.changed` looks once it is known)."""
    out: set[tuple[str, str]] = set()
    for a in containers:
        pods = {uid for uid, _ in a.consumers} | ({a.pod_uid} if a.pod_uid else set())
        out.update((uid, gpu) for uid in pods for gpu in a.gpus)
    return frozenset(out)


def continue_left_stopped(
    booked: Collection[tuple[str, str]],
    proc: str = "/proc",
    listed: Callable[[], list[GpuProcess]] = read_gpu_processes,
) -> int:
    """SIGCONT every stopped process NVML lists on a GPU its pod books (`booked_gpus`); how
    many. Blocking (NVML, a /proc read or two per process): run it in a worker thread."""
    ours: list[tuple[int, CgroupIdentity]] = []
    for p in listed():
        try:
            ident = read_cgroup(p.pid, proc)
        except PeerError:  # gone, or its cgroup refused: no container's
            continue
        if ident is not None and (ident.pod_uid, p.gpu) in booked:
            ours.append((p.pid, ident))
    # continue_stopped pins each through a pidfd and checks its cgroup again before the signal.
    return hold.continue_stopped(ours, proc)


def lift_paces(bookings: Booked) -> int:
    """Set every booked container's launch pace to 0; how many were not."""
    lifted = 0
    for a in bookings.containers():
        if bookings.compute_pace(a.key):
            bookings.set_compute_pace(a.key, 0)
            lifted += 1
    if lifted:
        log.warning("compute shares: lifted %d launch paces an earlier agent left", lifted)
    return lifted


class Leftovers:
    """Undoes, as the agent starts, what a killed agent's compute shares left. Owned by the
    agent's loop; `changed` is a ledger listener."""

    def __init__(self, bookings: Booked, proc: str = "/proc") -> None:
        self.bookings = bookings
        self.proc = proc
        # Restored bookings whose pod was not known at start (the agent killed before its state
        # save recorded it): their processes are looked at once their pod is.
        self._untied: set[str] = set()
        self._passes: set[asyncio.Task[None]] = set()

    async def undo(self) -> None:
        """Lift the paces and continue the stopped GPU processes an earlier agent left: call once
        the ledger is restored, before the compute loop starts."""
        lift_paces(self.bookings)
        containers = self.bookings.containers()
        self._untied = {a.key for a in containers if not booked_gpus([a])}
        await self._continue(booked_gpus(containers))

    def changed(self) -> None:
        """A restored booking's pod became known (pod identity, a claim's consumers): its stopped
        GPU processes are continued now. Runs on the loop at every ledger change: cheap once
        every restored booking is tied."""
        if not self._untied:
            return
        tied: list[ContainerAlloc] = []
        for key in list(self._untied):
            a = self.bookings.get(key)
            if a is None or booked_gpus([a]):
                self._untied.discard(key)
                if a is not None:
                    tied.append(a)
        if tied:
            task = asyncio.get_running_loop().create_task(self._continue(booked_gpus(tied)))
            self._passes.add(task)
            task.add_done_callback(self._passes.discard)

    async def _continue(self, booked: frozenset[tuple[str, str]]) -> None:
        if not booked:
            return
        try:
            await asyncio.to_thread(continue_left_stopped, booked, self.proc)
        except Exception as e:  # NVML's list failing: nothing to place a process by
            log.error("compute shares: cannot look for GPU processes an earlier agent left stopped: %s", e)
