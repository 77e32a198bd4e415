"""A socket of its own for each container: the agent stops accepting one container's flood.

Each booked container's host directory holds `arbiter/arbiter.sock` (gpufrac.memguard.abi
SOCKET_DIR, SOCKET_FILE), which the device plugin mounts read-only at the same place in the
container: the shim connects there, as it did to the node-wide socket. What a socket per
container buys is that the agent may stop accepting one container alone. While a container
holds its connection limit (gpufrac.agent.arbiter.fairness), its socket is taken off the loop: its
further connections wait in the kernel's listen queue and then in connect() in its own
processes, and cost the agent's loop nothing until one of its connections closes. Likewise
while its rate has no token for another connection (each is charged one at its accept), until
the next token comes: connections that send nothing are slowed at accept, not served. On the
node-wide socket every such connection had to be accepted, identified and refused, one at a
time, on the loop every neighbour's grant waits for.

A connection on a container's socket is counted against that container's account once the
kernel places the connecting process in the container's pod (its cgroup read once per
process, gpufrac.agent.processes.knowncallers): a process of another pod that reaches the socket (a
hostPath, a mount gone wrong) is counted against its own container, as on the node-wide
socket, and uses none of this container's connections or request rate. Each request is
still identified by the kernel (SO_PEERCRED -> cgroup) and refused when the caller is not that container
(gpufrac.agent.arbiter.service.Arbiter.handle). At the node cap (`maxConnections`) a socket
is not accepted from unless the connection can be admitted (the heaviest container's silent
connection making room); sockets waiting for room are woken when any connection closes, and
check again before they accept.

The sockets follow the ledger: one is bound when a booking's directory is written
(Ledger.attach, also after a restart: a directory mount shows the socket bound anew) and
closed when the booking is released (its directory is deleted with the socket file in it).
A socket is bound on the loop, inside Allocate: an unlink, a bind and a chmod, tens of
microseconds; a rollback to an agent without container sockets leaves such containers
without an arbiter (their bursts refused) until they are recreated.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import socket
from collections.abc import Callable, Iterable
from typing import Protocol

from gpufrac.agent.arbiter.fairness import Fairness
from gpufrac.agent.arbiter.server import Connection, SocketServer, listening_socket
from gpufrac.agent.processes.callers import PeerError
from gpufrac.memguard import abi, wire

log = logging.getLogger(__name__)

# Connections taken per wake-up of a socket: a container whose processes connect at once is
# served in turns with the other sockets, not drained before anyone else runs.
ACCEPT_BATCH = 16
# After accept() fails for a reason other than an empty queue (the file limit, memory), the
# socket rests this long: retrying at once would spin the loop.
ACCEPT_RETRY = 1.0


def socket_path(directory: str) -> str:
    """A container's own socket, under its host directory (where gpufrac.memguard.wire.socket_path
    finds it inside the container, through the mount)."""
    return os.path.join(directory, abi.SOCKET_DIR, abi.SOCKET_FILE)


class Booked(Protocol):
    """A booking as the ledger holds it (gpufrac.agent.booking.ledger.ContainerAlloc)."""

    @property
    def key(self) -> str: ...
    @property
    def directory(self) -> str: ...
    @property
    def pod_uid(self) -> str | None: ...  # None until the pod is known
    @property
    def consumers(self) -> frozenset[tuple[str, str]]: ...  # a claim's: (pod UID, container)
    def who(self) -> str: ...


class Listener:
    """One container's listening socket, accepting while its container is under its limits."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        server: SocketServer,
        fairness: Fairness,
        alloc: Booked,
        path: str,
        backlog: int,
    ) -> None:
        key = alloc.key
        self.alloc = alloc
        self.server = server
        self.fairness = fairness
        self.key = key
        self.path = path
        self.accepted = 0  # connections taken (tests and the bench read it)
        self.slowed = 0  # times it stopped accepting for its container's rate (tests, the bench)
        self.paused = False
        self._pause_counted = False  # no second refusal counted for a pause until one is accepted
        self._loop = loop
        self._retry: asyncio.TimerHandle | None = None
        self._token: asyncio.TimerHandle | None = None  # resumes it when its rate has a token again
        self._closed = False
        sock = listening_socket(path, backlog)
        sock.setblocking(False)
        self.sock = sock
        fairness.names[key] = alloc.who
        self._loop.add_reader(sock.fileno(), self._readable)

    def _readable(self) -> None:
        fair = self.fairness
        for _ in range(ACCEPT_BATCH):
            # Room is checked before accept(): a connection there is no room for stays in the
            # kernel's queue, costing the loop nothing, and is taken once there is room.
            acc = fair.account(self.key)
            if fair.at_limit(acc) or not fair.room_for(acc):
                self._pause()
                fair.pause(acc, self, node=not fair.at_limit(acc), count=not self._pause_counted)
                self._pause_counted = True
                return
            wait = fair.token_wait(acc, ACCEPT_BATCH)
            if wait > 0:
                # Each connection is charged a token at its accept (Fairness.admit): past its rate
                # a container's connections wait in the kernel until its tokens come (a batch's
                # worth: one wake-up for several), whether they would ask anything or not
                # (connect-and-close churn costs it, not the loop).
                self._pause()
                if self._token is not None:
                    self._token.cancel()
                self._token = self._loop.call_later(wait, self.resume)
                if not self._pause_counted:
                    fair.refuse(acc, "rate")
                    self._pause_counted = True
                self.slowed += 1
                return
            try:
                conn_sock, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                self._rest(e)
                return
            if not self._from_its_pod(conn_sock):
                # Counted against the caller's own container, as on the node-wide socket (its
                # limits, not this container's, hold it back), and its request refused when read.
                self._start(Connection(self.server, expected=self.key), conn_sock)
                continue
            conn = Connection(self.server, expected=self.key)
            admitted, victim, _ = fair.admit(conn, self.key)
            if victim is not None:
                self.server.handler.stats.dropped += 1
                victim.abort()
            if admitted is None:  # not after room_for; kept safe all the same
                self._busy_at_once(conn_sock)
                self._pause()
                fair.pause(acc, self, node=True)
                return
            conn.account = admitted
            self.accepted += 1
            self._pause_counted = False
            self._start(conn, conn_sock)

    def _from_its_pod(self, sock: socket.socket) -> bool:
        """Whether the kernel places the connecting process in this container's pod (the cgroup
        read once per process, gpufrac.agent.processes.knowncallers). A process of another pod that
        reaches this socket (a hostPath, a mount gone wrong) must not use this container's
        connections or request rate. Every request is identified when it is read, and refused
        unless it is this container's (gpufrac.agent.arbiter.service.Arbiter.handle)."""
        # A claim's booking serves the containers of every pod that uses the claim.
        pods = {uid for uid, _ in self.alloc.consumers}
        if not pods:
            if not self.alloc.pod_uid:
                return True
            pods = {self.alloc.pod_uid}
        try:
            ident = self.fairness.known.identify(sock)
        except (PeerError, OSError):
            # Gone already (a connector that handed its socket on and exited), or its cgroup
            # file refused (nested past PATH_MAX: never searched for, gpufrac.agent.processes.callers):
            # charged here, or a container could connect from such processes past its own
            # limit. Its request is refused when it is read.
            return True
        return ident is not None and ident.pod_uid in pods

    def _start(self, conn: Connection, sock: socket.socket) -> None:
        """The connection's transport (uvloop's or asyncio's), made in a task of its own."""

        def made(task: asyncio.Task[tuple[asyncio.BaseTransport, Connection]]) -> None:
            if task.cancelled() or task.exception() is not None:
                # No transport: the connection never started; its place is given back.
                sock.close()
                if conn.account is not None:
                    self.fairness.gone(conn.account, conn)

        self._loop.create_task(self._loop.connect_accepted_socket(lambda: conn, sock)).add_done_callback(made)

    def _busy_at_once(self, sock: socket.socket) -> None:
        """BUSY on a fresh connection, without a transport (it fits any socket buffer)."""
        self.server.handler.stats.busy += 1
        self.server.handler.metrics.count_arbiter_request("connection", "busy")
        with contextlib.suppress(OSError):
            sock.setblocking(False)
            sock.send(wire.reply(wire.BURST_BUSY))
        sock.close()

    def _pause(self) -> None:
        if not self.paused and not self._closed:
            self.paused = True
            self._loop.remove_reader(self.sock.fileno())

    def resume(self) -> None:
        if self.paused and not self._closed:
            self.paused = False
            self._loop.add_reader(self.sock.fileno(), self._readable)

    def _rest(self, e: OSError) -> None:
        log.warning(
            "arbiter: cannot accept on %s (%s); trying again in %.0f s",
            self.path,
            errno.errorcode.get(e.errno or 0, e),
            ACCEPT_RETRY,
        )
        self._pause()
        self._retry = self._loop.call_later(ACCEPT_RETRY, self.resume)

    def close(self) -> None:
        """Stop accepting. Connections already taken are the server's (closed with it)."""
        if self._closed:
            return
        if not self.paused:
            self._loop.remove_reader(self.sock.fileno())
        self._closed = True
        for timer in (self._retry, self._token):
            if timer is not None:
                timer.cancel()
        self.fairness.forget_socket(self.key)
        self.sock.close()


