"""The node at a glance: one model of the agent's state, read-only, for humans and tools.

`capture(agent)` copies what the agent knows (ledger, inventory, health, kubelet
registration) into plain dataclasses; it runs on the agent's loop and does no
I/O. `enrich(status)` then adds what must be read from outside (NVML memory and
utilisation, each container's usage file) in whichever thread calls it, never
on the loop. Both the Prometheus collector (gpufrac.agent.metrics) and the local
status endpoint serve this one model.

The endpoint is a unix socket (config statusSocket) speaking just enough HTTP/1.0
for `gpufrac status` and `curl --unix-socket`: GET / returns the status as JSON.
It has no write operation of any kind.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import logging
import os
import socket
import stat
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import gpufrac
from gpufrac.agent.output import render, table
from gpufrac.agent.report import mig_to_dict
from gpufrac.agent.units import format_bytes
from gpufrac.deviceplugin import slices
from gpufrac.memguard import formats

log = logging.getLogger(__name__)

# Request heads bigger than this are refused with 431 (a status query is one line): the
# stream reader's limit, so a client cannot make the agent buffer more.
MAX_REQUEST = 8192
REQUEST_TIMEOUT = 5.0
# How long a reader in another thread waits for the loop to take a snapshot.
CAPTURE_TIMEOUT = 10.0


@dataclass
class GpuStatus:
    index: int
    uuid: str
    model: str
    pci_bus_id: str
    numa_node: int | None
    memory_total_bytes: int
    memory_allocatable_bytes: int
    memory_requested_bytes: int
    memory_burst_granted_bytes: int
    healthy: bool
    health_reason: str = ""
    # resource -> {"total", "allocated", "free"}: free = unallocated slices the kubelet may still admit
    slices: dict[str, dict[str, int]] = field(default_factory=dict)
    nvlinks: dict[str, int] = field(default_factory=dict)  # peer UUID -> active NVLink links
    xid_errors: dict[int, int] = field(default_factory=dict)  # XID -> count since agent start
    # From NVML (enrich); None when the GPU did not answer.
    memory_used_bytes: int | None = None
    utilization_ratio: float | None = None


@dataclass
class ContainerStatus:
    key: str
    resource: str
    namespace: str
    pod: str
    container: str
    gpus: list[str]
    slices: int
    whole_gpu: bool
    request_bytes: int  # per GPU
    limit_bytes: int
    burst_granted_bytes: int
    workload_class: str
    priority: int
    created: float  # wall clock
    directory: str
    # From the container's usage file (enrich); None when it could not be read.
    used_bytes: int | None = None
    processes: int = 0
    idle_seconds: float | None = None
    oom_refusals: int = 0
    swapped_bytes: int = 0

    @property
    def known(self) -> bool:
        return bool(self.pod)


@dataclass
class NodeStatus:
    node: str
    version: str
    time: float
    ready: bool
    ready_reason: str
    registered: dict[str, bool]
    registrations: dict[str, int]
    driver_version: str = ""
    gpus: list[GpuStatus] = field(default_factory=list)
    containers: list[ContainerStatus] = field(default_factory=list)
    unreachable: dict[int, str] = field(default_factory=dict)
    # GPUs in MIG mode, left to the MIG-aware plugin (gpufrac.agent.report.mig_to_dict).
    mig: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# -- capture (on the agent's loop) --------------------------------------------------------


def readiness(agent: Any) -> tuple[bool, str]:
    """Ready = inventory read and both resources registered with the kubelet."""
    if agent.inventory is None or agent.ledger is None:
        return False, "reading the GPU inventory"
    if not agent.started.is_set():
        return False, "starting"
    missing = [r for r in slices.RESOURCES if not _registered(agent, r)]
    if missing:
        return False, "not registered with the kubelet: " + ", ".join(missing)
    return True, "ok"


def _registered(agent: Any, resource: str) -> bool:
    server = agent.servers.get(resource)
    return server is not None and server.registered.is_set()


def capture(agent: Any) -> NodeStatus:
    """A copy of the agent's state. Call on the agent's loop (the ledger's owner)."""
    ready, why = readiness(agent)
    status = NodeStatus(
        node=agent.config.node_name,
        version=gpufrac.__version__,
        time=time.time(),
        ready=ready,
        ready_reason=why,
        registered={r: _registered(agent, r) for r in slices.RESOURCES},
        registrations={
            r: (agent.servers[r].registrations if r in agent.servers else 0) for r in slices.RESOURCES
        },
    )
    inv, ledger = agent.inventory, agent.ledger
    if inv is None or ledger is None:
        return status
    status.driver_version = inv.driver_version
    status.unreachable = dict(inv.unreachable)
    status.mig = [mig_to_dict(g) for g in inv.mig]
    health = agent.health.current() if agent.health is not None else {}
    xids: Mapping[tuple[str, int], int] = agent.health.xid_counts() if agent.health is not None else {}
    allocs = ledger.containers()
    granted: dict[str, int] = {}
    for a in allocs:
        for u in a.gpus:
            granted[u] = granted.get(u, 0) + a.config.grant_bytes
    per_resource = {r: ledger.devices(r) for r in slices.RESOURCES}
    for g in inv.gpus:
        geo = ledger.geometry[g.uuid]
        prefix = g.uuid + "::"
        counts: dict[str, dict[str, int]] = {}
        for r, devices in per_resource.items():
            mine = [(d, ok) for d, ok, _ in devices if d.startswith(prefix)]
            allocated = sum(1 for d, _ in mine if ledger.owner(d) is not None)
            free = sum(1 for d, ok in mine if ok and ledger.owner(d) is None)
            counts[r] = {"total": geo.slices(r), "allocated": allocated, "free": free}
        h = health.get(g.uuid)
        status.gpus.append(
            GpuStatus(
                index=g.index,
                uuid=g.uuid,
                model=g.model,
                pci_bus_id=g.pci_bus_id,
                numa_node=g.numa_node,
                memory_total_bytes=g.memory_total,
                memory_allocatable_bytes=geo.allocatable,
                memory_requested_bytes=ledger.requested(g.uuid),
                memory_burst_granted_bytes=granted.get(g.uuid, 0),
                healthy=ledger.healthy(g.uuid),
                health_reason="" if h is None or h.healthy else h.reason,
                slices=counts,
                nvlinks={
                    p.uuid: inv.link(g.index, p.index).nvlinks
                    for p in inv.gpus
                    if p.index != g.index and (g.index, p.index) in inv.links
                },
                xid_errors={x: n for (u, x), n in xids.items() if u == g.uuid},
            )
        )
    activity = getattr(agent, "activity", None)  # gpufrac.agent.activity: launches + NVML, on the loop
    for a in allocs:
        c = a.config
        status.containers.append(
            ContainerStatus(
                key=a.key,
                resource=a.resource,
                namespace=a.namespace or "",
                pod=a.pod or "",
                container=a.container or "",
                gpus=list(a.gpus),
                slices=a.slice_count,
                whole_gpu=a.whole_gpu,
                request_bytes=a.request_bytes,
                limit_bytes=c.limit_bytes,
                burst_granted_bytes=c.grant_bytes,
                workload_class=formats.CLASS_BY_NUMBER.get(c.workload_class, str(c.workload_class)),
                priority=c.priority,
                created=a.created,
                directory=a.directory,
                idle_seconds=activity.idle_seconds(a.key) if activity is not None else None,
            )
        )
    return status


def capture_threadsafe(
    agent: Any, loop: asyncio.AbstractEventLoop, timeout: float = CAPTURE_TIMEOUT
) -> NodeStatus:
    """capture() run on the agent's loop, waited for from another thread (the metrics server)."""

    async def run() -> NodeStatus:
        return capture(agent)

    return asyncio.run_coroutine_threadsafe(run(), loop).result(timeout)


# -- enrich (blocking reads, off the loop) -------------------------------------------------


def read_gpu_live(uuids: Iterable[str]) -> dict[str, tuple[int | None, float | None]]:
    """uuid -> (memory used bytes, utilisation 0..1) from NVML; (None, None) where it fails."""
    import pynvml

    from gpufrac.agent.inventory import NvmlError, query_gpus

    def live(h: Any) -> tuple[int, float]:
        used = int(pynvml.nvmlDeviceGetMemoryInfo(h).used)
        return used, pynvml.nvmlDeviceGetUtilizationRates(h).gpu / 100.0

    wanted = set(uuids)
    out: dict[str, tuple[int | None, float | None]] = dict.fromkeys(wanted, (None, None))
    try:
        # Debug level: every scrape asks, and a GPU without utilisation (MIG) would fill the log.
        for _, uuid, figures in query_gpus("live figures", live, logging.DEBUG):
            if uuid in wanted:
                out[uuid] = figures
    except NvmlError as e:
        log.warning("NVML unavailable for live GPU figures: %s", e)
    return out


@dataclass
class UsageView:
    """What a container's usage file says, in the units the views want."""

    used_bytes: int
    processes: int
    idle_seconds: float
    oom_refusals: int
    swapped_bytes: int
    # (pid, start_time) -> oom_refusals of each live slot (metrics keeps refusals monotonic)
    slot_refusals: dict[tuple[int, int], int]


def idle_seconds(usage: formats.UsageStruct, since_wall: float, now_mono_ns: int | None = None) -> float:
    """Seconds since the container's last GPU work (a kernel launch by any of its processes);
    since `since_wall` (its allocation) when none of its live processes has launched yet.
    The shim stamps launches with CLOCK_MONOTONIC, the clock of time.monotonic_ns()."""
    now = time.monotonic_ns() if now_mono_ns is None else now_mono_ns
    last = max((int(s.last_activity_ns) for s in usage.slots if s.pid > 0), default=0)
    if last:
        return max(0.0, (now - last) / 1e9)
    return max(0.0, time.time() - since_wall)


def read_usage_view(directory: str, since_wall: float) -> UsageView | None:
    try:
        u = formats.read_usage(directory)
    except formats.FormatError:
        return None
    live = [s for s in u.slots if s.pid > 0]
    return UsageView(
        used_bytes=int(u.total_used),
        processes=len(live),
        idle_seconds=idle_seconds(u, since_wall),
        oom_refusals=sum(int(s.oom_refusals) for s in live),
        swapped_bytes=sum(int(s.used_bytes) for s in live if s.swapped),
        slot_refusals={(int(s.pid), int(s.start_time)): int(s.oom_refusals) for s in live},
    )


def enrich(status: NodeStatus) -> dict[str, UsageView]:
    """Fill in NVML and usage-file figures (blocking I/O: never on the loop).
    Returns the usage views by container key for callers that want the detail."""
    live = read_gpu_live(g.uuid for g in status.gpus)
    for g in status.gpus:
        g.memory_used_bytes, g.utilization_ratio = live.get(g.uuid, (None, None))
    views: dict[str, UsageView] = {}
    for c in status.containers:
        v = read_usage_view(c.directory, c.created)
        if v is None:
            continue
        views[c.key] = v
        c.used_bytes, c.processes = v.used_bytes, v.processes
        # The activity tracker's figure (NVML too) unless the usage file shows a fresher launch.
        c.idle_seconds = v.idle_seconds if c.idle_seconds is None else min(c.idle_seconds, v.idle_seconds)
        c.oom_refusals, c.swapped_bytes = v.oom_refusals, v.swapped_bytes
    return views


# -- the endpoint ---------------------------------------------------------------------------


def _reply(code: int, reason: str, body: bytes, content_type: str = "application/json") -> bytes:
    head = (
        f"HTTP/1.0 {code} {reason}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


class StatusServer:
    """Serves GET / (JSON status) on a unix socket, on the agent's loop."""

    def __init__(self, agent: Any, path: str) -> None:
        self.agent = agent
        self.path = path
        self._server: asyncio.AbstractServer | None = None
        self._socket_id: tuple[int, int] | None = None

    async def start(self) -> StatusServer:
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(os.lstat(self.path).st_mode):
                os.unlink(self.path)  # stale socket of an earlier run
        self._server = await asyncio.start_unix_server(self._handle, path=self.path, limit=MAX_REQUEST)
        # Root and the node's operators (group) may read the node's workload names; others not.
        os.chmod(self.path, 0o660)
        st = os.stat(self.path)
        self._socket_id = (st.st_dev, st.st_ino)
        log.info("status endpoint on %s", self.path)
        return self

    async def stop(self) -> None:
        if self._server is None:
            return
        self._server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._server.wait_closed(), 2.0)
        self._server = None
        try:
            st = os.stat(self.path)
            if (st.st_dev, st.st_ino) == self._socket_id:  # only our own socket
                os.unlink(self.path)
        except OSError:
            pass

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), REQUEST_TIMEOUT)
            except asyncio.LimitOverrunError:
                too_large = json.dumps({"error": f"request too large: the limit is {MAX_REQUEST} bytes"})
                writer.write(_reply(431, "Request Header Fields Too Large", too_large.encode()))
                return
            except (asyncio.IncompleteReadError, asyncio.TimeoutError):
                return
            parts = head.split(b"\r\n", 1)[0].decode("latin-1").split()
            if len(parts) < 2 or parts[0] not in ("GET", "HEAD"):
                writer.write(_reply(405, "Method Not Allowed", b'{"error":"read-only endpoint: GET only"}'))
                return
            if parts[1].split("?", 1)[0] not in ("/", "/status"):
                writer.write(_reply(404, "Not Found", b'{"error":"try GET /"}'))
                return
            snap = capture(self.agent)
            await asyncio.to_thread(enrich, snap)
            body = json.dumps(snap.to_dict()).encode()
            writer.write(_reply(200, "OK", b"" if parts[0] == "HEAD" else body))
        except Exception:
            log.exception("status request failed")
            writer.write(
                _reply(500, "Internal Server Error", b'{"error":"internal error, see the agent log"}')
            )
        finally:
            with contextlib.suppress(Exception):
                await writer.drain()
                writer.close()
                await writer.wait_closed()


