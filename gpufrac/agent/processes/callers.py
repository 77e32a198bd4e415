"""Who is on the other end of the arbiter socket: SO_PEERCRED -> cgroup -> pod/container.

The arbiter's socket is bind-mounted into every sharing container, so anything a
caller writes in its message (its pid, its pod) could be a lie. The only facts
used are the kernel's:

1. SO_PEERCRED: the host pid of the process that connected (the kernel fills it
   in at connect(); a container cannot choose it).
2. /proc/<pid>/cgroup: the cgroup the kubelet's container runtime placed that
   process in, which names the pod UID and the container ID in every layout the
   kubelet uses (cgroupfs and systemd drivers, cgroup v1 and v2, docker, containerd
   and CRI-O prefixes).
3. The pod's status.containerStatuses[].containerID (the apiserver, via the pod
   cache) turns the container ID into the container name; the ledger knows which
   allocation belongs to (pod UID, container name).

A process that is not in a kubelet container cgroup, or whose container the
ledger does not know, is refused.

The blocking /proc helpers built on the same identity live here too, for the
arbiter's eviction, the swap resolver and the watchdog: a container's host pids (a
/proc scan) and whether a pid is still in a container. Killing is gpufrac.agent.processes.kill.
Callers run them in worker threads.

A process whose cgroup file the kernel refuses although it lives (ENAMETOOLONG: a cgroup path
past PATH_MAX, which only a container nesting cgroups below its own on purpose makes; kernels
that cut the path instead still name the runtime's pod and container levels first) is no
one's here: CgroupUnreadable, never searched for. A search of cgroupfs is the tenant's to make
expensive (decoy cgroups, a budget it exhausts, fresh pids for each try); the arbiter refuses
such a caller, and the watchdog treats such a GPU process as hidden (gpufrac.agent.watchdog.service).
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import re
import signal
import socket
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from gpufrac.agent.booking.ledger import ContainerAlloc, Ledger

log = logging.getLogger(__name__)

_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid

# One path component each. The pod component: cgroupfs "pod<uid>" (dashes), systemd
# "kubepods[-<qos>]-pod<uid with underscores>.slice".
_UID = r"([0-9a-fA-F]{8}{s}[0-9a-fA-F]{4}{s}[0-9a-fA-F]{4}{s}[0-9a-fA-F]{4}{s}[0-9a-fA-F]{12})"
_POD_CGROUPFS = re.compile("^pod" + _UID.replace("{s}", "-") + "$")
_POD_SYSTEMD = re.compile(
    r"^kubepods(?:-(?:besteffort|burstable|guaranteed))?-pod" + _UID.replace("{s}", "_") + r"\.slice$"
)
# The container component: a bare 64-hex ID (cgroupfs), or "<runtime>-<id>.scope" (systemd).
# "crio-conmon-<id>" is CRI-O's monitor process, not the container, and does not match.
_CONTAINER = re.compile(r"^(?:(?:docker|cri-containerd|containerd|crio|cri-o)-)?([0-9a-f]{64})(?:\.scope)?$")


class PeerError(Exception):
    """The caller cannot be identified as a container this agent serves."""


class ProcessGone(PeerError):
    """The process has exited (its /proc entry is gone)."""


class CgroupUnreadable(PeerError):
    """The process lives, but the kernel refuses its cgroup file (a path past PATH_MAX): it is
    no container's as far as the agent can tell, and is never searched for."""


class AgentOutOfResources(PeerError):
    """The agent itself lacked a file descriptor or memory to look: nothing is known about the
    process (it is neither gone nor anyone's)."""


# errnos that are the agent's own shortage, never the process's state.
_SHORTAGE = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM})
# errnos of getsockopt(SO_PEERPIDFD) that mean a kernel without it (before 6.5).
_NO_PEERPIDFD = frozenset({errno.ENOPROTOOPT, errno.EINVAL, errno.EOPNOTSUPP})


