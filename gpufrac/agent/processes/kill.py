"""Killing a container's processes: the one place the agent sends SIGKILL.

Used by the arbiter's eviction (every process of a victim container) and by the watchdog's
enforcement (one process over its container's limit, or a hidden one: its cgroup file
refused). A pid is only a number the kernel may hand to a new process at any time, so every
kill goes through a pidfd, and the process is checked to still be in the container it was
chosen from once that pidfd pins it. All of it blocks (a /proc read per pid, waiting for
exits): callers run it in a worker thread.

A victim may have thousands of processes, more than the agent has file descriptors: each is
signalled through a pidfd closed right after, and their exits are waited for BATCH at a time.
Running out of descriptors is never taken for "already gone": such a process is reported as
not killed (KillFailed), and an eviction whose victim's GPU processes live on has not freed its
memory. KillFailed says how many processes were signalled all the same: a victim whose
processes were killed has been disrupted, and is announced as such (gpufrac.agent.arbiter.resolvers).

A process killed while traced with PTRACE_O_TRACEEXIT stops at the start of its exit, keeping
its memory and GPU contexts, for as long as its tracer lets it; a second SIGKILL does nothing.
A tenant could so hold a process the watchdog kills (the tracer another process of its own,
which the watchdog does not judge). So the tracers of each process killed are killed too, and
theirs in turn, when they are the tenant's: in the tracee's pod (_tenants_tracer). A tracer
can only be the tenant's or trace by its own choice: ptrace needs the tracee in its pid
namespace (or the tracee's PTRACE_TRACEME to the parent that forked it there).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import select
import signal
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from gpufrac.agent.booking.ledger import ContainerAlloc
from gpufrac.agent.processes.callers import (
    AgentOutOfResources,
    CgroupIdentity,
    PeerError,
    cgroup_of,
    cgroup_refused,
    in_container,
    placement,
)
from gpufrac.agent.processes.proc import STARTTIME, start_time, stat_fields

log = logging.getLogger(__name__)

# How long killed processes get to exit after SIGKILL before the killer gives up waiting.
KILL_WAIT = 10.0
# Exits waited for at once (one pidfd each).
BATCH = 64

_SHORTAGE = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM})


class KillFailed(Exception):
    """Some process could not be signalled (the agent out of files, a refusal), or a process
    the driver counts for a victim is still alive in it after the kill (slow to exit, or the
    agent unable to tell). `signalled`: how many were signalled all the same (more than 0:
    the victim was disrupted, its memory not yet known to be free)."""

    def __init__(self, message: str, signalled: int = 0) -> None:
        super().__init__(message)
        self.signalled = signalled


def _started(pid: int) -> int:
    """A process's start time (clock ticks after boot), 0 when it is gone."""
    fields = stat_fields(pid)
    return int(fields[STARTTIME]) if fields else 0


def _signal(pid: int, still_ours: Callable[[int], bool] | None) -> int | None:
    """SIGKILL `pid` through a pidfd, if `still_ours` still says so once the pidfd pins it;
    its start time when signalled, None when it is gone or not ours. Raises OSError when
    the agent cannot (out of files: never "gone"), AgentOutOfResources from `still_ours`."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return None  # gone
    try:
        started = _started(pid)  # the pidfd pins the pid: this is that process's
        if not started or (still_ours is not None and not still_ours(pid)):
            return None
        try:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        except ProcessLookupError:
            return None  # exited between pidfd_open and the signal
        return started
    finally:
        os.close(fd)


def _try_signal(
    pid: int, still_ours: Callable[[int], bool] | None, failed: list[str], what: str = ""
) -> int | None:
    """`_signal`, a failure to signal (the agent out of files) added to `failed` as None."""
    try:
        return _signal(pid, still_ours)
    except (OSError, AgentOutOfResources) as e:
        failed.append(f"{what}{pid} ({e.strerror if isinstance(e, OSError) else e})")
        return None


def _status_field(pid: int, name: bytes) -> int:
    """A number from /proc/<pid>/status (any thread id works), 0 when gone or unreadable."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(name + b":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _tracer(pid: int) -> int:
    """The process tracing `pid`, 0 when none. TracerPid names the tracing thread, which may
    be any thread of its process: the process is that thread's Tgid."""
    tid = _status_field(pid, b"TracerPid")
    return _status_field(tid, b"Tgid") if tid else 0


