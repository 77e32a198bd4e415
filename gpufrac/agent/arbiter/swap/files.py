"""What the swap resolver keeps on disk and finds in /proc (blocking: worker threads).

The `swapped` flags of a container's usage slots (the shim asks for its memory back when
it sees one), the agent's own record of how much it moved to host RAM (in the container's
host directory, which the container cannot write), and the processes of a container found
by cgroup alone (a freshly started agent has no pod cache yet).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from gpufrac.agent.booking.ledger import ContainerAlloc
from gpufrac.agent.processes.callers import AgentOutOfResources, PeerLookup, scan_pids
from gpufrac.agent.processes.proc import proc_identity
from gpufrac.memguard import abi
from gpufrac.memguard.abi import FormatError

SlotId = tuple[int, int]  # (pid in the container's pid namespace, start time): how the shim names a process


@dataclass
class Swapped:
    """A container whose GPU memory is in host RAM."""

    alloc: ContainerAlloc
    gpu: str
    bytes: int  # GPU memory moved to host RAM (the container's usage when it went)
    pids: tuple[int, ...]  # host pids checkpointed
    slots: tuple[SlotId, ...]  # their usage slots, one per pid: with it, each process's identity
    since: float = field(default_factory=time.monotonic)
    needed_by: str = ""

    def gone(self, pid: int) -> bool:
        """Whether checkpointed process `pid` has exited: no process has its number, or another
        one does (a start time, or a pid in its own namespace, other than its slot's): a pid
        the kernel gave to someone else is never taken for it. Blocking: reads /proc."""
        ident = dict(zip(self.pids, self.slots, strict=False)).get(pid)  # no identity: gone
        return ident is None or proc_identity(pid) != ident

    def living(self) -> list[int]:
        """The checkpointed processes that have not exited (blocking: reads /proc)."""
        return [p for p in self.pids if not self.gone(p)]


def set_swapped(directory: str, slots: Iterable[SlotId], value: int) -> int:
    """Set the `swapped` flag of the given usage slots; returns the sum of their launch
    counters (to notice a launch that raced the swap-out). Blocking file I/O: a copy is read
    and the flags written by pwrite (the file is the container's: never mapped)."""
    want = set(slots)
    usage = abi.read_usage(directory)
    launches, writes = 0, []
    for i, s in enumerate(usage.slots):
        if s.pid > 0 and (int(s.pid), int(s.start_time)) in want:
            writes.append(("swapped", i, value))
            launches += int(s.launches)
    abi.write_usage_fields(directory, writes)
    return launches


# The agent's record of how much of a container's GPU memory it moved to host RAM, in the
# container's host directory (never mounted into the container, unlike its usage file): an
# agent started while the container is swapped out counts it from here, not from a usage
# file the container writes.
SIZE_RECORD = "swapped-bytes"


def write_size(directory: str, nbytes: int) -> None:
    """Record a swap-out's size (blocking; written whole, then renamed into place)."""
    path = os.path.join(directory, SIZE_RECORD)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(f"{nbytes}\n")
    os.replace(tmp, path)


def read_size(directory: str) -> int | None:
    """A recorded swap-out's size; None when there is none (or it cannot be read)."""
    try:
        with open(os.path.join(directory, SIZE_RECORD)) as f:
            n = int(f.read(64).strip())
    except (OSError, ValueError):
        return None
    return n if n >= 0 else None


def drop_size(directory: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(directory, SIZE_RECORD))


def maps_file(pid: int, dev: int, ino: int, proc: str = "/proc") -> bool:
    """Whether process `pid` has the file (device, inode) mapped: the shim keeps its
    container's usage file mapped, whatever path its container sees it under."""
    want = f"{os.major(dev):02x}:{os.minor(dev):02x} {ino} "
    try:
        with open(f"{proc}/{pid}/maps") as f:
            return any(want in line for line in f)
    except OSError:
        return False


def processes_of(alloc: ContainerAlloc, peers: PeerLookup) -> list[int] | None:
    """Host pids of a container's shim processes, found by cgroup alone (blocking: a /proc
    scan). Needs no pod cache, which a freshly started agent does not have yet: every
    process in the pod's cgroup that maps this container's usage file. None when the
    container's pod is not known or some process could not be looked at (the agent out of
    files), so that nothing can be concluded from finding nobody."""
    uid = alloc.pod_uid
    if not uid:
        with contextlib.suppress(FormatError):
            uid = abi.read_config(alloc.directory).pod_uid  # the identity the agent published
    if not uid:
        return None
    try:
        st = os.stat(os.path.join(alloc.directory, abi.USAGE_FILE))
    except OSError:
        return None
    try:
        found = scan_pids(lambda c: c.pod_uid == uid, peers.proc)
    except AgentOutOfResources:
        return None  # some process could not be looked at: nothing can be concluded now
    return [pid for pid in found if maps_file(pid, st.st_dev, st.st_ino, peers.proc)]


def launches_of(directory: str, slots: Iterable[SlotId]) -> int:
    want = set(slots)
    usage = abi.read_usage(directory)
    return sum(int(s.launches) for s in abi.live_slots(usage) if (int(s.pid), int(s.start_time)) in want)