@dataclass(frozen=True)
class Credentials:
    pid: int
    uid: int
    gid: int


@dataclass(frozen=True)
class CgroupIdentity:
    """A kubelet container, as its cgroup path names it."""

    pod_uid: str
    container_id: str
    path: str  # the cgroup path it was read from (for logs)


def peer_credentials(sock: socket.socket) -> Credentials:
    """The connecting process as the kernel recorded it (host pid namespace of the agent)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    if pid <= 0:
        raise PeerError("the kernel reports no peer process (SO_PEERCRED pid 0)")
    return Credentials(pid, uid, gid)


# SO_PEERPIDFD (Linux 6.5; not named by Python 3.11's socket module): a pidfd of the very
# process that connected, which no later process given the same pid can stand for.
SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)


def peer_pidfd(sock: socket.socket, pid: int) -> int | None:
    """A pidfd of the process that connected (SO_PEERPIDFD), or None on a kernel without it.
    Raises PeerError when the kernel says it exited, and when the pidfd cannot be had for
    another reason (out of files): falling back to the bare pid then would let a reused pid
    pass for the connector, so the request is refused instead."""
    try:
        return sock.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD)
    except OSError as e:
        if e.errno == errno.ESRCH:  # the kernel knows it exited
            raise PeerError(f"process {pid} that connected has exited") from None
        if e.errno in _NO_PEERPIDFD:
            return None  # a kernel before 6.5: the pid alone
        raise AgentOutOfResources(
            f"cannot pin process {pid} that connected ({e.strerror or e}): request refused"
        ) from None


def peer_cgroup(sock: socket.socket, proc: str = "/proc") -> tuple[Credentials, CgroupIdentity | None]:
    """The connecting process and its kubelet container, read now.

    SO_PEERCRED's pid is only a number: once the process that connected has exited, the
    kernel may give it to any new process (a pid_max of 32768 wraps in a second), and a
    socket kept by the tenant would then pass for that process's container. So the pid's
    cgroup counts only if the process that connected is still there after it was read
    (its pidfd): then the pid still names it. On a kernel without SO_PEERPIDFD, the pid
    alone, as before."""
    creds = peer_credentials(sock)
    pidfd = peer_pidfd(sock, creds.pid)
    try:
        ident = cgroup_of(creds.pid, proc)
        if pidfd is not None:
            try:
                signal.pidfd_send_signal(pidfd, 0)
            except ProcessLookupError:
                raise PeerError(
                    f"process {creds.pid} that connected has exited (its pid may name another process now)"
                ) from None
    finally:
        if pidfd is not None:
            os.close(pidfd)
    return creds, ident


def parse_cgroup_path(path: str) -> CgroupIdentity | None:
    """Pod UID and container ID from one cgroup path; None if it is not a kubelet container's.

    The OUTERMOST pod component wins, and the container must be the component right below
    it. Only the kubelet's runtime creates those two levels; anything below them (a nested
    cgroup a container with a writable cgroupfs made itself, even one named after another
    pod) is still that container's. The kubelet's hierarchy may sit below another one
    (kind's kubelet.slice): components above the first pod component are not looked at."""
    parts = [p for p in path.split("/") if p]
    for i in range(len(parts) - 1):
        m = _POD_CGROUPFS.match(parts[i]) or _POD_SYSTEMD.match(parts[i])
        if m is None:
            continue
        c = _CONTAINER.match(parts[i + 1])
        if c is None:
            return None
        return CgroupIdentity(m.group(1).replace("_", "-").lower(), c.group(1), path)
    return None


@functools.lru_cache(maxsize=4096)
def parse_cgroup(text: str) -> CgroupIdentity | None:
    """The kubelet container in a /proc/<pid>/cgroup file (v1 "id:controllers:path" lines
    and the v2 "0::path" line). All lines that name a container must agree; a process
    whose hierarchies disagree is not trusted.

    Cached by the file's text (a pure function of it): every process of a container has
    the same text, and the arbiter parses it on each request. Only the parse is cached;
    the file is read afresh each time, so a pid reused by another process is not
    mistaken for the old one."""
    found: set[tuple[str, str]] = set()
    first: CgroupIdentity | None = None
    for line in text.splitlines():
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        if "kubepods" not in fields[2]:
            continue  # cheap skip: every kubelet layout has it (this runs per request)
        ident = parse_cgroup_path(fields[2])
        if ident is not None:
            found.add((ident.pod_uid, ident.container_id))
            first = first or ident
    if len(found) > 1:
        raise PeerError(f"cgroup hierarchies name different containers: {sorted(found)}")
    return first


def read_cgroup(pid: int, proc: str = "/proc") -> CgroupIdentity | None:
    """The kubelet container /proc/<pid>/cgroup names (None: none). Raises ProcessGone when
    the process has exited, AgentOutOfResources when the agent lacks a descriptor to look, and
    CgroupUnreadable when the file exists but cannot be read: some kernels refuse it
    (ENAMETOOLONG) once a cgroup path passes PATH_MAX. `cgroup_of` tells then whether the
    process lives."""
    try:
        # os.open/os.read: this runs per arbiter request, and a text-mode file object
        # costs several times the read itself.
        fd = os.open(f"{proc}/{pid}/cgroup", os.O_RDONLY | os.O_CLOEXEC)
        try:
            text = os.read(fd, 64 * 1024).decode(errors="replace")
        finally:
            os.close(fd)
    except (FileNotFoundError, ProcessLookupError):
        raise ProcessGone(f"process {pid} is gone") from None
    except OSError as e:
        if e.errno in _SHORTAGE:
            raise AgentOutOfResources(f"cannot read /proc/{pid}/cgroup: {e.strerror}") from None
        raise CgroupUnreadable(f"cannot read /proc/{pid}/cgroup: {e.strerror}") from None
    return parse_cgroup(text)


def cgroup_of(pid: int, proc: str = "/proc") -> CgroupIdentity | None:
    """The kubelet container a process is in, read from /proc/<pid>/cgroup (None: in none).
    Raises ProcessGone, AgentOutOfResources, or CgroupUnreadable when the process lives but
    the kernel refuses its cgroup file: it is then no container's, and not searched for (the
    module's doc says why). Blocking: two file operations at most."""
    try:
        return read_cgroup(pid, proc)
    except CgroupUnreadable as e:
        refused = str(e)
    # Gone, or alive with its file refused? A stat, which takes no descriptor: a shortage of
    # files must not make a live process look gone.
    try:
        os.stat(f"{proc}/{pid}/stat")
    except (FileNotFoundError, ProcessLookupError):
        raise ProcessGone(f"process {pid} is gone") from None
    except OSError as e:
        if e.errno in _SHORTAGE:
            raise AgentOutOfResources(f"cannot look at process {pid}: {e.strerror}") from None
        raise CgroupUnreadable(f"{refused}; nor can /proc/{pid} be looked at ({e.strerror})") from None
    raise CgroupUnreadable(
        f"{refused}, although process {pid} lives (a cgroup path past PATH_MAX: cgroups nested "
        "below its container); it is no container's"
    )


def placement(pid: int, proc: str = "/proc") -> CgroupIdentity | bool | None:
    """`cgroup_of` for callers that only sort its answers: the container, None for a process
    in none (the host's), True when it lives with its cgroup file refused (hidden), False
    when it is gone or its hierarchies disagree. Raises AgentOutOfResources."""
    try:
        return cgroup_of(pid, proc)
    except CgroupUnreadable:
        return True
    except AgentOutOfResources:
        raise
    except PeerError:
        return False


def cgroup_refused(pid: int, proc: str = "/proc") -> bool:
    """Whether `pid` lives with its cgroup file refused by the kernel (what the watchdog kills
    as hidden). False when it is gone or its cgroup reads; raises AgentOutOfResources."""
    return placement(pid, proc) is True


def scan_pids(match: Callable[[CgroupIdentity], bool], proc: str = "/proc") -> list[int]:
    """Host pids of every process whose kubelet container `match` accepts (blocking: a scan
    of /proc, one cgroup file per process). A process whose cgroup file the kernel refuses is
    simply not listed: it is no container's, and not searched for (the watchdog deals with
    it). Raises AgentOutOfResources when the agent could not look at some process (or at
    /proc) for want of files or memory: a caller must never take "not listed" for "gone"."""
    try:
        names = os.listdir(proc)
    except OSError as e:
        if e.errno in _SHORTAGE:
            raise AgentOutOfResources(f"cannot list {proc}: {e.strerror}") from None
        raise
    out = []
    for name in names:
        if not name.isdigit():
            continue
        try:
            ident = cgroup_of(int(name), proc)
        except AgentOutOfResources:
            raise
        except PeerError:
            continue  # gone, refused, or its hierarchies disagree: not one of the container's
        if ident is not None and match(ident):
            out.append(int(name))
    return out


def in_container(pid: int, ident: CgroupIdentity, proc: str = "/proc") -> bool:
    """Whether `pid` is (still) a process of the container `ident` names (its cgroup now).
    Raises AgentOutOfResources when the agent cannot look (a killer must not take that for
    "not ours")."""
    try:
        now = cgroup_of(pid, proc)
    except AgentOutOfResources:
        raise
    except PeerError:  # gone, its cgroup refused, its hierarchies disagree: not that container's
        return False
    return now is not None and (now.pod_uid, now.container_id) == (ident.pod_uid, ident.container_id)


# Looks up a container's name from (pod UID, container ID); None when unknown.
ContainerNamer = Callable[[str, str], "str | None"]


class PodRecord(Protocol):
    """A pod as the pod cache keeps it (gpufrac.agent.kube.PodInfo)."""

    @property
    def container_ids(self) -> Mapping[str, str]: ...  # container ID -> container name


class PodIndex(Protocol):
    """The agent's pod cache (gpufrac.agent.kube.PodCache)."""

    def by_uid(self, uid: str) -> PodRecord | None: ...


def namer_from_pods(pods: PodIndex | None) -> ContainerNamer:
    """A ContainerNamer over the agent's pod cache, whose container IDs come from the pod's
    status.containerStatuses."""

    def name(pod_uid: str, container_id: str) -> str | None:
        pod = pods.by_uid(pod_uid) if pods is not None else None
        return pod.container_ids.get(container_id) if pod is not None else None

    return name


@dataclass(frozen=True)
class Caller:
    creds: Credentials
    cgroup: CgroupIdentity
    alloc: ContainerAlloc


@dataclass(frozen=True)
class ContainerOwner:
    """A kubelet container of a pod gpufrac serves, with every gpufrac allocation it holds:
    one as a rule, two when it asked for both resources (the kubelet allocates each), none
    for another container of such a pod (a sidecar that sees the GPUs without asking). The
    watchdog and the driver's count judge it by GPU (gpufrac.agent.watchdog.service.plan,
    gpufrac.agent.gpu.truth.attribute): on a GPU none of its allocations holds, its limit is 0."""

    pod_uid: str
    container: str  # its name in the pod
    allocs: tuple[ContainerAlloc, ...]
    namespace: str | None = None
    pod: str | None = None

    @property
    def key(self) -> str:
        """Its allocation's ledger key when it has exactly one (what the arbiter looks up);
        else one of its own, which no allocation has."""
        if len(self.allocs) == 1:
            return self.allocs[0].key
        return f"{self.pod_uid}/{self.container}"

    def holding(self, gpu: str) -> tuple[ContainerAlloc, ...]:
        """Its allocations on `gpu`."""
        return tuple(a for a in self.allocs if gpu in a.gpus)

    def who(self) -> str:
        if self.pod:
            return f"pod {self.namespace}/{self.pod} container {self.container}"
        return f"pod {self.pod_uid} container {self.container}"


class PeerLookup:
    """Identifies callers against the ledger. Runs on the agent's loop (one small
    /proc read per connection)."""

    def __init__(self, ledger: Ledger, namer: ContainerNamer, proc: str = "/proc") -> None:
        self.ledger = ledger
        self.namer = namer
        self.proc = proc

    def identify(self, sock: socket.socket) -> Caller:
        creds, ident = peer_cgroup(sock, self.proc)
        if ident is None:
            raise PeerError(f"process {creds.pid} is not in a kubelet container cgroup")
        alloc = self.allocation(ident.pod_uid, ident.container_id)
        return Caller(creds, ident, alloc)

    def allocation(self, pod_uid: str, container_id: str) -> ContainerAlloc:
        """The one allocation a caller's burst is for (the shim serves one config)."""
        name = self.namer(pod_uid, container_id)
        if name is None:
            raise PeerError(f"container {container_id[:12]} of pod {pod_uid} is not in the pod's status")
        mine = _pick([a for a in self.ledger.containers() if a.held_by(pod_uid, name)])
        if mine is None:
            raise PeerError(f"pod {pod_uid} container {name} holds no gpufrac allocation on this node")
        return mine

    def owner(self, pod_uid: str, container_id: str) -> ContainerOwner | None:
        """The container the pod's status names, with all its allocations (none for another
        container of a pod that holds some); None when the pod holds no allocation here or
        its status does not name the container (yet). Runs on the loop (the ledger's owner)."""
        name = self.namer(pod_uid, container_id)
        if name is None:
            return None
        pods = [a for a in self.ledger.containers() if a.pod_uid == pod_uid or _serves_pod(a, pod_uid)]
        if not pods:
            return None
        mine = tuple(sorted((a for a in pods if a.held_by(pod_uid, name)), key=lambda a: a.key))
        return ContainerOwner(pod_uid, name, mine, pods[0].namespace, pods[0].pod)

    def owns(self, alloc: ContainerAlloc, ident: CgroupIdentity) -> bool:
        """Whether a process in the kubelet container `ident` names is the container of
        `alloc` NOW: its pod, and a container ID the pod's status gives that container's name
        (a restarted container has a new ID; an ID seen before is not trusted for it)."""
        if alloc.claim is not None:
            name = self.namer(ident.pod_uid, ident.container_id)
            return name is not None and alloc.held_by(ident.pod_uid, name)
        return (
            bool(alloc.pod_uid and alloc.container)
            and ident.pod_uid == alloc.pod_uid
            and self.namer(ident.pod_uid, ident.container_id) == alloc.container
        )

    def pids_of(self, alloc: ContainerAlloc) -> list[int]:
        """Host pids of a container (blocking; run in a thread): every process whose cgroup
        names its pod and a container ID the pod's status now gives its name. Never from a
        container ID seen before: a restarted container has a new one, and a released key
        may be booked again by another pod. Raises AgentOutOfResources when some process could
        not be looked at (scan_pids)."""
        if not (alloc.pod_uid and alloc.container) and not alloc.consumers:
            return []
        return scan_pids(lambda c: self.owns(alloc, c), self.proc)


def _serves_pod(alloc: ContainerAlloc, pod_uid: str) -> bool:
    """Whether a claim's booking serves a container of the pod."""
    return any(uid == pod_uid for uid, _ in alloc.consumers)


def _pick(allocs: list[ContainerAlloc]) -> ContainerAlloc | None:
    if len(allocs) > 1:
        # The shim serves one config; with two, which one a burst is for is unknowable.
        keys = ", ".join(a.key for a in allocs)
        raise PeerError(f"the container holds several gpufrac allocations ({keys}); bursts need exactly one")
    return allocs[0] if allocs else None
