"""Per-container limits on the arbiter socket: one tenant cannot starve the others.

Without limits one container could hold every connection the agent may open
(slowloris), keep every request waiting, or keep the agent's loop busy answering it.
Each connection is counted against a container: on a container's own socket, that
container (a live process of another pod there is counted as on the node-wide socket);
on the node-wide socket, the
caller's container as the kernel names it (SO_PEERCRED -> /proc/<pid>/cgroup, as in
gpufrac.agent.processes.callers), never by its message:

* connections open at once (`connectionsPerContainer`), including ones that have
  not sent their request yet;
* requests being decided at once (`inflightPerContainer`): waiting in a resolver,
  a swap-in, a reclaim;
* connections per second (`requestsPerSecond`, a token bucket of `requestBurst`), each
  charged at its accept (`admit`), whether it ever sends a request or not: a connection
  costs the agent an accept, an identity lookup and a task before any request is read, so
  one that connects and closes at once (churn) is charged as one that asks. The request it
  carries is not charged again (one request per connection).

On a container's own socket (gpufrac.agent.arbiter.listeners) the agent stops accepting
while the container holds its connection limit, and while its bucket is empty (until the
next token, `token_wait`): its further connections wait in the kernel's listen queue, costing
the agent's loop nothing, and are taken as its connections close or its tokens come. A
container whose connections send nothing is so slowed at accept, never served faster than
its rate. The rest of this applies there too, and to the node-wide socket that containers
admitted by an older agent share, where every connection has to be accepted to be counted.

A caller over a limit there (and over the in-flight limit anywhere) gets BURST_BUSY (the
shim's "no") without any work done for it, REFUSE_DELAY later; its connection is held
meanwhile and counts as its container's: a flood that reconnects as soon as it is answered
is slowed down instead of keeping the agent busy refusing it. When the node-wide cap
(`maxConnections`, file descriptors) is reached, the newest connection still
waiting for its request (or held) in the container that holds the most
connections is closed to make room, unless the newcomer belongs to that
container, which is then refused at once: a crowd of containers shares the
node's connections evenly.

The cap only holds if the agent may open that many files: a container runtime may start
it with a soft RLIMIT_NOFILE of 1024, and past it accept() fails (EMFILE), the loop stops
accepting for a while and the agent cannot open its own files either. So the arbiter
raises its soft limit to the cap plus FD_RESERVE at start, and where the hard limit is
lower, lowers the cap to fit (fit_fd_limit, Fairness.fit_fd_limit), saying so.

Callers outside any kubelet container (the agent's own tools) share one account.
Each container's refusals are logged at most once per LOG_EVERY seconds (with the
count since) and counted in gpufrac_arbiter_limited_total{limit}.
"""

from __future__ import annotations

import logging
import resource
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from gpufrac.agent.processes.callers import PeerError
from gpufrac.agent.processes.knowncallers import KnownCallers

log = logging.getLogger(__name__)

LOG_EVERY = 60.0  # seconds between two log lines about one container's refusals
PRUNE_EVERY = 10.0  # seconds between two sweeps of idle accounts
# A connection past its container's limit is answered BUSY this much later: a flooder that
# reconnects as soon as it is answered is slowed to its limit's worth of connections per
# REFUSE_DELAY, instead of keeping the agent busy refusing it.
REFUSE_DELAY = 1.0
OUTSIDE = "outside-containers"  # the account of callers in no kubelet container
LIMITS = ("connections", "inflight", "rate", "node")
# Files the agent keeps open besides arbiter connections (gRPC, the apiserver, NVML, usage
# and config files, one listening socket per container, pidfds while reading the driver's
# processes, logs): the node cap leaves them this many under the file limit.
FD_RESERVE = 1024
# How far a connection's BUSY may be put off (Fairness.refuse_delay), in REFUSE_DELAYs: a
# container that opened too many at once for a moment still hears within this.
MAX_STRETCH = 10


