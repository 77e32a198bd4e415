"""The arbiter: burst grants for the memguard shim's slow path (docs/arbiter-protocol.md).

One unix socket per node (gpufrac.deviceplugin.server.arbiter_socket), bind-mounted
into every sharing container at $GPUFRAC_CONTAINER_DIR/arbiter.sock. A request acts
only for the caller's own container, which comes from SO_PEERCRED -> cgroup -> pod
(gpufrac.agent.peers), never from the message.

Grants. Per GPU and container (u = used, r = request, g = grant):
    burst     = max(g, u - r, 0)
    committed = r + burst                 (lendUnusedRequests off)
              = min(u, r) + burst         (on: unused guarantees may be lent)
    pool      = allocatable - sum(committed)
    physical  = NVML free - grantMargin - sum(max(0, committed - u))
A burst of `extra` new bytes is granted only if extra <= min(pool, physical): the
ledger's arithmetic never outruns what the GPU really has. The grant is published
in the container's config (ledger.update_config) before the reply.

Grants come back: the shim's release op, its grant_returned counter, and a sweep
that lowers grants a container has not used for STALE_AFTER seconds. Every release
wakes the waiters of that GPU at once (no polling period).

Order. Per GPU, nobody is granted while a request ranks ahead of it: a waiter of
higher priority, or of equal priority that came first (FIFO), or a request for
which an eviction or a swap is freeing memory right now (Arbiter.claim): memory a
resolver wins goes to the requester that caused it first, then to the queue.

Runs entirely on the agent's event loop; NVML reads go to a worker thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import itertools
import logging
import mmap
import os
import re
import sys
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

from gpufrac.agent import activity, metrics, truth
from gpufrac.agent import swap as swap_mod
from gpufrac.agent.admission import reclaim_guarantee
from gpufrac.agent.allocations import ContainerAlloc, Ledger
from gpufrac.agent.config import Config
from gpufrac.agent.events import container_ref
from gpufrac.agent.fairness import REFUSE_DELAY, Account, Fairness
from gpufrac.agent.peers import (
    Caller,
    CgroupIdentity,
    PeerError,
    PeerLookup,
    in_container,
    kill_and_wait,
    read_cgroup,
)
from gpufrac.agent.resolvers import Chain, Holding, Need, build_chain, guarantee_chain
from gpufrac.agent.units import format_bytes
from gpufrac.memguard import formats
from gpufrac.memguard.formats import (
    FLAG_DISABLED,
    BurstReply,
    BurstRequest,
    FormatError,
)

log = logging.getLogger(__name__)

_GEN_OFFSET = formats.ConfigStruct.generation.offset
REQUEST_SIZE = ctypes.sizeof(BurstRequest)
REPLY_SIZE = ctypes.sizeof(BurstReply)
REFUSAL_LOG_EVERY = 60.0  # seconds between two log lines about refusals alike (Arbiter._say_refused)
NVML_FRESH = 0.1  # an NVML reading younger than this is used as is
# Metric label values for requests (gpufrac_arbiter_requests_total{kind,outcome}); the
# runtime emulator's stand-in workload prints the same status names.
OP_NAMES = {
    formats.BURST_OP_BURST: "burst",
    formats.BURST_OP_RELEASE: "release",
    formats.BURST_OP_SWAP_IN: "swap_in",
    formats.BURST_OP_RECLAIM: "reclaim",
}
STATUS_NAMES = {
    formats.BURST_GRANTED: "granted",
    formats.BURST_DENIED: "denied",
    formats.BURST_REFUSED: "refused",
    formats.BURST_INVALID: "invalid",
    formats.BURST_UNAVAILABLE: "unavailable",
    formats.BURST_BUSY: "busy",
}
NVML_STALE = 1.0  # older than this, a request waits for a new one
RECLAIM_INTERVAL = 1.0
STALE_AFTER = 10.0  # a grant unused this long is taken back
STALE_SLACK = 64 << 20  # "well below": unused grant beyond this counts as stale
# A grant this young is not lowered to the container's usage: the shim it was given to
# charges its allocation right after the reply, so usage may not show it yet.
GRANT_SETTLE = 0.1
Result = tuple[int, int]  # (reply status, config generation)
_LAST = float("inf")  # the queue order's arrival part for a request not yet queued


@dataclass
class Stats:
    """Counters (tests and the bench read them)."""

    granted: int = 0
    denied: int = 0
    refused: int = 0  # caller not identified
    dropped: int = 0  # short reads, timeouts, early disconnects
    busy: int = 0  # refused: the caller's container was over its limits (gpufrac.agent.fairness)
    wait_timeouts: int = 0


@dataclass
class _Waiter:
    need: Need
    done: asyncio.Future[bool] = field(default_factory=lambda: asyncio.get_running_loop().create_future())

    @property
    def order(self) -> tuple[int, int]:
        return self.need.order


class Arbiter:
    def __init__(
        self,
        config: Config,
        ledger: Ledger,
        peers: PeerLookup,
        socket_path: str,
        *,
        memory: Callable[[], dict[str, Any]] | None = None,
        processes: Callable[[], list[Any]] | None = None,
        events: Any | None = None,
        resolvers: Chain | None = None,
        read_timeout: float | None = None,
    ) -> None:
        self.config = config
        self.ledger = ledger
        self.peers = peers
        self.socket_path = socket_path
        self.events = events
        self.evict_idle_threshold = config.evict_idle_threshold
        # The agent's activity tracker (gpufrac.agent.idle sets it): how idle a victim is.
        self.activity: activity.DecisionIdle | None = None
        self.read_timeout = read_timeout if read_timeout is not None else config.arbiter_timeout
        if memory is None:
            from gpufrac.agent.inventory import read_memory

            memory = read_memory
        self._read_memory = memory
        if processes is None:
            from gpufrac.agent.watchdog import observe

            processes = observe
        # NVML's processes with their cgroups (gpufrac.agent.truth): what each container holds.
        self._read_processes = processes
        self._driver: truth.DriverUsage | None = None
        self._driver_error_logged = False
        # One context allowance per container (docs/watchdog.md), as the watchdog's.
        self.allowance = config.watchdog.tolerance
        self._bad_usage: dict[str, str] = {}  # key -> what was wrong with its usage file (logged once)
        self._nvml: dict[str, Any] | None = None
        self._nvml_at = -1e9
        self._nvml_task: asyncio.Task[None] | None = None
        self._nvml_error_logged = False
        self.chain = resolvers if resolvers is not None else build_chain(config.resolvers, self)
        # A guarantee is reclaimed with an evict step even where `resolvers` leaves it out.
        self.guarantee_chain = guarantee_chain(self.chain, self)
        # The swap resolver, if configured: its victims' memory is in host RAM, not on the GPU.
        self.swap = swap_mod.of(self.chain)
        self.stats = Stats()
        self._server: asyncio.base_events.Server | None = None
        self._usage: dict[str, int] = {}  # container key -> an fd on its usage file (read by pread)
        self._config_maps: dict[str, mmap.mmap] = {}
        self._waiters: dict[str, list[_Waiter]] = {}
        self._claims: dict[str, list[Need]] = {}  # per GPU: needs a resolver is freeing memory for
        self._seq = itertools.count(1)
        self._tasks: list[asyncio.Task[Any]] = []
        self._connections: set[_Connection] = set()
        self.fairness = Fairness.from_config(config, peers.proc)
        self._refusals_said: dict[str, tuple[float, int]] = {}  # refusal kind -> (logged at, unsaid since)
        self._returned: dict[str, int] = {}  # last grant_returned seen per container
        self._unused_since: dict[str, float] = {}
        self._granted_at: dict[str, float] = {}  # container key -> time.monotonic() of its last grant
        self._settling: set[str] = set()  # keys whose lowered release waits out GRANT_SETTLE
        self._notifying = False
        self._renotify: set[str] = set()
        self._handles_generation = -1  # the ledger's capacity_generation at the last handle sweep

    # -- lifetime --------------------------------------------------------------------------------

    async def start(self) -> None:
        self.reconcile()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)  # a previous agent's socket: nobody listens on it
        os.makedirs(os.path.dirname(self.socket_path) or ".", exist_ok=True)
        loop = asyncio.get_running_loop()
        self.fairness.fit_fd_limit()  # before the first connection: the cap must fit the file limit
        self._server = await loop.create_unix_server(
            lambda: _Connection(self),
            path=self.socket_path,
            backlog=self.config.arbiter_limits.listen_backlog,
        )
        # Container processes may run as any uid; who they are comes from SO_PEERCRED.
        os.chmod(self.socket_path, 0o666)
        self.ledger.add_listener(self._on_ledger_change)
        self._tasks.append(asyncio.create_task(self._reclaim_loop(), name="arbiter-reclaim"))
        log.info("arbiter listening on %s (resolvers %s)", self.socket_path, self.chain.names)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for waiters in self._waiters.values():
            for w in waiters:
                if not w.done.done():
                    w.done.set_result(False)  # a stopping agent grants nothing
        self._waiters.clear()
        for conn in list(self._connections):
            conn.abort()
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)
        for fd in self._usage.values():
            os.close(fd)
        self._usage.clear()
        self.fairness.close()
        for mm in self._config_maps.values():
            mm.close()
        self._config_maps.clear()

    def reconcile(self) -> None:
        """After an agent restart: grants above what a container now uses are taken back
        (its waiters died with the old agent; their shims have already given up)."""
        for alloc in self.ledger.containers():
            g = alloc.config.grant_bytes
            if g <= 0:
                continue
            used = self._used(alloc)
            keep = g if used is None else min(g, max(0, used - alloc.request_bytes))
            if keep < g:
                log.info("reconcile: %s grant %s -> %s", alloc.who(), format_bytes(g), format_bytes(keep))
                self.ledger.update_config(alloc.key, grant_bytes=keep)

    # -- the socket ------------------------------------------------------------------------------

    def _handle(self, req: BurstRequest, sock: Any) -> Result | Coroutine[Any, Any, Result]:
        """A request's answer now, or a coroutine that finds it (waiting, resolvers, swap-in)."""
        if req.magic != formats.BURST_MAGIC or req.version != formats.ABI_VERSION or req.op not in OP_NAMES:
            return formats.BURST_INVALID, 0
        try:
            caller = self.peers.identify(sock)
        except PeerError as e:
            self.stats.refused += 1
            self._say_refused(str(e))
            return formats.BURST_REFUSED, 0
        if req.op == formats.BURST_OP_RELEASE:
            return formats.BURST_GRANTED, self._release(caller.alloc)
        if req.op == formats.BURST_OP_SWAP_IN:
            return self._swap_in(caller)
        if req.op == formats.BURST_OP_RECLAIM:
            return self._reclaim(caller, int(req.bytes), int(req.total_after))
        return self._burst(caller, int(req.bytes), int(req.total_after))

    def _say_refused(self, why: str) -> None:
        """Log a refusal of an unidentified caller, once per REFUSAL_LOG_EVERY for refusals
        alike but for their numbers (pids), with how many were left unsaid: anyone who
        reaches the socket can send hundreds a second."""
        kind = re.sub(r"\d+", "#", why)
        now = time.monotonic()
        said_at, unsaid = self._refusals_said.get(kind, (float("-inf"), 0))
        if now - said_at < REFUSAL_LOG_EVERY:
            self._refusals_said[kind] = (said_at, unsaid + 1)
            return
        more = f" ({unsaid} more like it since the last report)" if unsaid else ""
        log.warning("arbiter: refused a request: %s%s", why, more)
        if len(self._refusals_said) >= 1024:
            self._refusals_said = {
                k: v for k, v in self._refusals_said.items() if now - v[0] < REFUSAL_LOG_EVERY
            }
        self._refusals_said[kind] = (now, 0)

    # -- bursts ----------------------------------------------------------------------------------

    def _burst(self, caller: Caller, nbytes: int, total_after: int) -> Result | Coroutine[Any, Any, Result]:
        alloc = caller.alloc
        cfg = alloc.config
        if nbytes <= 0 or alloc.whole_gpu or cfg.flags & FLAG_DISABLED:
            self.stats.denied += 1
            return formats.BURST_DENIED, 0
        used = self._used(alloc)
        if used is None:
            self.stats.denied += 1
            return formats.BURST_DENIED, 0
        want = max(total_after, used + nbytes)
        if want > cfg.limit_bytes:
            self.stats.denied += 1
            log.debug(
                "%s: %s would pass the limit %s",
                alloc.who(),
                format_bytes(want),
                format_bytes(cfg.limit_bytes),
            )
            return formats.BURST_DENIED, 0
        target = want - alloc.request_bytes
        if target <= cfg.grant_bytes:
            self.stats.granted += 1  # already granted (the shim raced a config update)
            return formats.BURST_GRANTED, self._generation(alloc)
        if self._nvml_ready():
            return self._burst_decide(alloc, target, used)  # the common case: no task
        return self._burst_after_reading(caller, nbytes, total_after)

    async def _burst_after_reading(self, caller: Caller, nbytes: int, total_after: int) -> Result:
        await self._fresh_nvml()
        # Again with the fresh reading: the driver's count of the caller may have been stale.
        out = self._burst(caller, nbytes, total_after)
        while not isinstance(out, tuple):
            out = await out
        return out

    def _burst_decide(
        self, alloc: ContainerAlloc, target: int, used: int
    ) -> Result | Coroutine[Any, Any, Result]:
        """Granted now if the GPU has the bytes and nobody ranks ahead (a waiter of equal or
        higher priority, a claim); otherwise the wait and the resolvers, as a coroutine."""
        # The common case first, without building a Need: nobody waits ahead and it fits.
        if not self._ahead(alloc.gpus[0], (-alloc.config.priority, _LAST)) and self._grant(alloc, target):
            return formats.BURST_GRANTED, self._generation(alloc)
        deadline = asyncio.get_running_loop().time() + alloc.config.wait_timeout_ms / 1000.0
        need = Need(
            requester=alloc,
            gpu=alloc.gpus[0],
            bytes=target - self._burst_held(alloc, used),
            priority=alloc.config.priority,
            deadline=deadline,
            kind="burst",
            try_grant=lambda: False,
            shortfall=lambda: 0,
            seq=next(self._seq),
        )
        need.try_grant = lambda: self._try_grant(need, target)
        need.shortfall = lambda: max(0, target - self._burst_held(alloc) - self._free_for(alloc))
        return self._burst_resolve(need)

    async def _burst_resolve(self, need: Need) -> Result:
        """Wait for memory or have the resolvers free it, until the caller's wait timeout."""
        alloc = need.requester
        # The shim stops listening after its wait timeout: answer by then, whatever a resolver does.
        left = need.deadline - asyncio.get_running_loop().time()
        try:
            ok = await asyncio.wait_for(self.chain.resolve(need), max(0.0, left) + 0.05)
        except asyncio.TimeoutError:
            ok = need.granted
        if ok:
            return formats.BURST_GRANTED, self._generation(alloc)
        self.stats.denied += 1
        log.info(
            "denied %s of burst to %s on GPU %s (%s)",
            format_bytes(need.bytes),
            alloc.who(),
            need.gpu,
            "; ".join(need.notes) or "no resolver freed enough",
        )
        return formats.BURST_DENIED, 0

    async def _reclaim(self, caller: Caller, nbytes: int, total_after: int) -> tuple[int, int]:
        """The driver refused `nbytes` within the caller's request: others' bursts hold its guarantee.
        Take it back as at admission, bounded by the container's wait timeout."""
        alloc = caller.alloc
        cfg = alloc.config
        if nbytes <= 0 or alloc.whole_gpu or cfg.flags & FLAG_DISABLED:
            self.stats.denied += 1
            return formats.BURST_DENIED, 0
        deadline = asyncio.get_running_loop().time() + cfg.wait_timeout_ms / 1000.0
        await self._refresh_nvml()  # the driver just failed: a cached reading may predate the burst
        used, driver = self._used(alloc), self.driver_used(alloc)
        if (
            used is None
            # Without the driver's count only the tenant's file would say what it holds, and a
            # reclaim takes from others: refused.
            or driver is None
            # Past the guarantee: BURST rules apply. The file counts the refused bytes already;
            # the driver's count does not, and a tenant cannot lower it.
            or max(used, total_after, driver + nbytes) > alloc.request_bytes
        ):
            if driver is None:
                log.info(
                    "could not reclaim the guarantee of %s on GPU %s (no NVML memory reading)",
                    alloc.who(),
                    alloc.gpus[0],
                )
            self.stats.denied += 1
            return formats.BURST_DENIED, 0
        left = await reclaim_guarantee(self, alloc, alloc.gpus[0], deadline, nbytes)
        if left == 0:
            self.stats.granted += 1
            return formats.BURST_GRANTED, self._generation(alloc)
        self.stats.denied += 1
        log.info(
            "could not reclaim the guarantee of %s on GPU %s (%s)",
            alloc.who(),
            alloc.gpus[0],
            "no NVML memory reading" if left is None else f"{format_bytes(left)} missing",
        )
        return formats.BURST_DENIED, 0

    def _try_grant(self, need: Need, target: int) -> bool:
        """A need's grant, unless it asks for burst bytes while a request ranks ahead of it on
        its GPU (it is granted once, whoever tries). No new bytes (a swap-in within its
        guarantee) never queue: a guarantee never waits."""
        asks_more = target > need.requester.config.grant_bytes
        if (
            not need.granted
            and not (asks_more and self._ahead(need.gpu, need.order, need))
            and self._grant(need.requester, target)
        ):
            need.granted = True
        return need.granted

    def _grant(self, alloc: ContainerAlloc, target: int) -> bool:
        """Grant `target` bytes above request to the container if the GPU has them now."""
        if self.ledger.get(alloc.key) is not alloc:
            return False  # released meanwhile
        cur = alloc.config.grant_bytes
        if target > cur:
            extra = target - self._burst_held(alloc)
            if extra > self._free_for(alloc):
                return False
            self.ledger.update_config(alloc.key, grant_bytes=target)
        self.stats.granted += 1
        self._unused_since.pop(alloc.key, None)
        self._granted_at[alloc.key] = time.monotonic()
        return True

    def _ahead(self, gpu: str, order: tuple[int, float], need: Need | None = None) -> bool:
        """Whether another request is to be served on `gpu` before one of queue `order`
        (Need.order; a request not yet queued comes last among its priority): a claim (a
        need a resolver is freeing memory for) or a waiter not yet served that ranks ahead.
        A claim's own need ranks ahead of every waiter: what was won for it is its first."""
        claims = self._claims.get(gpu, ())
        if any(c is need for c in claims):
            return any(c.order < order for c in claims if c is not need)
        if any(c.order < order for c in claims):
            return True
        return any(w.order < order and not w.done.done() for w in self._waiters.get(gpu, ()))

    @contextlib.contextmanager
    def claim(self, need: Need) -> Iterator[None]:
        """While a resolver frees memory for `need` (evicts, swaps), nobody who ranks below it
        is granted on its GPU, and it ranks ahead of every waiter: the resolver tries its grant
        before the claim ends, and only then are the waiters woken."""
        claims = self._claims.setdefault(need.gpu, [])
        claims.append(need)
        try:
            yield
        finally:
            claims[:] = [c for c in claims if c is not need]
            if not claims:
                self._claims.pop(need.gpu, None)
            self.notify(need.gpu)

    # -- accounting ------------------------------------------------------------------------------

    def _usage_fd(self, alloc: ContainerAlloc) -> int | None:
        fd = self._usage.get(alloc.key)
        if fd is None:
            if not self.ledger.attached(alloc.key):
                return None  # not written yet: the path may hold a released container's file
            try:
                fd = os.open(
                    os.path.join(alloc.directory, formats.USAGE_FILE),
                    os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK,
                )
            except OSError as e:
                self._usage_bad(alloc, f"cannot open it: {e.strerror}")
                return None
            self._usage[alloc.key] = fd
        return fd

    def _usage_bad(self, alloc: ContainerAlloc, why: str) -> None:
        """A usage file the agent cannot use: logged once per container (until it reads well)."""
        if alloc.key not in self._bad_usage:
            self._bad_usage[alloc.key] = why
            log.warning("usage file of %s is unusable (%s): its own bursts are refused until the shim "
                        "rewrites it; others are not affected", alloc.who(), why)  # fmt: skip

    def _usage_of(self, alloc: ContainerAlloc) -> formats.UsageStruct | None:
        """A validated copy of the container's usage file (pread on a kept fd: never a mapping,
        which a container truncating its file would turn into SIGBUS); None when unusable."""
        fd = self._usage_fd(alloc)
        if fd is None:
            return None
        try:
            out = formats.parse_usage(os.pread(fd, formats.USAGE_SIZE, 0), "usage file")
        except (OSError, FormatError) as e:
            self._usage_bad(alloc, str(e.strerror if isinstance(e, OSError) else e))
            return None
        self._bad_usage.pop(alloc.key, None)
        return out

    def _file_used(self, alloc: ContainerAlloc) -> int | None:
        """The usage file's total_used, validated and clamped (header only: per request)."""
        fd = self._usage_fd(alloc)
        if fd is None:
            return None
        try:
            # One pread per request: a file cut short reads short (no SIGBUS, unlike a mapping).
            return formats.parse_usage_total(os.pread(fd, formats.USAGE_HEADER.size, 0))
        except (OSError, FormatError) as e:
            self._usage_bad(alloc, str(e.strerror if isinstance(e, OSError) else e))
            return None

    def driver_used(self, alloc: ContainerAlloc) -> int | None:
        """What NVML counts for the container's processes on its GPU, less one context
        allowance (gpufrac.agent.truth); None without a recent process reading (decisions take
        a fresh one first; a stale count must not hold a grant that was given back)."""
        if self._driver is None or time.monotonic() - self._nvml_at > NVML_STALE:
            return None
        raw = self._driver.bytes_of(alloc.key, alloc.gpus[0])
        return max(0, raw - self.allowance)

    def _used(self, alloc: ContainerAlloc) -> int | None:
        """What the container holds on its GPU (a swapped-out container: nothing): the larger
        of its usage file (clamped to what it was given) and the driver's count
        (gpufrac.agent.truth). None when the file cannot be read."""
        if self.swap is not None and self.swap.is_swapped(alloc.key):
            return 0
        used = self._file_used(alloc)
        if used is None:
            return None
        return max(truth.clamp_file(alloc, used), self.driver_used(alloc) or 0)

    def _held(self, alloc: ContainerAlloc) -> int:
        """`_used`, or, for a container whose usage file cannot be read (the tenant's to
        break), the driver's count, else all it may hold: breaking its own bookkeeping must
        shield it from no reclaim and inflate no one else's shortfall."""
        used = self._used(alloc)
        if used is not None:
            return used
        driver = self.driver_used(alloc)
        return driver if driver is not None else alloc.request_bytes + alloc.config.grant_bytes

    def _burst_held(self, alloc: ContainerAlloc, used: int | None = None) -> int:
        used = self._used(alloc) if used is None else used
        if used is None:  # unknown usage: assume it uses everything it may
            used = alloc.request_bytes + alloc.config.grant_bytes
        return max(alloc.config.grant_bytes, used - alloc.request_bytes, 0)

    def _on_gpu(self, gpu: str) -> list[ContainerAlloc]:
        return [a for a in self.ledger.containers() if gpu in a.gpus]

    def _free_for(self, alloc: ContainerAlloc) -> int:
        """Bytes that may be newly granted on the requester's GPU: the ledger's pool and
        NVML's physically free memory less the margin, whichever is smaller."""
        gpu = alloc.gpus[0]
        lend = self.config.lend_unused_requests
        committed = unused = 0
        for a in self._on_gpu(gpu):
            used = self._used(a)
            if used is None:  # unknown usage: it may use everything it was promised
                used = a.request_bytes + a.config.grant_bytes
            c = (min(used, a.request_bytes) if lend else a.request_bytes) + self._burst_held(a, used)
            committed += c
            unused += max(0, c - used)
        pool = self.ledger.geometry[gpu].allocatable - committed
        mem = (self._nvml or {}).get(gpu)
        if mem is None:
            return 0  # no physical reading: never grant blindly
        physical = int(mem.free) - self.config.grant_margin - unused
        return max(0, min(pool, physical))

    async def grantable(self, alloc: ContainerAlloc) -> int:
        """Bytes a burst of `alloc` could be granted right now (metrics, tests, the bench)."""
        await self._fresh_nvml()
        return self._free_for(alloc)

    def holdings(self, gpu: str) -> list[Holding]:
        now = time.monotonic_ns()
        out = []
        for a in self._on_gpu(gpu):
            u = self._usage_of(a)
            used = self._held(a)
            # An unreadable usage file gives no activity either: the container counts as idle.
            last = max((int(s.last_activity_ns) for s in u.slots if s.pid > 0), default=0) if u else 0
            idle_s = activity.holding_idle_s(self.activity, a.key, last, now) if u else float("inf")
            out.append(
                Holding(
                    alloc=a,
                    used=used,
                    request=a.request_bytes,
                    grant=a.config.grant_bytes,
                    burst=self._burst_held(a, used),
                    priority=a.config.priority,
                    flags=a.config.flags,
                    idle_s=idle_s,
                )
            )
        return out

    # -- swap (gpufrac.agent.swap: the SWAP_IN op and what the swap resolver asks) ----------------

    async def _swap_in(self, caller: Caller) -> tuple[int, int]:
        status = await swap_mod.handle_swap_in(self, caller.alloc)
        return status, self._generation(caller.alloc)

    def free_for(self, alloc: ContainerAlloc) -> int:
        return self._free_for(alloc)

    def try_grant(self, need: Need, target: int) -> bool:
        return self._try_grant(need, target)

    async def refresh_memory(self) -> None:
        """A fresh NVML reading now (after a swap moved memory); waiters are re-checked."""
        await self._refresh_nvml()

    def next_seq(self) -> int:
        return next(self._seq)

    # -- admission reclaim (gpufrac.agent.admission) ------------------------------------------

    def guarantee_shortfall(self, alloc: ContainerAlloc, gpu: str, inflight: int = 0) -> int | None:
        """Bytes of `alloc`'s request on `gpu` that are not physically there now: its request
        less what it uses (less `inflight`, counted but not given by the driver), beyond NVML free
        less the margin less what every other container may still charge within its request +
        grant. None without an NVML reading."""
        mem = (self._nvml or {}).get(gpu)
        if mem is None:
            return None
        pending = 0
        for a in self._on_gpu(gpu):
            if a.key != alloc.key:
                # Not started yet (nothing held): it may still charge all it was promised.
                pending += max(0, a.request_bytes + a.config.grant_bytes - self._held(a))
        # What it holds now: the file less what it counted but the driver refused, or the
        # driver's count, whichever is larger (gpufrac.agent.truth): a zeroed counter cannot
        # make its guarantee look missing.
        file_used = self._file_used(alloc) or 0
        held = max(truth.clamp_file(alloc, file_used) - inflight, self.driver_used(alloc) or 0, 0)
        if self.swap is not None and self.swap.is_swapped(alloc.key):
            held = 0
        mine = min(alloc.request_bytes, alloc.request_bytes - held)
        return max(0, mine - (int(mem.free) - self.config.grant_margin - pending))

    def release_unused(self, alloc: ContainerAlloc) -> None:
        """Take back the part of `alloc`'s grant it does not use (as the shim's release does);
        a reclaim waits on what this frees, so NVML is read again at once."""
        self._release(alloc)
        self._refresh_soon()

    def _generation(self, alloc: ContainerAlloc) -> int:
        """The config generation the reply names (read from a kept mapping: per request)."""
        mm = self._config_maps.get(alloc.key)
        if mm is None:
            if not self.ledger.attached(alloc.key):
                return 0  # as for _usage_of: no file of this booking to read yet
            try:
                with open(os.path.join(alloc.directory, formats.CONFIG_FILE), "rb") as f:
                    mm = self._config_maps[alloc.key] = mmap.mmap(
                        f.fileno(), ctypes.sizeof(formats.ConfigStruct), access=mmap.ACCESS_READ
                    )
            except (OSError, ValueError):
                return 0
        return int.from_bytes(mm[_GEN_OFFSET : _GEN_OFFSET + 8], sys.byteorder)

    # -- NVML ------------------------------------------------------------------------------------

    def _nvml_ready(self) -> bool:
        """Whether the NVML reading may be used now; starts a new one if it is getting old."""
        age = time.monotonic() - self._nvml_at
        if age <= NVML_FRESH:
            return True
        if self._nvml_task is None or self._nvml_task.done():
            self._nvml_task = asyncio.create_task(self._refresh_nvml())
        return age <= NVML_STALE

    async def _fresh_nvml(self) -> None:
        if not self._nvml_ready():
            assert self._nvml_task is not None
            await asyncio.shield(self._nvml_task)

    def _read_driver(self) -> tuple[dict[str, Any], list[Any] | Exception]:
        """Blocking: NVML's memory per GPU, then its processes with their cgroups."""
        mem = self._read_memory()
        try:
            procs: list[Any] | Exception = self._read_processes()
        except Exception as e:
            procs = e
        return mem, procs

    async def _refresh_nvml(self) -> None:
        try:
            self._nvml, procs = await asyncio.to_thread(self._read_driver)
            self._nvml_at = time.monotonic()
            self._nvml_error_logged = False
        except Exception as e:
            self._nvml = None  # no reading, no grants
            self._driver = None
            self._nvml_at = time.monotonic()
            if not self._nvml_error_logged:
                self._nvml_error_logged = True
                log.error("arbiter: NVML memory reading failed, bursts are refused until it works: %s", e)
        else:
            self._take_processes(procs)
        # A fresh reading may let waiters in that a stale one kept out.
        for gpu in list(self._waiters):
            self.notify(gpu)

    def _take_processes(self, procs: list[Any] | Exception) -> None:
        """A new per-process reading: each container's driver count, checked against its file."""
        if isinstance(procs, Exception):
            self._driver = None  # until it works: reclaims refused, other decisions use the files (clamped)
            if not self._driver_error_logged:
                self._driver_error_logged = True
                log.error(
                    "arbiter: NVML per-process reading failed; reclaims are refused and usage files "
                    "(clamped) are trusted until it works: %s",
                    procs,
                )
            return
        self._driver_error_logged = False
        self._driver = truth.attribute(procs, self.peers)

    # -- releases and waiters ----------------------------------------------------------------------

    def _release(self, alloc: ContainerAlloc) -> int:
        """Take back the part of a container's grant it does not use; wakes waiters."""
        used = self._used(alloc)
        g = alloc.config.grant_bytes
        if used is not None and g > 0:
            keep = min(g, max(0, used - alloc.request_bytes))
            young = self._granted_at.get(alloc.key, -GRANT_SETTLE) + GRANT_SETTLE - time.monotonic()
            if keep < g and young > 0:
                # Another process's free (or the returned counter) right after a grant: the
                # shim given it may not have charged its allocation yet. Lower it once it has.
                self._settle_later(alloc, young)
            elif keep < g:
                self.ledger.update_config(alloc.key, grant_bytes=keep)
        self._unused_since.pop(alloc.key, None)
        gpu = alloc.gpus[0]
        self.notify(gpu)
        if self._waiters.get(gpu):
            # The freed bytes show in NVML only after a new reading. Without waiters there is no
            # hurry: a reading from before the free under-counts free memory (never grants too
            # much), and the next burst after NVML_FRESH takes a new one. Reading all GPUs on
            # every release would sit on the fast path of the bursts that follow.
            self._refresh_soon()
        return self._generation(alloc)

    def _settle_later(self, alloc: ContainerAlloc, delay: float) -> None:
        if alloc.key in self._settling:
            return
        self._settling.add(alloc.key)

        def settled() -> None:
            self._settling.discard(alloc.key)
            if self.ledger.get(alloc.key) is alloc:
                self._release(alloc)

        asyncio.get_running_loop().call_later(delay, settled)

    def revoke_burst(self, alloc: ContainerAlloc) -> None:
        """Evicted or swapped out: the container keeps its guarantee, loses every burst byte.
        Waiters are woken; during a claim (the resolver that revokes it) only once the
        requester has had its turn."""
        if self.ledger.get(alloc.key) is not None and alloc.config.grant_bytes:
            self.ledger.update_config(alloc.key, grant_bytes=0)
        self.notify(alloc.gpus[0])

    def _refresh_soon(self) -> None:
        """Start a new NVML reading now unless one is under way; it notifies waiters when done."""
        if self._nvml_task is None or self._nvml_task.done():
            self._nvml_task = asyncio.create_task(self._refresh_nvml())

    def notify(self, gpu: str) -> None:
        """Something was freed on `gpu`: grant waiters in order while they fit."""
        if self._notifying:
            self._renotify.add(gpu)
            return
        self._notifying = True
        try:
            pending = {gpu}
            while pending:
                g = pending.pop()
                waiters = self._waiters.get(g)
                while waiters:
                    w = waiters[0]
                    if w.done.done():
                        waiters.pop(0)
                        continue
                    if not w.need.try_grant():
                        break  # strict order: nobody overtakes the head (nor a claim)
                    waiters.pop(0)
                    w.done.set_result(True)
                pending |= self._renotify
                self._renotify.clear()
        finally:
            self._notifying = False

    async def wait_turn(self, need: Need) -> bool:
        """Queue the need on its GPU until notify() grants it or its deadline passes."""
        w = _Waiter(need)
        waiters = self._waiters.setdefault(need.gpu, [])
        waiters.append(w)
        waiters.sort(key=lambda x: x.order)
        self.notify(need.gpu)  # it may fit already (something was freed since the first try)
        loop = asyncio.get_running_loop()
        try:
            # Releases through the agent wake waiters at once (notify). Memory freed any other
            # way (a process exiting, a kill) shows only in NVML, which has no event to wait
            # on: while anyone waits, take a new reading every NVML_FRESH seconds.
            while not w.done.done():
                left = need.deadline - loop.time()
                if left <= 0:
                    self.stats.wait_timeouts += 1
                    return need.granted
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(asyncio.shield(w.done), min(left, NVML_FRESH))
                if not w.done.done():
                    self._refresh_soon()
            return w.done.result()
        finally:
            if w in waiters:
                waiters.remove(w)
                self.notify(need.gpu)  # the head left: those behind may fit
            if not waiters:
                self._waiters.pop(need.gpu, None)

    def _on_ledger_change(self) -> None:
        # Containers come and go only with a booking change (capacity_generation); a grant or
        # a limit (every burst) changes a config and needs no sweep of the handles kept here.
        if self.ledger.capacity_generation != self._handles_generation:
            self._handles_generation = self.ledger.capacity_generation
            # Only the handles kept here are looked up (a release loop must not cost O(n²)).
            booked = self.ledger.get
            for key in [k for k in self._config_maps if booked(k) is None]:
                self._config_maps.pop(key).close()
            for key in [k for k in self._usage if booked(k) is None]:
                os.close(self._usage.pop(key))
                self._bad_usage.pop(key, None)
                self._returned.pop(key, None)
                self._unused_since.pop(key, None)
            for key in [k for k in self._granted_at if booked(k) is None]:
                del self._granted_at[key]
        for gpu in list(self._waiters):
            self.notify(gpu)

    async def _reclaim_loop(self) -> None:
        while True:
            await asyncio.sleep(RECLAIM_INTERVAL)
            try:
                self.sweep()
            except Exception:
                log.exception("arbiter: grant sweep failed")

    def sweep(self, now: float | None = None) -> None:
        """Take back returned grants at once and stale ones after STALE_AFTER."""
        now = time.monotonic() if now is None else now
        for alloc in self.ledger.containers():
            u = self._usage_of(alloc)
            if u is None:
                continue
            returned = int(u.grant_returned)
            # A usage file starts at 0: a container whose process returned its grant before the
            # first sweep saw it (a short-lived burst) still counts as returned.
            last = self._returned.setdefault(alloc.key, 0)
            g = alloc.config.grant_bytes
            if returned != last:
                self._returned[alloc.key] = returned
                if g > 0:
                    self._release(alloc)
                    continue
            if g <= 0:
                self._unused_since.pop(alloc.key, None)
                continue
            unused = alloc.request_bytes + g - max(int(u.total_used), self.driver_used(alloc) or 0)
            if unused <= STALE_SLACK:
                self._unused_since.pop(alloc.key, None)
                continue
            since = self._unused_since.setdefault(alloc.key, now)
            if now - since >= STALE_AFTER:
                log.info("taking back %s of unused grant from %s", format_bytes(unused), alloc.who())
                self._release(alloc)

    # -- eviction support ----------------------------------------------------------------------------

    async def kill_container(self, alloc: ContainerAlloc) -> int:
        """SIGKILL every process of the container (host pids from its cgroup); returns the
        count once they are gone. A pid is signalled only while it is still in that
        container (a pidfd pins it against pid reuse), all signalled, then waited for at once,
        in one worker thread. Their dead usage slots are reaped here, since no shim of that
        container may be left to do it."""
        targets = dict(await asyncio.to_thread(self._pids_in_cgroups, alloc))
        killed = await asyncio.to_thread(
            kill_and_wait, list(targets), still_ours=lambda p: in_container(p, targets[p], self.peers.proc)
        )
        if not await asyncio.to_thread(self.peers.pids_of, alloc):
            self._reap_all(alloc)
        await self._refresh_nvml()  # the victims' memory is free now: let the grant see it
        return killed

    def _pids_in_cgroups(self, alloc: ContainerAlloc) -> list[tuple[int, CgroupIdentity]]:
        """The container's host pids, each with the container its cgroup names (blocking): the
        one a caller of it was seen in, else each pid's as read now (still in the pod)."""
        seen = self.peers.seen.get(alloc.key)
        out = []
        for pid in self.peers.pids_of(alloc):
            ident: CgroupIdentity | None = seen
            if ident is None:
                try:
                    ident = read_cgroup(pid, self.peers.proc)
                except PeerError:
                    continue  # exited
                if ident is None or ident.pod_uid != alloc.pod_uid:
                    continue  # the pid was reused meanwhile
            out.append((pid, ident))
        return out

    def _reap_all(self, alloc: ContainerAlloc) -> None:
        """Free the slots of a container with no process left (written by pwrite, never mapped)."""
        u = self._usage_of(alloc)
        if u is None:
            return
        total = int(u.total_used)
        writes: list[tuple[str, int, int]] = []
        for i, s in enumerate(u.slots):
            if s.pid > 0:
                total = max(0, total - int(s.used_bytes))
                # -1 first: being reaped (the shim's own convention), then the counters, then free.
                writes += [("pid", i, -1), ("total_used", -1, total), ("used_bytes", i, 0), ("pid", i, 0)]
        if writes:
            with contextlib.suppress(FormatError):
                formats.write_usage_fields(alloc.directory, writes)

    def event(self, alloc: ContainerAlloc, type_: str, reason: str, message: str) -> None:
        # `events` is an EventRecorder, or a callable returning the agent's (it may come later).
        recorder = self.events() if callable(self.events) else self.events
        ref = container_ref(alloc)
        if recorder is not None and ref is not None:
            recorder.record(ref, type_, reason, message)

    def disrupted(self, alloc: ContainerAlloc, reason: str, message: str) -> None:
        """Mark the pod of `alloc` DisruptionTarget (gpufrac.agent.kube.EventRecorder.disruption)."""
        recorder = self.events() if callable(self.events) else self.events
        ref = container_ref(alloc)
        mark = getattr(recorder, "disruption", None)
        if mark is not None and ref is not None:
            mark(ref, reason, message)


