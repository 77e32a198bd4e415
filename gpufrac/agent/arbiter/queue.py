"""Who is served first on a GPU: the waiter queue and the claims.

Per GPU, nobody is granted while a request ranks ahead of it: a waiter of higher priority,
or of equal priority that came first (FIFO), or a request for which an eviction or a swap is
freeing memory right now (a claim): memory a resolver wins goes to the requester that caused
it first, then to the queue. Every release wakes the waiters of its GPU at once (notify); no
polling period, except while someone waits on memory freed outside the agent (a process
exiting, a kill), which only a new NVML reading shows.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from gpufrac.agent.resolvers import Need

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
    of each wait that ran out."""

    def __init__(self, refresh_soon: Callable[[], None], poll: float, timed_out: Callable[[], None]) -> None:
        self._refresh_soon = refresh_soon
        self._poll = poll
        self._timed_out = timed_out
        self.waiters: dict[str, list[Waiter]] = {}
        self.claims: dict[str, list[Need]] = {}  # per GPU: needs a resolver is freeing memory for
        self._notifying = False
        self._renotify: set[str] = set()

    def ahead(self, gpu: str, order: tuple[int, float], need: Need | None = None) -> bool:
        """Whether another request is to be served on `gpu` before one of queue `order`
        (Need.order; a request not yet queued comes last among its priority): a claim (a
        need a resolver is freeing memory for) or a waiter not yet served that ranks ahead.
        A claim's own need ranks ahead of every waiter: what was won for it is its first."""
        claims = self.claims.get(gpu, ())
        if any(c is need for c in claims):
            return any(c.order < order for c in claims if c is not need)
        if any(c.order < order for c in claims):
            return True
        return any(w.order < order and not w.done.done() for w in self.waiters.get(gpu, ()))

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
        """Something was freed on `gpu`: grant waiters in order while they fit."""
        if self._notifying:
            self._renotify.add(gpu)
            return
        self._notifying = True
        try:
            pending = {gpu}
            while pending:
                g = pending.pop()
                waiters = self.waiters.get(g)
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
            # on: while anyone waits, take a new reading every `poll` seconds.
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
