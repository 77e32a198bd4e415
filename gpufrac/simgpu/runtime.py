"""A container-runtime emulator for tests and the demo: "containers" are real processes
in real cgroups, named as the kubelet's container runtime names them.

What the agent relies on is exactly what a real runtime gives it: a process whose
/proc/<pid>/cgroup names its pod UID and container ID, and a filesystem view in
which the device plugin's mounts (config, usage, the arbiter socket, the shim)
sit at their container paths. The view holds each file mount as a hard link (pinning
its inode, as a bind mount of a file does) and each directory mount as a symlink
(link_mounts); envs that point into a mount are rewritten to the view, so
$GPUFRAC_CONTAINER_DIR/arbiter/arbiter.sock reaches the agent's socket and LD_PRELOAD the
shim. The process writes its own pid into cgroup.procs before it execs the
workload, so it is in the container's cgroup before it makes any CUDA call.

Needs a writable cgroup v1 hierarchy (root; default /sys/fs/cgroup/pids) or a
writable cgroup v2 mount. Without one it raises RuntimeUnavailable, never falls
back to a process outside a cgroup (identity would silently not be tested).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpufrac.memguard.build import CONTAINER_DIR_ENV
from gpufrac.simgpu.workload import WorkloadProcess

DEFAULT_HIERARCHY = "/sys/fs/cgroup/pids"
QOS_CLASSES = ("besteffort", "burstable", "guaranteed")
# Writes its own pid into the cgroup, then becomes the workload: in the cgroup before exec.
_ENTER = 'echo $$ > "$GPUFRAC_RUNTIME_CGROUP_PROCS" && exec "$@"'
# A pod's own pid namespace (and mount namespace, for a /proc of its own), entered after the
# cgroup: its first process is pid 1 there and sees only the pod's processes in /proc, as in
# a pod. The host's procfs stays reachable at $SIMGPU_HOST_PROC for the simulated driver alone,
# which names processes by their host pids as the real one (in the kernel) does.
_PIDNS = ["unshare", "--pid", "--fork", "--mount", "--propagation", "private", "--", "/bin/sh", "-c"]
_IN_PIDNS = (
    'mkdir -p "$SIMGPU_HOST_PROC" && mount --bind /proc "$SIMGPU_HOST_PROC" && '
    'mount -t proc proc /proc && exec "$@"'
)


class RuntimeUnavailable(RuntimeError):
    """No cgroup hierarchy this process may create cgroups in."""


@dataclass(frozen=True)
class MountSpec:
    container_path: str
    host_path: str
    read_only: bool = False


def cgroup_relpath(pod_uid: str, container_id: str, qos: str, driver: str) -> str:
    """The kubelet's cgroup for a container: cgroupfs or systemd driver naming."""
    if qos not in QOS_CLASSES:
        raise ValueError(f"qos {qos!r} is not one of {QOS_CLASSES}")
    if driver == "cgroupfs":
        parts = ["kubepods"] + ([] if qos == "guaranteed" else [qos]) + [f"pod{pod_uid}", container_id]
        return "/".join(parts)
    if driver == "systemd":
        slice_ = "kubepods" if qos == "guaranteed" else f"kubepods-{qos}"
        parts = ["kubepods.slice"] + ([] if qos == "guaranteed" else [f"{slice_}.slice"])
        parts += [f"{slice_}-pod{pod_uid.replace('-', '_')}.slice", f"cri-containerd-{container_id}.scope"]
        return "/".join(parts)
    raise ValueError(f"cgroup driver {driver!r} is not cgroupfs or systemd")


def mounts_of(response: Any) -> list[MountSpec]:
    """MountSpecs of a v1beta1 ContainerAllocateResponse (or an iterable of them)."""
    items: Iterable[Any] = response.mounts if hasattr(response, "mounts") else response
    return [MountSpec(m.container_path, m.host_path, bool(m.read_only)) for m in items]