def fit_fd_limit(want: int, soft: int, hard: int) -> tuple[int, int]:
    """(the soft RLIMIT_NOFILE to set, the node connection cap that fits it) for a wanted
    cap of `want` connections under limits (soft, hard)."""
    need = want + FD_RESERVE
    if soft == resource.RLIM_INFINITY or soft >= need:
        return soft, want
    new_soft = need if hard == resource.RLIM_INFINITY or hard >= need else hard
    return new_soft, max(1, min(want, new_soft - FD_RESERVE))


class Conn(Protocol):
    """One open connection on the arbiter socket (gpufrac.agent.arbiter.server.Connection)."""

    @property
    def op(self) -> int | None: ...  # its request's op, None while none was read

    def abort(self) -> None: ...


class Pausable(Protocol):
    """A container's own listening socket (gpufrac.agent.arbiter.listeners.Listener)."""

    def resume(self) -> None: ...


class Limits(Protocol):
    """The node config's arbiterLimits (gpufrac.core.config)."""

    @property
    def connections_per_container(self) -> int: ...
    @property
    def inflight_per_container(self) -> int: ...
    @property
    def requests_per_second(self) -> float: ...
    @property
    def request_burst(self) -> int: ...
    @property
    def max_connections(self) -> int: ...


class LimitMetrics(Protocol):
    """Where refusals are counted (gpufrac.agent.metrics.Metrics)."""

    def count_arbiter_limited(self, limit: str) -> None: ...


class LimitsConfig(Protocol):
    @property
    def arbiter_limits(self) -> Limits: ...


@dataclass
class Account:
    """One container's use of the arbiter socket."""

    key: str
    connections: list[Conn] = field(default_factory=list)  # its open connections, oldest first
    inflight: int = 0
    tokens: float = 0.0
    refill_at: float = 0.0
    refused: int = 0  # refusals since the last log line
    logged_at: float = float("-inf")


