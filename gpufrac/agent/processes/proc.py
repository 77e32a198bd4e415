"""What /proc says of a process: its stat fields, its start time, its pid in its own namespace.

The agent's one reader of /proc/<pid>/stat and of the NSpid line of /proc/<pid>/status. A
(pid, start time) pair names one process for good: a pid is reused, the pair is not.
"""

from __future__ import annotations

# Index of starttime (field 22 of /proc/<pid>/stat) among the fields after the command name.
STARTTIME = 19


def stat_fields(pid: int, proc: str = "/proc") -> list[bytes] | None:
    """The fields of /proc/<pid>/stat after the command name (the state first), None when the
    process is gone. Raises OSError when the agent cannot read it (out of files, refused):
    that is not "gone"."""
    try:
        with open(f"{proc}/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name (field 2) may hold spaces and parentheses: fields resume after the last ')'.
    return stat[stat.rindex(b")") + 2 :].split()


def start_time(pid: int, proc: str = "/proc") -> int:
    """A process's start time (clock ticks after boot), 0 when it is gone or unreadable."""
    try:
        fields = stat_fields(pid, proc)
        return int(fields[STARTTIME]) if fields else 0
    except (OSError, ValueError, IndexError):
        return 0


def proc_identity(host_pid: int, proc: str = "/proc") -> tuple[int, int] | None:
    """(pid in its innermost pid namespace, start time in ticks) of a host pid: how the
    shim names the same process in its usage slot. None if the process is gone."""
    try:
        with open(f"{proc}/{host_pid}/status") as f:
            status = f.read()
    except OSError:
        return None
    started = start_time(host_pid, proc)
    if not started:
        return None
    ns_pid = host_pid
    for line in status.splitlines():
        if line.startswith("NSpid:"):
            parts = line.split()[1:]
            if parts:
                ns_pid = int(parts[-1])
            break
    return ns_pid, started
