"""The arbiter's sockets: one fixed-size request in, one reply out, per connection.

Each container has a socket of its own, in a directory of its host directory that the device
plugin mounts into it (gpufrac.agent.arbiter.listeners). The node-wide socket here
(gpufrac.core.config.arbiter_socket) serves containers an older agent admitted (they mount
its directory) and the agent's own tools. Who a caller is comes from the kernel (SO_PEERCRED ->
gpufrac.agent.processes.callers), never from its message; how much each container may ask is
gpufrac.agent.arbiter.fairness. What a request is answered is the Handler's (the Arbiter); this
module only reads, times out, counts and writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import socket
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, Protocol, cast

from gpufrac.agent.arbiter.fairness import REFUSE_DELAY, Account, Fairness
from gpufrac.memguard import wire
from gpufrac.memguard.wire import BurstRequest

log = logging.getLogger(__name__)

REFUSAL_LOG_EVERY = 60.0  # seconds between two log lines about refusals alike (RefusalLog)
Result = tuple[int, int]  # (reply status, config generation)


@dataclass
class Stats:
    """Counters (tests and the bench read them)."""

    granted: int = 0
    denied: int = 0
    refused: int = 0  # caller not identified
    dropped: int = 0  # short reads, timeouts, early disconnects
    busy: int = 0  # refused: the caller's container was over its limits (gpufrac.agent.arbiter.fairness)
    wait_timeouts: int = 0


class RequestMetrics(Protocol):
    """Where answered requests are counted (gpufrac.agent.metrics)."""

    def count_arbiter_request(self, kind: str, outcome: str) -> None: ...


class Handler(Protocol):
    """What answers requests (gpufrac.agent.arbiter.service.Arbiter)."""

    stats: Stats
    fairness: Fairness
    read_timeout: float

    @property
    def metrics(self) -> RequestMetrics: ...

    def handle(
        self, req: BurstRequest, sock: socket.socket, expected: str | None = None
    ) -> Result | Coroutine[Any, Any, Result]: ...


class RefusalLog:
    """Log a refusal of an unidentified caller, once per REFUSAL_LOG_EVERY for refusals alike
    but for their numbers (pids), with how many were left unsaid: anyone who reaches the
    socket can send hundreds a second."""

    def __init__(self) -> None:
        self._said: dict[str, tuple[float, int]] = {}  # refusal kind -> (logged at, unsaid since)

    def say(self, why: str) -> None:
        kind = re.sub(r"\d+", "#", why)
        now = time.monotonic()
        said_at, unsaid = self._said.get(kind, (float("-inf"), 0))
        if now - said_at < REFUSAL_LOG_EVERY:
            self._said[kind] = (said_at, unsaid + 1)
            return
        more = f" ({unsaid} more like it since the last report)" if unsaid else ""
        log.warning("arbiter: refused a request: %s%s", why, more)
        if len(self._said) >= 1024:
            self._said = {k: v for k, v in self._said.items() if now - v[0] < REFUSAL_LOG_EVERY}
        self._said[kind] = (now, 0)


def _bind(sock: socket.socket, path: str) -> None:
    """Bind `sock` at `path`, a stale socket file there replaced. A path longer than a unix
    address holds (107 bytes) is bound through its directory's /proc/self/fd link."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    if len(os.fsencode(path)) < 108:
        sock.bind(path)
        return
    fd = os.open(os.path.dirname(path), os.O_PATH | os.O_DIRECTORY)
    try:
        sock.bind(f"/proc/self/fd/{fd}/{os.path.basename(path)}")
    finally:
        os.close(fd)


