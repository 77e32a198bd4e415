"""Who is served first on a GPU: the waiter queue and the claims.

Per GPU, requests are served by priority, then arrival (FIFO). Nobody is granted while a
request ranks ahead of it that is still to be served: a claim (a need an eviction or a swap is
freeing memory for right now: memory a resolver wins goes to the requester that caused it
first), a guarantee being reclaimed, or a waiter. A waiter holds back those behind it only
for the first `bound` seconds of THEIR wait (the node's headOfLineBound): a request that
cannot be served, however long it may wait itself, and however many of them are queued ahead
(one container's, or many), costs a request that fits at most that long. Within it, memory
freed goes to the head first: a big request is not overtaken by a stream of small ones the
moment they come. Every release wakes the waiters of its GPU at once (notify); no polling
period, except while someone waits on memory freed outside the agent (a process exiting, a
kill), which only a new NVML reading shows, or for its bound to pass.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from gpufrac.agent.arbiter.resolvers import Need

LAST = float("inf")  # the queue order's arrival part for a request not yet queued


@dataclass
class Waiter:
    need: Need
    done: asyncio.Future[bool] = field(default_factory=lambda: asyncio.get_running_loop().create_future())

    @property
    def order(self) -> tuple[int, int]:
        return self.need.order


class WaitQueue:
    """Waiters and claims per GPU. `refresh_soon` asks for a new NVML reading (it notifies
    when done); `poll` is how often one is asked for while anyone waits; `timed_out` is told
    of each wait that ran out; `bound`: how long a waiter ahead holds a request back."""

    def __init__(
        self, refresh_soon: Callable[[], None], poll: float, timed_out: Callable[[], None], bound: float
    ) -> None:
        self._refresh_soon = refresh_soon
        self._poll = poll
        self._timed_out = timed_out
        self._bound = bound
        self.waiters: dict[str, list[Waiter]] = {}
        self.claims: dict[str, list[Need]] = {}  # per GPU: needs a resolver is freeing memory for
        self._notifying = False
        self._renotify: set[str] = set()

    def ahead(
        self, gpu: str, order: tuple[int, float], need: Need | None = None, since: float | None = None
    ) -> bool:
        """Whether another request is to be served on `gpu` before one of queue `order`
        (Need.order; a request not yet queued comes last among its priority): a claim (a
        need a resolver is freeing memory for), a guarantee being reclaimed, or a waiter not
        yet served that ranks ahead. A claim's own need ranks ahead of every waiter: what was
        won for it is its first. `since`: when the asking request came (time.monotonic(),
        None: now); once it has been held back `bound` seconds, waiters of bursts and swap-ins
        ahead of it no longer count: they cannot be served, or they would have been (notify
        tries them first)."""
        claims = self.claims.get(gpu, ())
        if any(c is need for c in claims):
            return any(c.order < order for c in claims if c is not need)
        if any(c.order < order for c in claims):
            return True
        held = since is None or time.monotonic() - since < self._bound
        return any(
            w.order < order and not w.done.done() and (held or w.need.kind == "reclaim")
            for w in self.waiters.get(gpu, ())
        )

    @contextlib.contextmanager
    def claim(self, need: Need) -> Iterator[None]:
        """While a resolver frees memory for `need` (evicts, swaps), nobody who ranks below it
        is granted on its GPU, and it ranks ahead of every waiter: the resolver tries its grant
        before the claim ends, and only then are the waiters woken."""
        claims = self.claims.setdefault(need.gpu, [])
        claims.append(need)
        try:
            yield
        finally:
            claims[:] = [c for c in claims if c is not need]
            if not claims:
                self.claims.pop(need.gpu, None)
            self.notify(need.gpu)

    def notify(self, gpu: str) -> None:
        """Something was freed on `gpu`: grant waiters in order, each if it fits and nobody
        ahead still holds it back (`ahead`, through its try_grant)."""
        if self._notifying:
            self._renotify.add(gpu)
            return
        self._notifying = True
        try:
            pending = {gpu}
            while pending:
                g = pending.pop()
                waiters = self.waiters.get(g)
                if waiters:
                    # Not stopping at a head that does not fit: one behind it held back for
                    # its bound goes past it (its try_grant asks `ahead`).
                    for w in list(waiters):
                        if not w.done.done() and w.need.try_grant():
                            w.done.set_result(True)
                    waiters[:] = [w for w in waiters if not w.done.done()]
                pending |= self._renotify
                self._renotify.clear()
        finally:
            self._notifying = False

    def notify_all(self) -> None:
        for gpu in list(self.waiters):
            self.notify(gpu)

    def has_waiters(self, gpu: str) -> bool:
        return bool(self.waiters.get(gpu))

    async def wait_turn(self, need: Need) -> bool:
        """Queue the need on its GPU until notify() grants it or its deadline passes."""
        w = Waiter(need)
        waiters = self.waiters.setdefault(need.gpu, [])
        waiters.append(w)
        waiters.sort(key=lambda x: x.order)
        self.notify(need.gpu)  # it may fit already (something was freed since the first try)
        loop = asyncio.get_running_loop()
        try:
            # Releases through the agent wake waiters at once (notify). Memory freed any other
            # way (a process exiting, a kill) shows only in NVML, which has no event to wait
            # on: while anyone waits, take a new reading every `poll` seconds (its notify also
            # serves a waiter whose head-of-line bound has passed meanwhile).
            while not w.done.done():
                left = need.deadline - loop.time()
                if left <= 0:
                    self._timed_out()
                    return need.granted
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(asyncio.shield(w.done), min(left, self._poll))
                if not w.done.done():
                    self._refresh_soon()
            return w.done.result()
        finally:
            if w in waiters:
                waiters.remove(w)
                self.notify(need.gpu)  # the head left: those behind may fit
            if not waiters:
                self.waiters.pop(need.gpu, None)

    def close(self) -> None:
        """A stopping agent grants nothing: every waiter is answered no."""
        for waiters in self.waiters.values():
            for w in waiters:
                if not w.done.done():
                    w.done.set_result(False)
        self.waiters.clear()