class Fairness:
    """The arbiter's per-container accounts (on the agent's loop)."""

    def __init__(
        self,
        *,
        connections: int,
        inflight: int,
        rate: float,
        burst: int,
        node_connections: int,
        proc: str = "/proc",
        metrics: LimitMetrics,
    ) -> None:
        self.max_connections = connections
        self.max_inflight = inflight
        self.rate = rate
        self.burst = burst
        self.node_connections = node_connections
        self.proc = proc
        self.metrics = metrics
        self.accounts: dict[str, Account] = {}
        self.open = 0  # connections node-wide
        self._pruned_at = time.monotonic()
        self.known = KnownCallers(proc)  # callers' containers, kept while their process lives
        # Containers' own sockets not accepting until one of their connections closes (at their
        # connection limit), or until one closes anywhere (at the node cap): by account key.
        self.paused: dict[str, Pausable] = {}
        self.paused_at_node: dict[str, Pausable] = {}
        # How the log names an account of a container's own socket (keyed by its booking):
        # its pod and container, once known (gpufrac.agent.booking.ledger.ContainerAlloc.who).
        self.names: dict[str, Callable[[], str]] = {}

    @classmethod
    def from_config(cls, config: LimitsConfig, proc: str = "/proc", *, metrics: LimitMetrics) -> Fairness:
        lim = config.arbiter_limits
        return cls(
            connections=lim.connections_per_container,
            inflight=lim.inflight_per_container,
            rate=lim.requests_per_second,
            burst=lim.request_burst,
            node_connections=lim.max_connections,
            proc=proc,
            metrics=metrics,
        )

    def fit_fd_limit(self) -> None:
        """Raise this process's soft file limit for the node cap, or lower the cap to fit the
        hard limit (said once, naming the key, its value and why)."""
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        new_soft, cap = fit_fd_limit(self.node_connections, soft, hard)
        if new_soft != soft:
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (new_soft, hard))
            except (OSError, ValueError) as e:
                new_soft, cap = soft, max(1, min(self.node_connections, soft - FD_RESERVE))
                log.warning("arbiter: cannot raise the file limit from %d to %d: %s", soft, new_soft, e)
        if cap < self.node_connections:
            log.warning(
                "arbiterLimits.maxConnections: %d lowered to %d: this process may open %d files "
                "(RLIMIT_NOFILE hard limit %d) and keeps %d for its own",
                self.node_connections,
                cap,
                new_soft,
                hard,
                FD_RESERVE,
            )
            self.node_connections = cap

    def container_of(self, sock: socket.socket) -> str:
        """The caller's account key: its kubelet container as the kernel names it."""
        try:
            ident = self.known.identify(sock)
        except (PeerError, OSError):
            return OUTSIDE  # it will be refused when it asks; until then it counts as outside
        if ident is None:
            return OUTSIDE
        return f"{ident.pod_uid}/{ident.container_id}"

    def account(self, key: str) -> Account:
        acc = self.accounts.get(key)
        if acc is None:
            acc = self.accounts[key] = Account(key, tokens=float(self.burst), refill_at=time.monotonic())
        return acc

    def admit(self, conn: Conn, key: str) -> tuple[Account | None, Conn | None, bool]:
        """Count a new connection of container `key`, and charge it a token of its rate: (its
        account, or None when it is to be refused at once; a connection of the heaviest
        container to close to make room, or None; whether it is over its container's
        connection limit or rate, to be answered BUSY after REFUSE_DELAY). A held connection
        counts as its container's until it is closed."""
        self._prune()
        acc = self.account(key)
        over = len(acc.connections) >= self.max_connections
        if over:
            self.refuse(acc, "connections")
        elif not self._take_token(acc):
            over = True
            self.refuse(acc, "rate")
        victim = None
        if self.open >= self.node_connections:
            heaviest, victim = self._victim(acc)
            if victim is None:
                if not over:
                    self.refuse(acc, "node")
                return None, None, over
            self.refuse(heaviest, "node")
            # Counted out now, not when its close is seen (a later loop turn, or never for a
            # connection whose transport is not made yet): the next newcomer in this turn must
            # find the node full again, not the same victim. No socket is woken for the place:
            # the newcomer takes it.
            self._forget(heaviest, victim, wake=False)
        acc.connections.append(conn)
        self.open += 1
        return acc, victim, over

    def _victim(self, acc: Account) -> tuple[Account, Conn | None]:
        """The connection to close to make room for one of `acc` at the node cap: the newest
        not yet read of the container holding the most, if that holds at least two more than
        `acc` (one more, and the two would take the place from each other without end)."""
        heaviest = max(self.accounts.values(), key=lambda a: len(a.connections))
        # Looked for only when the newcomer is not the heaviest's, newest first: the
        # heaviest reconnecting at the cap must cost one comparison, not a walk over
        # its thousands of connections each time.
        if heaviest is not acc and len(heaviest.connections) >= len(acc.connections) + 2:
            return heaviest, next((c for c in reversed(heaviest.connections) if c.op is None), None)
        return heaviest, None

    def room_for(self, acc: Account) -> bool:
        """Whether a new connection of `acc` would be admitted under the node cap."""
        return self.open < self.node_connections or self._victim(acc)[1] is not None

    def refuse_delay(self, acc: Account) -> float:
        """How long a connection past its container's connection limit is held before its BUSY:
        REFUSE_DELAY, stretched in proportion to how many the container holds past its limit
        (up to MAX_STRETCH times), so that a flood reconnecting as soon as it is answered
        makes the loop accept, identify and answer about its limit's worth of connections per
        REFUSE_DELAY, not every connection it holds (each costs the loop, for nothing)."""
        past = len(acc.connections) - self.max_connections
        return REFUSE_DELAY * min(float(MAX_STRETCH), max(1.0, past / max(1, self.max_connections)))

    def at_limit(self, acc: Account) -> bool:
        """Whether a container holds as many connections as it may."""
        return len(acc.connections) >= self.max_connections

    def pause(self, acc: Account, listener: Pausable, *, node: bool, count: bool = True) -> None:
        """A container's own socket stops accepting until it is under its connection limit
        (node=False) or the node under its cap (node=True); `count`: counted and logged as a
        refusal (not again when it was woken and found no room, having accepted nothing)."""
        (self.paused_at_node if node else self.paused)[acc.key] = listener
        if count:
            self.refuse(acc, "node" if node else "connections")

    def forget_socket(self, key: str) -> None:
        """A container's socket is closed: nothing is to resume it, or name its account."""
        self.paused.pop(key, None)
        self.paused_at_node.pop(key, None)
        self.names.pop(key, None)

    def close(self) -> None:
        self.known.close()

    def gone(self, acc: Account, conn: Conn) -> None:
        """A connection closed (its second report, after a victim's early one, is ignored)."""
        self._forget(acc, conn)

    def _forget(self, acc: Account, conn: Conn, *, wake: bool = True) -> None:
        # By identity (list.remove compares with ==): a second report must find nothing.
        at = next((i for i, c in enumerate(acc.connections) if c is conn), None)
        if at is None:
            return
        del acc.connections[at]
        self.open -= 1
        if not wake:
            return
        # Sockets waiting for room check it again before they accept (Listener._readable):
        # all are woken, one takes the place, the others pause again without accepting.
        if acc.key in self.paused and len(acc.connections) < self.max_connections:
            self.paused.pop(acc.key).resume()
        if self.paused_at_node and self.open < self.node_connections:
            waiting, self.paused_at_node = self.paused_at_node, {}
            for listener in waiting.values():
                listener.resume()

    def _prune(self) -> None:
        """Forget accounts with nothing open, a full bucket and no recent report: kept any
        shorter, a caller that opens one connection at a time would start each with a full
        bucket and a fresh report."""
        now = time.monotonic()
        if now - self._pruned_at < PRUNE_EVERY:
            return
        self._pruned_at = now
        full = self.burst / self.rate if self.rate > 0 else 0.0
        for key in [
            k
            for k, a in self.accounts.items()
            if not a.connections
            and a.inflight == 0
            and now - a.refill_at >= full
            and now - a.logged_at >= LOG_EVERY
        ]:
            del self.accounts[key]

    def _refill(self, acc: Account) -> None:
        now = time.monotonic()
        acc.tokens = min(float(self.burst), acc.tokens + (now - acc.refill_at) * self.rate)
        acc.refill_at = now

    def _take_token(self, acc: Account) -> bool:
        """Charge one connection to the container's rate: whether its bucket had a token."""
        self._refill(acc)
        if acc.tokens < 1.0:
            return False
        acc.tokens -= 1.0
        return True

    def token_wait(self, acc: Account, want: int = 1) -> float:
        """0 when the container's bucket holds a token for its next connection; else seconds
        until it holds `want` (at most a full bucket), for a container's own socket not to be
        accepted from meanwhile (Listener): woken once for several, not once per token."""
        self._refill(acc)
        if acc.tokens >= 1.0:
            return 0.0
        return (min(float(want), float(self.burst)) - acc.tokens) / self.rate

    def request(self, acc: Account) -> bool:
        """Whether a request that has just arrived may be served (the in-flight limit; its
        connection paid its rate at the accept)."""
        if acc.inflight >= self.max_inflight:
            self.refuse(acc, "inflight")
            return False
        return True

    def refuse(self, acc: Account, limit: str) -> None:
        self.metrics.count_arbiter_limited(limit)
        acc.refused += 1
        now = time.monotonic()
        if now - acc.logged_at >= LOG_EVERY:
            log.warning(
                "arbiter: %s is over its %s limit (%s); refused %d request(s) or "
                "connection(s) since the last report (next report in %.0fs at the earliest)",
                self.names[acc.key]() if acc.key in self.names else f"container {acc.key}",
                limit,
                self.describe(limit),
                acc.refused,
                LOG_EVERY,
            )
            acc.logged_at = now
            acc.refused = 0

    def describe(self, limit: str) -> str:
        return {
            "connections": f"{self.max_connections} open connections",
            "inflight": f"{self.max_inflight} requests being decided",
            "rate": f"{self.rate:g} connections/s, bursts of {self.burst}",
            "node": f"{self.node_connections} connections on the node, shared evenly",
        }[limit]
