"""Waiting for a condition with a deadline: tests never sleep a fixed time to synchronise.

    from polling import until, until_async

    until(lambda: not proc_alive(pid), what="the watchdog's kill")          # plain code
    await until_async(lambda: cache.get(uid), what="the pod in the cache")  # on an event loop

Both return cond()'s first truthy value and fail the test (AssertionError naming `what`)
once `timeout` seconds pass. The default is generous: a loaded 2-core CI box, ASan builds.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
TIMEOUT = 120.0


def until(
    cond: Callable[[], T], timeout: float = TIMEOUT, what: str = "condition", interval: float = 0.02
) -> T:
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


async def until_async(
    cond: Callable[[], T],
    timeout: float = TIMEOUT,
    what: str = "condition",
    interval: float = 0.02,
    *,
    in_thread: bool = False,
) -> T:
    """On an event loop: cond() runs on the loop (it reads the loop's own state), or in a
    thread with in_thread=True (it blocks, e.g. a request to the apiserver)."""
    deadline = time.monotonic() + timeout
    while True:
        v: Any = await asyncio.to_thread(cond) if in_thread else cond()
        if v:
            return v  # type: ignore[no-any-return]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        await asyncio.sleep(interval)