class ContainerSockets:
    """Every booked container's Listener, kept in step with the ledger (on the agent's loop)."""

    def __init__(self, server: SocketServer, fairness: Fairness, backlog: int) -> None:
        self.server = server
        self.fairness = fairness
        self.backlog = backlog
        self.listeners: dict[str, Listener] = {}
        self._loop: asyncio.AbstractEventLoop | None = None  # the agent's, from open_all on
        self._closed = False

    def open(self, alloc: Booked) -> None:
        """Bind the booking's socket (again: after a restart, or its key booked anew). A
        failure is logged: that container's bursts are refused, everything else goes on."""
        if self._closed or self._loop is None:  # the arbiter has stopped, or not started
            return
        old = self.listeners.pop(alloc.key, None)
        if old is not None:
            old.close()
        path = socket_path(alloc.directory)
        try:
            if not os.path.isdir(os.path.dirname(path)):  # booked by an older agent
                os.mkdir(os.path.dirname(path))
                os.chmod(os.path.dirname(path), 0o755)  # container processes run as any uid
            listener = Listener(self._loop, self.server, self.fairness, alloc, path, self.backlog)
            self.listeners[alloc.key] = listener
        except OSError as e:
            log.error("arbiter: cannot listen on %s for %s: %s (its bursts are refused)", path, alloc.key, e)

    def open_all(self, allocs: Iterable[Booked], attached: Callable[[str], bool]) -> None:
        """At the arbiter's start, on the agent's loop: every booked container's socket."""
        self._loop = asyncio.get_running_loop()
        for alloc in allocs:
            if attached(alloc.key):
                self.open(alloc)

    def sync(self, booked: Callable[[str], object | None]) -> None:
        """Close the sockets of containers no longer booked (`booked(key)` is None)."""
        for key in [k for k in self.listeners if booked(k) is None]:
            self.listeners.pop(key).close()

    def close(self) -> None:
        self._closed = True
        for listener in self.listeners.values():
            listener.close()
        self.listeners.clear()
