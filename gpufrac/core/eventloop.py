"""The agent's event loop: uvloop when it is installed, else asyncio's own.

One loop runs the whole agent (docs/architecture.md). uvloop (libuv) runs the same
asyncio programs with a faster accept/read/write path, which is most of a burst
grant's cost: the arbiter takes one connection per request. Everything in the agent
uses only the asyncio API, so both loops run it; tests and benches build their
agent loops here too, so what they exercise is what the DaemonSet runs.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")


def new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        log.info("uvloop is not installed: the agent runs on asyncio's default loop")
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def run(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run on the agent's loop (asyncio.run's loop_factory needs Python 3.12)."""
    loop = new_loop()
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(main)
    finally:
        try:
            _cancel_all(loop)
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
        finally:
            asyncio.set_event_loop(None)
            loop.close()


def _cancel_all(loop: asyncio.AbstractEventLoop) -> None:
    tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for t in tasks:
        t.cancel()
    if tasks:
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
