"""An agent served on its own event loop in a background thread (tests, the bench, the demo).

The thread's loop owns the agent's state as the process's loop does under `gpufrac agent`;
other threads reach it through call().
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Generic, Protocol, TypeVar

from gpufrac.core.eventloop import new_loop

T = TypeVar("T")


class Served(Protocol):
    """What the thread does with its agent (gpufrac.agent.main.Agent)."""

    async def serve(self, started: Callable[[], None]) -> None: ...
    def request_stop(self) -> None: ...


S = TypeVar("S", bound=Served)


class AgentThread(Generic[S]):
    """`agent` served on its own event loop in a background thread."""

    def __init__(self, agent: S) -> None:
        self.agent = agent
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._main, name="gpufrac-agent", daemon=True)
        self._ready = threading.Event()
        self._error: BaseException | None = None

    def _main(self) -> None:
        self.loop = new_loop()
        try:
            self.loop.run_until_complete(self.agent.serve(self._ready.set))
        except BaseException as e:
            self._error = e
            self._ready.set()
        finally:
            self.loop.close()

    def start(self, timeout: float = 60.0) -> AgentThread[S]:
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("agent did not start")
        if self._error is not None:
            raise self._error
        return self

    # Any: the coroutine's send and yield types, which call() neither uses nor constrains.
    def call(self, fn: Callable[[], Coroutine[Any, Any, T]] | Awaitable[T], timeout: float = 30.0) -> T:
        assert self.loop is not None

        async def run() -> T:
            return await (fn() if callable(fn) else fn)

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout)

    def stop(self, timeout: float = 30.0) -> None:
        if self.loop is not None and self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.agent.request_stop)
            self._thread.join(timeout)