def published_grants(containers: list[tuple[str, str, str, int]]) -> dict[str, int]:
    """Grants the config files carry, for (key, directory, GPU, request) of booked containers
    (blocking reads: recovery runs it in a thread). A grant is published to the file before
    the shim is told, the state file is saved later: after a crash the files are the truth."""
    out = {}
    for key, directory, gpu, request in containers:
        try:
            cfg = formats.read_config(directory)
        except FormatError:
            continue
        if cfg.gpu_uuid == gpu and cfg.request_bytes == request:
            out[key] = cfg.grant_bytes
    return out


def adopt_grants(ledger: Ledger, grants: dict[str, int]) -> None:
    """Put published grants (published_grants) back into the restored ledger; the arbiter's
    reconcile() then takes back what the containers no longer use."""
    for key, grant in grants.items():
        alloc = ledger.get(key)
        if alloc is not None and alloc.config.grant_bytes != grant:
            ledger.update_config(key, grant_bytes=grant)


# -- a client (tests, the bench, the runtime emulator's stand-in workload) ------------------------


def request(
    path: str,
    op: int,
    nbytes: int = 0,
    total_after: int = 0,
    *,
    generation: int = 0,
    timeout: float = 5.0,
) -> BurstReply | None:
    """One request on the arbiter socket, as the shim sends it; the reply, or None when the
    agent closed the connection or did not answer in time (the shim then refuses)."""
    import socket

    req = BurstRequest(
        formats.BURST_MAGIC, formats.ABI_VERSION, op, os.getpid(), 0, nbytes, total_after, generation
    )
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            _connect_by(s, path, time.monotonic() + timeout)
            s.settimeout(timeout)
            s.sendall(bytes(req))
            data = b""
            while len(data) < REPLY_SIZE:
                chunk = s.recv(REPLY_SIZE - len(data))
                if not chunk:
                    return None
                data += chunk
        except (TimeoutError, OSError):
            return None
    return BurstReply.from_buffer_copy(data)