async def start(agent: Any) -> StatusServer | None:
    """Start the status endpoint at config.status_socket; None (and an error logged) if it cannot be
    served: the agent's real work goes on without it."""
    path = agent.config.status_socket
    try:
        return await StatusServer(agent, path).start()
    except OSError as e:
        log.error("status endpoint unavailable: cannot serve %s: %s", path, e.strerror or e)
        return None


# -- the client ------------------------------------------------------------------------------


class StatusUnavailable(Exception):
    """No agent answered on the status socket."""


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.unix_path = path

    def connect(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        try:
            s.connect(self.unix_path)
        except OSError:
            s.close()
            raise
        self.sock = s


def fetch(path: str, timeout: float = 30.0) -> dict[str, Any]:
    """The agent's status document from its socket; StatusUnavailable says why not."""
    conn = _UnixHTTPConnection(path, timeout)
    try:
        conn.request("GET", "/")
        resp = conn.getresponse()
        body = resp.read()
    except FileNotFoundError:
        raise StatusUnavailable(f"the gpufrac agent is not running (no status socket at {path})") from None
    except ConnectionRefusedError:
        raise StatusUnavailable(
            f"the gpufrac agent is not running (nothing listens on the status socket {path})"
        ) from None
    except PermissionError:
        raise StatusUnavailable(f"permission denied on the status socket {path} (run as root?)") from None
    except (OSError, http.client.HTTPException) as e:
        raise StatusUnavailable(f"the gpufrac agent did not answer on {path}: {e}") from None
    finally:
        conn.close()
    if resp.status != 200:
        raise StatusUnavailable(f"the gpufrac agent answered {resp.status} on {path}: {body[:200]!r}")
    try:
        data = json.loads(body)
    except ValueError as e:
        raise StatusUnavailable(f"the gpufrac agent sent invalid JSON on {path}: {e}") from None
    return data


# -- the table -------------------------------------------------------------------------------


def _b(n: int | None) -> str:
    return "?" if n is None else format_bytes(int(n))


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def _numa(n: Any) -> str:
    return "N/A" if n is None else str(n)


def _short_resource(r: str) -> str:
    return r.rsplit("/", 1)[-1]


def format_status(status: Mapping[str, Any], *, wide: bool = False) -> str:
    """The `gpufrac status` table from a status document (the JSON the endpoint serves);
    `wide` adds GPU UUIDs, PCI bus ids and NUMA nodes, and each container's key,
    priority, process count, OOM refusals and swapped bytes."""
    ready = "Ready" if status.get("ready") else f"NotReady ({status.get('ready_reason', '?')})"
    regs = ", ".join(
        f"{_short_resource(r)} {'registered' if ok else 'NOT registered'}"
        for r, ok in (status.get("registered") or {}).items()
    )
    lines = [
        f"Node {status.get('node', '?')}  gpufrac {status.get('version', '?')}  "
        f"driver {status.get('driver_version') or '?'}  {ready}",
        f"Kubelet: {regs or '?'}",
        "",
    ]
    gpus = status.get("gpus") or []
    resources = list(slices.RESOURCES)
    rows = [
        [
            "GPU",
            "MODEL",
            *(["UUID", "PCI BUS ID", "NUMA"] if wide else []),
            "TOTAL",
            "ALLOCATABLE",
            "REQUESTED",
            "USED",
            "BURST",
            "UTIL",
            *[f"{_short_resource(r).upper()} USED/FREE" for r in resources],
            "HEALTH",
        ]
    ]
    for g in gpus:
        util = g.get("utilization_ratio")
        sl = g.get("slices") or {}
        rows.append(
            [
                str(g["index"]),
                g["model"],
                *([g["uuid"], g["pci_bus_id"], _numa(g.get("numa_node"))] if wide else []),
                _b(g["memory_total_bytes"]),
                _b(g["memory_allocatable_bytes"]),
                _b(g["memory_requested_bytes"]),
                _b(g.get("memory_used_bytes")),
                _b(g["memory_burst_granted_bytes"]),
                "?" if util is None else f"{util * 100:.0f}%",
                *[f"{sl[r]['allocated']}/{sl[r]['free']}" if r in sl else "?" for r in resources],
                "Healthy" if g["healthy"] else f"Unhealthy: {g.get('health_reason') or '?'}",
            ]
        )
    extra = 3 if wide else 0
    for m in status.get("mig") or []:
        where = [m["uuid"], m["pci_bus_id"], _numa(m.get("numa_node"))] if wide else []
        rows.append(
            [str(m["index"]), m["model"], *where, _b(m["memory_total"]), *["-"] * 5]
            + ["-" for _ in resources]
            + [m["reason"]]
        )
    for i, reason in sorted((status.get("unreachable") or {}).items(), key=lambda kv: int(kv[0])):
        rows.append([str(i), *["?"] * (7 + extra), *["?" for _ in resources], f"Unhealthy: {reason}"])
    lines += table(rows, align_right=range(2 + extra, 8 + extra + len(resources)))
    index_of = {g["uuid"]: g["index"] for g in gpus}
    containers = status.get("containers") or []
    lines.append("")
    if not containers:
        lines.append("No containers hold gpufrac devices.")
        return "\n".join(lines)
    crow = [
        [
            "NAMESPACE",
            "POD",
            "CONTAINER",
            "GPU",
            "RESOURCE",
            "REQUEST",
            "LIMIT",
            "USED",
            "BURST",
            "IDLE",
            "CLASS",
            *(["PRIORITY", "PROCS", "OOM", "SWAPPED", "KEY"] if wide else []),
        ]
    ]
    for c in sorted(containers, key=lambda c: (c["namespace"], c["pod"], c["container"], c["key"])):
        crow.append(
            [
                c["namespace"] or "?",
                c["pod"] or f"({c['key']}, pod not known yet)",
                c["container"] or "?",
                ",".join(str(index_of.get(u, "?")) for u in c["gpus"]),
                f"{_short_resource(c['resource'])} {c['slices']}",
                _b(c["request_bytes"]),
                _b(c["limit_bytes"]),
                _b(c.get("used_bytes")),
                _b(c["burst_granted_bytes"]),
                _duration(c.get("idle_seconds")),
                c["workload_class"],
                *(
                    [
                        str(c["priority"]),
                        str(c.get("processes", 0)),
                        str(c.get("oom_refusals", 0)),
                        _b(c.get("swapped_bytes", 0)),
                        c["key"],
                    ]
                    if wide
                    else []
                ),
            ]
        )
    lines += table(crow, align_right=(5, 6, 7, 8, 9, *((11, 12, 13, 14) if wide else ())))
    return "\n".join(lines)


def default_socket(args: argparse.Namespace) -> str:
    if getattr(args, "socket", None):
        return str(args.socket)
    from gpufrac.agent import config as config_mod

    return config_mod.load(getattr(args, "config", None)).status_socket


def cmd_status(args: argparse.Namespace) -> int:
    """`gpufrac status [-o json|yaml|wide] [--socket PATH]`."""
    from gpufrac.agent.config import ConfigError

    try:
        path = default_socket(args)
    except ConfigError as e:
        print(f"gpufrac status: {e}", file=sys.stderr)
        return 2
    try:
        data = fetch(path)
    except StatusUnavailable as e:
        print(f"gpufrac status: {e}", file=sys.stderr)
        return 1
    print(render(args, data, lambda wide: format_status(data, wide=wide), sort_keys=True))
    return 0