def _pid_ns(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def _tenants_tracer(tracer: int, tracee: int) -> bool:
    """Whether `tracer` is the tracee's tenant's own, to be killed with it: in the tracee's pod,
    or in cgroups nested past PATH_MAX (only a tenant makes those); for a tracee so nested
    (its pod unknown), one in the tracee's pid namespace that is not the agent's (the host's).
    A host process is spared (a debugger the operator runs), and so is another pod's (a
    profiler with the host's pids): it traces by its own choice."""
    t = placement(tracer)
    if t is True:
        return True
    if not isinstance(t, CgroupIdentity):
        return False
    p = placement(tracee)
    if isinstance(p, CgroupIdentity):
        return t.pod_uid == p.pod_uid
    ns = _pid_ns(tracee)
    return p is True and ns is not None and ns == _pid_ns(tracer) and ns != _pid_ns(os.getpid())


def _signal_tracers(signalled: Sequence[tuple[int, int]], failed: list[str]) -> list[tuple[int, int]]:
    """Kill the tenant's tracers of the processes signalled, and theirs in turn (a tracer held
    at its exit by its own tracer holds its tracee too); those killed, with their start times.
    A killed process held at its exit keeps its memory for as long as its tracer lives. Each
    tracer is killed only if, once its pidfd pins it, it still traces that very process."""
    out: list[tuple[int, int]] = []
    seen = {pid for pid, _ in signalled}
    level = list(signalled)
    while level:  # `seen` ends it: every process is looked at once
        tracers: dict[int, tuple[int, int]] = {}
        for tracee, tracee_started in level:
            t = _tracer(tracee)
            if t and t not in seen and t != os.getpid():
                tracers.setdefault(t, (tracee, tracee_started))
        level = []
        for t, (tracee, tracee_started) in sorted(tracers.items()):
            seen.add(t)

            def still_its(pid: int, tracee: int = tracee, tracee_started: int = tracee_started) -> bool:
                # The pid may be another process's by now: it must still trace that tracee.
                return (
                    _tracer(tracee) == pid
                    and _started(tracee) == tracee_started
                    and _tenants_tracer(pid, tracee)
                )

            t_started = _try_signal(t, still_its, failed, "tracer ")
            if t_started is not None:
                log.warning("killed process %d too: it traced process %d, being killed", t, tracee)
                out.append((t, t_started))
                level.append((t, t_started))
    return out


def _wait_exits(signalled: Sequence[tuple[int, int]], deadline: float) -> int:
    """Wait (pidfds, no polling) until the processes signalled are gone, BATCH at a time;
    how many had not exited by the deadline (or could not be watched)."""
    late, i = 0, 0
    while i < len(signalled):
        fds: list[int] = []
        try:
            while i < len(signalled) and len(fds) < BATCH:
                pid, started = signalled[i]
                try:
                    fd = os.pidfd_open(pid)
                except ProcessLookupError:
                    i += 1
                    continue  # exited and reaped
                except OSError as e:
                    if e.errno in _SHORTAGE and fds:
                        break  # wait for these first: their descriptors come back
                    late += 1  # cannot watch it; it was signalled all the same
                    i += 1
                    continue
                i += 1
                try:
                    same = _started(pid) == started
                except OSError:
                    same = True  # cannot tell: watch it
                if same:
                    fds.append(fd)
                else:
                    os.close(fd)  # reaped, and its pid is another process's now
            late += _poll_exits(fds, deadline)
        finally:
            for fd in fds:
                os.close(fd)
    return late


def _poll_exits(fds: list[int], deadline: float) -> int:
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    pending = set(fds)
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        for fd, _ in poller.poll(left * 1000):
            pending.discard(fd)
            with contextlib.suppress(KeyError):
                poller.unregister(fd)
    return len(pending)


def kill_and_wait(
    pids: Sequence[int], timeout: float = KILL_WAIT, still_ours: Callable[[int], bool] | None = None
) -> int:
    """SIGKILL every pid, then wait (pidfd, no polling) until they are gone. Blocking: run in
    a thread. `still_ours(pid)`, checked once the pidfd pins the process, skips a pid that
    now names another process (reused). Each pidfd is closed once its signal is sent, so any
    number of processes costs one descriptor at a time (and BATCH while waiting). Their tracers
    in pods are killed with them (the module's doc says why). Returns how many of `pids` were
    signalled; raises KillFailed, after signalling all the others, when some could
    not be (the agent out of files: never taken for "already gone")."""
    signalled: list[tuple[int, int]] = []
    failed: list[str] = []
    for pid in dict.fromkeys(pids):
        started = _try_signal(pid, still_ours, failed)
        if started is not None:
            signalled.append((pid, started))
    tracers = _signal_tracers(signalled, failed)
    late = _wait_exits([*signalled, *tracers], time.monotonic() + timeout)
    if late:
        log.error("%d killed process(es) did not exit within %.0fs", late, timeout)
    if failed:
        raise KillFailed(
            f"{len(failed)} process(es) could not be signalled: {', '.join(failed[:8])}", len(signalled)
        )
    return len(signalled)


def kill_if_same(
    pid: int, ident: CgroupIdentity, proc_root: str = "/proc", timeout: float = KILL_WAIT
) -> bool:
    """SIGKILL `pid` only if it is still the process of that container (a pidfd pins it
    against pid reuse between the check and the signal); wait for it to exit."""
    return kill_and_wait([pid], timeout, still_ours=lambda p: in_container(p, ident, proc_root)) == 1


def kill_if_seen(
    pid: int, ident: CgroupIdentity, started: int, proc_root: str = "/proc", timeout: float = KILL_WAIT
) -> bool:
    """`kill_if_same`, and only while it is the process the driver listed (its start time
    `started`; 0: not known, the container alone decides): a pid the container's next process
    took holds none of the memory the kill was for. Waits for it to exit."""

    def still_it(p: int) -> bool:
        return (not started or start_time(p, proc_root) == started) and in_container(p, ident, proc_root)

    return kill_and_wait([pid], timeout, still_ours=still_it) == 1


def kill_if_hidden(pid: int, started: int, proc_root: str = "/proc", timeout: float = KILL_WAIT) -> bool:
    """SIGKILL `pid` only if, once a pidfd pins it, it is still the process seen (its start
    time `started`) and the kernel still refuses its cgroup file: never a process whose cgroup
    now reads as anyone's (it is judged as theirs then). Waits for it to exit."""

    def still_hidden(p: int) -> bool:
        return start_time(p, proc_root) == started and cgroup_refused(p, proc_root)

    return kill_and_wait([pid], timeout, still_ours=still_hidden) == 1


class ContainerPids(Protocol):
    """Which processes are a container's now (gpufrac.agent.processes.callers.PeerLookup)."""

    @property
    def proc(self) -> str: ...  # the /proc root

    def pids_of(self, alloc: ContainerAlloc) -> list[int]: ...
    def owns(self, alloc: ContainerAlloc, ident: CgroupIdentity) -> bool: ...


def _ours(pids: ContainerPids, alloc: ContainerAlloc, pid: int) -> bool:
    """Whether `pid` is a process of `alloc`'s container now (its cgroup, the pod's status).
    Raises AgentOutOfResources when that cannot be looked at."""
    try:
        ident = cgroup_of(pid, pids.proc)
    except AgentOutOfResources:
        raise
    except PeerError:  # gone, its cgroup refused, its hierarchies disagree: not the container's
        return False
    return ident is not None and pids.owns(alloc, ident)


def kill_container(pids: ContainerPids, alloc: ContainerAlloc, driver_pids: Sequence[int] = ()) -> int:
    """SIGKILL every process of the container, each only while it is still in that container
    as the pod's status names it now (never a container ID seen before: a restarted container
    has a new one); all signalled, then waited for. `driver_pids`, the processes the driver
    counted for it, go first and are found whatever the /proc scan sees. Returns how many were
    signalled; raises KillFailed (with how many were signalled) when one of `driver_pids`
    still lives in the container afterwards (its memory is not free yet), or when some process
    could not be signalled or the container's processes could not all be listed, and there is
    no driver's count to tell whether that mattered."""
    short = ""
    try:
        listed = pids.pids_of(alloc)
    except AgentOutOfResources as e:
        listed, short = [], str(e)  # its GPU processes still go; never "none left"
    targets = list(dict.fromkeys([*driver_pids, *listed]))
    try:
        killed = kill_and_wait(targets, KILL_WAIT, still_ours=lambda p: _ours(pids, alloc, p))
    except KillFailed as e:
        if not driver_pids:
            raise
        log.error("killing %s: %s", alloc.who(), e)  # judged below by its GPU processes
        killed = e.signalled
    if short:
        if not driver_pids:
            raise KillFailed(f"the processes of {alloc.who()} could not all be listed: {short}", killed)
        log.error("killing %s: its processes could not all be listed: %s", alloc.who(), short)
    left = [p for p in driver_pids if _alive_and_ours(pids, alloc, p)]
    if left:
        raise KillFailed(
            f"{len(left)} GPU process(es) of {alloc.who()} still alive after the kill: "
            + ", ".join(map(str, left[:8])),
            killed,
        )
    return killed


def _alive_and_ours(pids: ContainerPids, alloc: ContainerAlloc, pid: int) -> bool:
    """Whether `pid` has not exited (a killed process is a zombie until its parent reaps it)
    and is in the container; True when the agent cannot tell (out of files)."""
    try:
        fields = stat_fields(pid)
        return fields is not None and fields[0] not in (b"Z", b"X") and _ours(pids, alloc, pid)
    except (OSError, AgentOutOfResources):
        return True