def _connect_by(s: Any, path: str, deadline: float) -> None:
    """Connect as the shim does (memguard.c mg_connect_by): a blocking connect waits for room in
    a full backlog (bounded by SO_SNDTIMEO) instead of failing with EAGAIN at once."""
    import socket
    import struct

    nap = 0.001
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("no room in the arbiter's backlog")
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", int(left), int(left % 1 * 1e6)))
        try:
            s.connect(path)
            return
        except (BlockingIOError, InterruptedError):
            time.sleep(min(nap, max(0.0, deadline - time.monotonic())))
            nap = min(0.005, nap + 0.001)


class _Connection(asyncio.Protocol):
    """One shim request on one connection: a fixed-size request in, one reply out, closed.

    A protocol rather than a stream handler so that the common answers (a burst the GPU
    has room for, a release, a refusal) are written from data_received itself: no task,
    timeout wrapper or disconnect watcher per request. Only a request that has to wait
    (resolvers, a swap-in, a reclaim) becomes a task, cancelled if the caller hangs up.
    """

    def __init__(self, arbiter: Arbiter) -> None:
        self.arb = arbiter
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.op: int | None = None  # the request's op, once it is read
        self.work: asyncio.Future[Result] | None = None
        self.account: Account | None = None  # its container's (gpufrac.agent.fairness)
        self.counted = False  # whether it counts among its container's requests in flight
        self.held = False  # past its container's connection limit: answered BUSY shortly

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport; both have its methods.
        self.transport = cast(asyncio.Transport, transport)
        arb = self.arb
        fair = arb.fairness
        self.account, victim, over = fair.admit(self, fair.container_of(transport.get_extra_info("socket")))
        if victim is not None:
            arb.stats.dropped += 1
            victim.abort()
        if self.account is None:  # the node is full: no at once
            self._busy()
            return
        arb._connections.add(self)
        loop = asyncio.get_running_loop()
        if over:
            # Past its container's connection limit: no, a little later (REFUSE_DELAY);
            # nothing it sends is read.
            self.held = True
            self.timer = loop.call_later(fair.refuse_delay(self.account), self._busy)
            return
        self.timer = loop.call_later(arb.read_timeout, self._too_slow)

    def _busy(self) -> None:
        """Answer BUSY (the caller's container is over its limits; nothing decided) and close."""
        self.arb.stats.busy += 1
        metrics.count_arbiter_request("connection", "busy")
        assert self.transport is not None
        if not self.transport.is_closing():
            self.transport.write(
                bytes(BurstReply(formats.BURST_MAGIC, formats.ABI_VERSION, formats.BURST_BUSY, 0))
            )
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self.op is not None or self.account is None or self.held:
            return  # one request per connection; anything after it is ignored
        self.buf += data
        if len(self.buf) < REQUEST_SIZE:
            return
        assert self.transport is not None
        if self.timer is not None:
            self.timer.cancel()
        req = BurstRequest.from_buffer_copy(self.buf[:REQUEST_SIZE])
        self.op = req.op
        if not self.arb.fairness.request(self.account):
            # Past its container's rate or in-flight limit: no, nothing decided, REFUSE_DELAY
            # later (its connection counts meanwhile: a flood is slowed, not served faster).
            self.arb.stats.busy += 1
            self.held = True
            self.timer = asyncio.get_running_loop().call_later(
                REFUSE_DELAY, self._answer, (formats.BURST_BUSY, 0)
            )
            return
        try:
            out = self.arb._handle(req, self.transport.get_extra_info("socket"))
        except Exception:
            log.exception("arbiter: request failed")
            self.transport.abort()
            return
        if isinstance(out, tuple):
            self._answer(out)
        else:
            self.account.inflight += 1
            self.counted = True
            self.work = asyncio.ensure_future(out)
            self.work.add_done_callback(self._worked)

    def eof_received(self) -> bool:
        # A caller that hangs up while its request waits gets nothing (and frees its place).
        self._give_up()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._give_up()
        if self.timer is not None:
            self.timer.cancel()
        self.arb._connections.discard(self)
        if self.account is not None:
            self._uncount()
            self.arb.fairness.gone(self.account, self)

    def _uncount(self) -> None:
        if self.counted and self.account is not None:
            self.counted = False
            self.account.inflight -= 1

    def abort(self) -> None:
        self._give_up()
        if self.transport is not None:
            self.transport.abort()

    def _too_slow(self) -> None:
        self.arb.stats.dropped += 1  # a short or missing request
        if self.transport is not None:
            self.transport.abort()

    def _give_up(self) -> None:
        if self.work is not None and not self.work.done():
            self.work.cancel()

    def _worked(self, work: asyncio.Future[Result]) -> None:
        self._uncount()
        if work.cancelled():  # the caller hung up while it waited
            self.arb.stats.dropped += 1
            metrics.count_arbiter_request(OP_NAMES.get(self.op or -1, "invalid"), "dropped")
            return
        exc = work.exception()
        if exc is not None:
            log.error("arbiter: request failed", exc_info=exc)
            if self.transport is not None:
                self.transport.abort()
            return
        self._answer(work.result())

    def _answer(self, result: Result) -> None:
        status, generation = result
        metrics.count_arbiter_request(OP_NAMES.get(self.op or -1, "invalid"), STATUS_NAMES[status])
        assert self.transport is not None
        if not self.transport.is_closing():
            reply = BurstReply(formats.BURST_MAGIC, formats.ABI_VERSION, status, generation)
            self.transport.write(bytes(reply))
        self.transport.close()  # after the reply is flushed