def listening_socket(path: str, backlog: int) -> socket.socket:
    """A unix socket listening at `path` that any uid may connect to: container processes run
    as any uid, and who they are comes from SO_PEERCRED."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        _bind(sock, path)
        os.chmod(path, 0o666)
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock


class SocketServer:
    """The node-wide listening socket, and every open connection (those taken on containers'
    own sockets too: closing the server drops them all)."""

    def __init__(self, handler: Handler, path: str, backlog: int) -> None:
        self.handler = handler
        self.path = path
        self.backlog = backlog
        self.connections: set[Connection] = set()
        self._server: asyncio.base_events.Server | None = None

    async def start(self) -> None:
        directory = os.path.dirname(self.path) or "."
        if not os.path.isdir(directory):
            os.makedirs(directory, exist_ok=True)
            # Containers an older agent admitted mount this directory and run as any uid:
            # whatever the umask, they must reach the socket in it.
            os.chmod(directory, 0o755)
        loop = asyncio.get_running_loop()
        # A previous agent's socket file is replaced: nobody listens on it.
        sock = listening_socket(self.path, self.backlog)
        try:
            self._server = await loop.create_unix_server(
                lambda: Connection(self), sock=sock, backlog=self.backlog
            )
        except BaseException:
            sock.close()
            raise

    @property
    def listening(self) -> bool:
        return self._server is not None

    def close(self) -> None:
        """Stop accepting; drop every connection (a request in work is cancelled)."""
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            conn.abort()

    async def wait_closed(self) -> None:
        if self._server is None:
            return  # never bound: whatever is at its path is not its own
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._server.wait_closed(), 5)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


class Connection(asyncio.Protocol):
    """One shim request on one connection: a fixed-size request in, one reply out, closed.

    A protocol rather than a stream handler so that the common answers (a burst the GPU
    has room for, a release, a refusal) are written from data_received itself: no task,
    timeout wrapper or disconnect watcher per request. Only a request that has to wait
    (resolvers, a swap-in, a reclaim) becomes a task, cancelled if the caller hangs up.
    """

    def __init__(self, server: SocketServer, expected: str | None = None) -> None:
        self.server = server
        self.arb = server.handler
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.op: int | None = None  # the request's op, once it is read
        self.work: asyncio.Future[Result] | None = None
        self.account: Account | None = None  # its container's (gpufrac.agent.arbiter.fairness)
        self.counted = False  # whether it counts among its container's requests in flight
        self.held = False  # past its container's connection limit: answered BUSY shortly
        # On a container's own socket: that booking's key (only its processes may ask there).
        self.expected = expected
        self.aborted = False  # closed (to make room) before its transport was made

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport; both have its methods.
        self.transport = cast(asyncio.Transport, transport)
        arb = self.arb
        if self.aborted:
            self.transport.abort()
            return
        if self.account is not None:  # counted by its container's listener when it was accepted
            self.server.connections.add(self)
            self.timer = asyncio.get_running_loop().call_later(arb.read_timeout, self._too_slow)
            return
        fair = arb.fairness
        self.account, victim, over = fair.admit(self, fair.container_of(transport.get_extra_info("socket")))
        if victim is not None:
            arb.stats.dropped += 1
            victim.abort()
        if self.account is None:  # the node is full: no at once
            self._busy()
            return
        self.server.connections.add(self)
        loop = asyncio.get_running_loop()
        if over:
            # Past its container's connection limit or rate (node-wide socket: every connection
            # must be accepted to be counted): no, a little later (Fairness.refuse_delay);
            # nothing it sends is read.
            self.held = True
            self.timer = loop.call_later(fair.refuse_delay(self.account), self._busy)
            return
        self.timer = loop.call_later(arb.read_timeout, self._too_slow)

    def _busy(self) -> None:
        """Answer BUSY (the caller's container is over its limits; nothing decided) and close."""
        self.arb.stats.busy += 1
        self.arb.metrics.count_arbiter_request("connection", "busy")
        assert self.transport is not None
        if not self.transport.is_closing():
            self.transport.write(wire.reply(wire.BURST_BUSY))
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self.op is not None or self.account is None or self.held:
            return  # one request per connection; anything after it is ignored
        self.buf += data
        if len(self.buf) < wire.REQUEST_SIZE:
            return
        assert self.transport is not None
        if self.timer is not None:
            self.timer.cancel()
        req = BurstRequest.from_buffer_copy(self.buf[: wire.REQUEST_SIZE])
        self.op = req.op
        if not self.arb.fairness.request(self.account):
            # Past its container's in-flight limit: no, nothing decided, REFUSE_DELAY
            # later (its connection counts meanwhile: a flood is slowed, not served faster).
            self.arb.stats.busy += 1
            self.held = True
            self.timer = asyncio.get_running_loop().call_later(
                REFUSE_DELAY, self._answer, (wire.BURST_BUSY, 0)
            )
            return
        try:
            out = self.arb.handle(req, self.transport.get_extra_info("socket"), self.expected)
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
        self.server.connections.discard(self)
        if self.account is not None:
            self._uncount()
            self.arb.fairness.gone(self.account, self)

    def _uncount(self) -> None:
        if self.counted and self.account is not None:
            self.counted = False
            self.account.inflight -= 1

    def abort(self) -> None:
        self._give_up()
        self.aborted = True
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
            self.arb.metrics.count_arbiter_request(wire.OP_NAMES.get(self.op or -1, "invalid"), "dropped")
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
        self.arb.metrics.count_arbiter_request(
            wire.OP_NAMES.get(self.op or -1, "invalid"), wire.STATUS_NAMES[status]
        )
        assert self.transport is not None
        if not self.transport.is_closing():
            self.transport.write(wire.reply(status, generation))
        self.transport.close()  # after the reply is flushed
