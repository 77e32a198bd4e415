"""Which kubelet container holds a process whose /proc/<pid>/cgroup cannot say: a walk of cgroupfs.

The kernel writes /proc/<pid>/cgroup from each cgroup's full path in a buffer of PATH_MAX
(4 KiB). A container that may make cgroups below its own (a writable cgroupfs: privileged, or
delegated cgroup v2) can nest them past that: some kernels then refuse the whole read
(ENAMETOOLONG), others cut the path short. A cut path still names the container (the pod and
container levels the runtime made come first: gpufrac.agent.callers.parse_cgroup_path); a
refused read names nothing, yet the process may hold GPU memory that must be counted and may
have to be killed.

So the cgroup hierarchies the agent can see are walked from their roots with directory
descriptors (openat on one name at a time; never a path longer than a name), looking for the
pid in cgroup.procs in and below each kubelet container level. A process found below a
container's level is that container's: only the runtime makes the pod and container levels.

Bounded: a container level is looked for only ABOVE_CONTAINER levels deep, and a walk visits at
most MAX_DIRS directories in all (a container may make many cgroups); one descriptor is held at
a time, whatever the depth (the walk goes back up through ".."; cgroupfs renames stay within a
parent). Blocking: callers run it in a worker thread.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable, Sequence
from typing import TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

# How deep a kubelet container level may sit below a hierarchy's root (cgroupfs
# kubepods/<qos>/pod<uid>/<id>, systemd's slices: four; kubelets nested in another slice: more).
ABOVE_CONTAINER = 8
# Directories one walk may visit, across all hierarchies.
MAX_DIRS = 20000

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# The agent's own shortage: raised, never taken for "not here".
_SHORTAGE = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM})


def _passed_over(e: OSError) -> bool:
    """Whether an error of one directory leaves the rest of the walk valid (it was removed
    meanwhile, or cannot be read): anything but the agent's own shortage."""
    return e.errno not in _SHORTAGE


def _unescape(field: str) -> str:
    """A mountinfo path field: space, tab, newline and backslash are octal escapes."""
    for code, ch in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, ch)
    return field


def parse_mountinfo(text: str, prefix: str = "") -> list[str]:
    """Mount points of cgroup and cgroup2 filesystems, one per hierarchy (its device), each
    under `prefix`."""
    out: list[str] = []
    devices: set[str] = set()
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        fields = left.split(" ")
        if not sep or len(fields) < 5 or right.split(" ", 1)[0] not in ("cgroup", "cgroup2"):
            continue
        if fields[2] in devices:
            continue
        devices.add(fields[2])
        out.append(prefix + _unescape(fields[4]))
    return out


def roots(proc: str = "/proc") -> list[str]:
    """The root of every cgroup hierarchy the agent can reach: the host's, as its first
    process mounts them (reached through <proc>/1/root: an agent with the host's pids and
    ptrace rights sees the host's cgroupfs there even when its own mount shows only its own
    cgroup), else its own mounts."""
    for mountinfo, prefix in ((f"{proc}/1/mountinfo", f"{proc}/1/root"), (f"{proc}/self/mountinfo", "")):
        try:
            with open(mountinfo) as f:
                found = parse_mountinfo(f.read(), prefix)
        except OSError:
            continue
        if any(os.path.isdir(r) for r in found):
            return found
    return []


class _Budget:
    def __init__(self, dirs: int) -> None:
        self.left = dirs

    def spend(self) -> bool:
        self.left -= 1
        return self.left >= 0


def _lists(dirfd: int, pid: str) -> bool:
    """Whether cgroup.procs of the directory names `pid`."""
    try:
        fd = os.open("cgroup.procs", os.O_RDONLY | os.O_CLOEXEC, dir_fd=dirfd)
        try:
            chunks = []
            while chunk := os.read(fd, 1 << 16):
                chunks.append(chunk)
        finally:
            os.close(fd)
    except OSError as e:
        if _passed_over(e):
            return False
        raise
    return pid in b"".join(chunks).decode(errors="replace").split()


def _subdirs(dirfd: int) -> list[str]:
    try:
        with os.scandir(dirfd) as it:
            return [e.name for e in it if e.is_dir(follow_symlinks=False)]
    except OSError as e:
        if _passed_over(e):
            return []
        raise


def _search(root: str, pid: str, identify: Callable[[Sequence[str]], T | None], budget: _Budget) -> T | None:
    """Depth first below `root`: the identity of the container level above the first
    directory whose cgroup.procs lists `pid`. One descriptor at a time (down by name, back up
    through ".."): a chain thousands of levels deep costs no more descriptors than one."""
    try:
        fd = os.open(root, _DIR)
    except OSError as e:
        if _passed_over(e):
            return None
        raise
    levels: list[str] = []  # names from the root down to fd
    # Per level on the way down: the names of its subdirectories still to visit, its identity.
    stack: list[tuple[list[str], T | None]] = []
    ident: T | None = None
    try:
        while True:
            if not budget.spend():
                return None
            if ident is not None and _lists(fd, pid):
                return ident
            below = ident is not None or len(levels) < ABOVE_CONTAINER
            stack.append((_subdirs(fd) if below else [], ident))
            while True:  # the next directory: a child, or the next sibling of a level above
                names, here = stack[-1]
                if names:
                    name = names.pop()
                    try:
                        child = os.open(name, _DIR, dir_fd=fd)
                    except OSError as e:
                        if _passed_over(e):
                            continue  # removed meanwhile
                        raise
                    os.close(fd)
                    fd = child
                    levels.append(name)
                    ident = here if here is not None else identify(levels)
                    break
                stack.pop()
                if not stack:
                    return None
                try:
                    up = os.open("..", _DIR, dir_fd=fd)
                except OSError as e:
                    if _passed_over(e):
                        return None
                    raise
                os.close(fd)
                fd = up
                levels.pop()
    finally:
        os.close(fd)


def locate(
    pid: int,
    hierarchies: Sequence[str],
    identify: Callable[[Sequence[str]], T | None],
    max_dirs: int = MAX_DIRS,
) -> T | None:
    """The kubelet container (as `identify` names it from the levels below a hierarchy's root;
    None above any container) whose cgroups hold `pid` in the first hierarchy that has it;
    None when none does within the budget. Raises OSError only for the agent's own shortage
    (EMFILE, ENFILE, ENOMEM): a directory removed under the walk is passed over."""
    budget = _Budget(max_dirs)
    for root in hierarchies:
        found = _search(root, str(pid), identify, budget)
        if found is not None:
            return found
        if budget.left < 0:
            log.warning("cgroup walk for process %d stopped after %d directories", pid, max_dirs)
            break
    return None