@dataclass
class Container:
    """A running container: its process and where it lives."""

    pod_uid: str
    name: str
    container_id: str
    cgroup_dir: Path
    view: Path
    env: dict[str, str]
    proc: subprocess.Popen[bytes]
    _runtime: ContainerRuntime = field(repr=False)

    @property
    def runtime_id(self) -> str:
        """As status.containerStatuses[].containerID shows it."""
        return f"containerd://{self.container_id}"

    def pids(self) -> list[int]:
        """Host pids now in the container's cgroup (the main process and its children)."""
        try:
            text = (self.cgroup_dir / "cgroup.procs").read_text()
        except FileNotFoundError:
            return []
        return [int(p) for p in text.split()]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(sig)

    def wait(self, timeout: float | None = None) -> int:
        return self.proc.wait(timeout)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL, then remove the cgroup."""
        if self.alive():
            self.kill(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill(signal.SIGKILL)
                self.proc.wait(timeout)
        self._runtime._cleanup(self)


class ContainerRuntime:
    """Starts containers as cgroup-confined subprocesses; `close()` removes every cgroup
    and view it made (use as a context manager)."""

    def __init__(
        self,
        hierarchy: str | os.PathLike[str] = DEFAULT_HIERARCHY,
        *,
        driver: str = "cgroupfs",
        view_root: str | os.PathLike[str] | None = None,
    ) -> None:
        self.hierarchy = Path(hierarchy)
        self.driver = driver
        cgroup_relpath("0" * 8 + "-0000-0000-0000-" + "0" * 12, "0" * 64, "besteffort", driver)  # validate
        probe = self.hierarchy / f"gpufrac-runtime-probe-{os.getpid()}"
        try:
            probe.mkdir()
            probe.rmdir()
        except OSError as e:
            raise RuntimeUnavailable(
                f"cannot create cgroups under {self.hierarchy} ({e.strerror}): the runtime emulator needs a "
                "writable cgroup hierarchy (run as root; cgroup v1 pids or a writable cgroup v2 mount)"
            ) from None
        # Short: unix socket paths in the view must stay under 108 bytes.
        self.view_root = Path(view_root or tempfile.mkdtemp(prefix="gfrt", dir="/tmp"))
        self._own_view_root = view_root is None
        self.containers: list[Container] = []

    def __enter__(self) -> ContainerRuntime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(
        self,
        pod_uid: str,
        name: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        envs: Mapping[str, str] | None = None,
        mounts: Sequence[MountSpec] = (),
        qos: str = "besteffort",
        container_id: str | None = None,
        stdin: Any = None,
        stdout: Any = None,
        stderr: Any = None,
        pid_namespace: bool = False,
    ) -> Container:
        """Start `argv` as container `name` of pod `pod_uid`.

        `env` is the base environment (default: this process's); `envs` and `mounts` are
        what the device plugin's ContainerAllocateResponse asked for (see mounts_of).
        `pid_namespace`: the container's processes get a pid namespace and a /proc of their
        own, as every ordinary pod's do (root only: unshare and mount)."""
        cid = container_id or secrets.token_hex(32)
        cgroup = self.hierarchy / cgroup_relpath(pod_uid, cid, qos, self.driver)
        try:
            cgroup.mkdir(parents=True)
        except OSError as e:
            raise RuntimeUnavailable(f"cannot create cgroup {cgroup}: {e.strerror}") from None
        view = self.view_root / cid[:12]
        try:
            view.mkdir(parents=True)
            link_mounts(view, mounts)
            full = dict(os.environ if env is None else env)
            full.update(translate_envs(envs or {}, mounts, view))
            full["GPUFRAC_RUNTIME_CGROUP_PROCS"] = str(cgroup / "cgroup.procs")
            if pid_namespace:
                full["SIMGPU_HOST_PROC"] = str(view / ".simgpu-host-proc")
                argv = [*_PIDNS, _IN_PIDNS, "sh", *argv]
            proc = subprocess.Popen(
                ["/bin/sh", "-c", _ENTER, "sh", *argv], env=full, stdin=stdin, stdout=stdout, stderr=stderr
            )
        except BaseException:
            shutil.rmtree(view, ignore_errors=True)
            _remove_cgroup(cgroup, self.hierarchy)
            raise
        c = Container(pod_uid, name, cid, cgroup, view, full, proc, self)
        self.containers.append(c)
        return c

    def wait_entered(self, c: Container, timeout: float = 30.0) -> None:
        """Until the container's process has put itself in its cgroup (or exited)."""
        deadline = time.monotonic() + timeout
        while c.proc.pid not in c.pids():
            if c.proc.poll() is not None:
                raise RuntimeError(f"container {c.name} exited with {c.proc.returncode} before entering")
            if time.monotonic() > deadline:
                raise TimeoutError(f"container {c.name} never entered cgroup {c.cgroup_dir}")
            time.sleep(0.005)

    def _cleanup(self, c: Container) -> None:
        shutil.rmtree(c.view, ignore_errors=True)
        # A cgroup can be removed once its last process has exited.
        deadline = time.monotonic() + 10.0
        while c.pids() and time.monotonic() < deadline:
            c.kill(signal.SIGKILL)
            time.sleep(0.01)
        _remove_cgroup(c.cgroup_dir, self.hierarchy)
        if c in self.containers:
            self.containers.remove(c)

    def close(self) -> None:
        for c in list(self.containers):
            c.stop(timeout=5.0)
        if self._own_view_root:
            shutil.rmtree(self.view_root, ignore_errors=True)


def link_mounts(view: Path, mounts: Sequence[MountSpec]) -> None:
    """A container's filesystem view: each mount at <view>/<container path>, as a container
    runtime's bind mount behaves (replacing one already there, so a view can be rebuilt,
    which is what starting the container again does).

    A bind mount of a FILE pins the inode it was made with: a host path later replaced (a
    rename onto it, a socket unlinked and bound again) is not seen inside. A hard link pins
    the inode the same way, so a file mount is one. A hard link cannot cross filesystems
    (nor reach a file this process may not link): such a mount stays a symlink, which
    follows the path and so hides a replaced file; docs/simgpu.md says so. A bind mount of a
    DIRECTORY shows later changes to its entries, as a symlink to it does. A host path that
    does not exist yet gets a symlink too (a real runtime would fail or make a directory)."""
    for m in mounts:
        link = view / m.container_path.lstrip("/")
        link.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            link.unlink()
        if _pins_inode(m.host_path, link):
            continue
        link.symlink_to(m.host_path)


def _pins_inode(host_path: str, link: Path) -> bool:
    """Hard-link a file mount into the view; False where the mount must be a symlink."""
    try:
        if os.path.isdir(host_path):
            return False
        os.link(host_path, link)  # follows a symlinked host path, as a bind mount does
    except OSError:  # missing, another filesystem (EXDEV), not linkable by us (EPERM)
        return False
    return True


def translate_envs(envs: Mapping[str, str], mounts: Sequence[MountSpec], view: Path) -> dict[str, str]:
    """Envs that name a mount's container path (or a directory holding one) point into the view."""
    out = {}
    for k, v in envs.items():
        inside = v.startswith("/") and any(
            m.container_path == v or m.container_path.startswith(v.rstrip("/") + "/") for m in mounts
        )
        out[k] = str(view / v.lstrip("/")) if inside else v
    return out


def _remove_cgroup(cgroup: Path, hierarchy: Path) -> None:
    """rmdir the container's cgroup and every parent it leaves empty (up to the hierarchy)."""
    cur = cgroup
    while cur != hierarchy and hierarchy in cur.parents:
        try:
            cur.rmdir()
        except FileNotFoundError:
            pass
        except OSError:
            return  # not empty: another pod or container still lives there
        cur = cur.parent


# -- a stand-in workload that speaks the shim's protocol -----------------------------------------


def _start_time(pid: int) -> int:
    """/proc/<pid>/stat's starttime (field 22, the 20th after the comm's closing parenthesis)."""
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    return int(stat[stat.rfind(")") + 2 :].split()[19])


class WorkloadDriver(WorkloadProcess):
    """Drives a container running `workload()` (started with stdin and stdout pipes)."""

    def __init__(self, container: Container, name: str = "") -> None:
        self.container = container
        super().__init__(container.proc, name or container.name)


def workload(stdin: Any = None, stdout: Any = None) -> int:
    """`python -m gpufrac.simgpu.runtime`: a container process that does what the shim does
    with its usage file and the arbiter socket, driven by lines on stdin:

        alloc N   count N bytes (fast path within request + grant, else a burst request)
        free N    uncount N bytes and give unused grant back (release op)
        burst N T a bare burst request (bytes N, total_after T); the usage stays
        touch     record a kernel launch now (last_activity_ns)
        exit      answer "bye" and exit (WorkloadProcess.close)
        t CMD     CMD, answering "<status> <start_ns> <end_ns>" around its request

    Each command answers one line: its status (fast, granted, denied, refused, invalid,
    none = no answer). Used where the fake libcuda under the real shim is not needed."""
    import sys

    from gpufrac.memguard import abi, wire

    stdin = stdin or sys.stdin
    stdout = stdout or sys.stdout
    cdir = os.environ.get(CONTAINER_DIR_ENV, abi.DEFAULT_DIR)
    usage = abi.UsageFile(cdir)
    slot = next(s for s in usage.usage.slots if s.pid == 0)
    slot.start_time = _start_time(os.getpid())  # as the shim names a process: pid and start time
    slot.pid = os.getpid()
    span = [0, 0]  # CLOCK_MONOTONIC ns around the last request (the bench reads it)

    def ask(op: int, nbytes: int, total_after: int) -> str:
        cfg = abi.read_config(cdir)
        timeout = (cfg.arbiter_timeout_ms + cfg.wait_timeout_ms) / 1000.0 + 1.0
        span[0] = time.monotonic_ns()
        rep = wire.request(wire.socket_path(cdir), op, nbytes, total_after, timeout=timeout)
        span[1] = time.monotonic_ns()
        return "none" if rep is None else wire.STATUS_NAMES.get(rep.status, f"status{rep.status}")

    def count(n: int) -> None:
        usage.usage.total_used = max(0, int(usage.usage.total_used) + n)
        slot.used_bytes = max(0, int(slot.used_bytes) + n)

    print("ready", flush=True, file=stdout)
    for line in stdin:
        cmd, *args = line.split()
        timed = cmd == "t"  # "t <command>": also print the request's start and end (monotonic ns)
        if timed:
            cmd, *args = args
            span[:] = [0, 0]
        if cmd == "alloc":
            n = int(args[0])
            cfg = abi.read_config(cdir)
            want = int(usage.usage.total_used) + n
            if want <= cfg.request_bytes + cfg.grant_bytes:
                status = "fast"
            elif want > cfg.limit_bytes:
                status = "denied"
            else:
                status = ask(wire.BURST_OP_BURST, n, want)
                cfg = abi.read_config(cdir)
                if status == "granted" and want > cfg.request_bytes + cfg.grant_bytes:
                    status = "short"  # granted but the config does not carry it: a bug
            if status in ("fast", "granted"):
                count(n)
        elif cmd == "free":
            count(-int(args[0]))
            status = ask(wire.BURST_OP_RELEASE, int(args[0]), 0)
        elif cmd == "burst":
            status = ask(wire.BURST_OP_BURST, int(args[0]), int(args[1]))
        elif cmd == "touch":
            slot.last_activity_ns = time.monotonic_ns()
            status = "ok"
        elif cmd == "exit":
            print("bye", flush=True, file=stdout)
            return 0
        else:
            status = f"unknown command {cmd}"
        print(f"{status} {span[0]} {span[1]}" if timed else status, flush=True, file=stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(workload())
