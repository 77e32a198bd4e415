"""The status socket's HTTP handling on its own (no agent behind it): a request over the size
limit is refused with 431, and the refusal reaches the client whole."""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
from collections.abc import Awaitable, Callable
from types import SimpleNamespace
from typing import Any, TypeVar

from gpufrac.agent.status.server import MAX_REQUEST, StatusServer

T = TypeVar("T")
TOO_LARGE = {"error": f"request too large: the limit is {MAX_REQUEST} bytes"}


async def ask(path: str, request: bytes) -> bytes:
    reader, writer = await asyncio.open_unix_connection(path)
    try:
        writer.write(request)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), 30)
    finally:
        writer.close()


def serve(test: Callable[[str], Awaitable[T]]) -> T:
    """Run `test(path)` against a StatusServer with no agent (a request that got as far as
    reading the status would fail with 500)."""

    async def main() -> T:
        with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
            nobody: Any = SimpleNamespace()
            server = await StatusServer(nobody, os.path.join(tmp, "status.sock")).start()
            try:
                return await test(server.path)
            finally:
                await server.stop()

    return asyncio.run(main())


def test_an_oversized_request_gets_its_431_every_time() -> None:
    """The rest of a refused request is still on its way when the reply is sent: the reply must
    reach the client anyway, not be lost to a connection reset."""

    async def test(path: str) -> list[bytes]:
        big_header = b"GET / HTTP/1.0\r\nX-Pad: " + b"a" * (4 * MAX_REQUEST) + b"\r\n\r\n"
        return [await ask(path, big_header) for _ in range(50)]

    for reply in serve(test):
        assert reply.startswith(b"HTTP/1.0 431"), reply[:100]
        assert json.loads(reply.split(b"\r\n\r\n", 1)[1]) == TOO_LARGE


def test_a_request_line_over_the_limit_is_refused_the_same_way() -> None:
    async def test(path: str) -> bytes:
        return await ask(path, b"GET /" + b"x" * MAX_REQUEST + b" HTTP/1.0\r\n\r\n")

    reply = serve(test)
    assert reply.startswith(b"HTTP/1.0 431"), reply
    assert json.loads(reply.split(b"\r\n\r\n", 1)[1]) == TOO_LARGE
