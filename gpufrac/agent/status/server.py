"""The status endpoint: GET / returns the node's status as JSON, on a unix socket (config
statusSocket), for `gpufrac status` and `curl --unix-socket`. It has no write operation.

Served by the same HTTP stack as /metrics (gpufrac.agent.status.httpd), in its own threads: each
request takes a snapshot on the agent's loop (capture) and reads NVML and the usage files
in its thread (enrich).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import os
import socket
import stat
import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from gpufrac.agent.status.capture import Observed, capture_threadsafe
from gpufrac.agent.status.enrich import enrich
from gpufrac.agent.status.httpd import QuietHandler, Served, serve_unix

if TYPE_CHECKING:  # typeshed's WSGI types (wsgiref.types is Python 3.11+): annotations only
    from _typeshed.wsgi import StartResponse, WSGIEnvironment

log = logging.getLogger(__name__)

# Request heads bigger than this are refused with 431 (a status query is one line): the
# agent never buffers more of one.
MAX_REQUEST = 8192
REQUEST_TIMEOUT = 5.0
# What the agent reads and drops of a refused request before it closes the connection.
DRAIN_LIMIT = 1 << 20
TOO_LARGE = json.dumps({"error": f"request too large: the limit is {MAX_REQUEST} bytes"}).encode()


class _HeadLimit(io.BufferedIOBase):
    """The request stream, cut off after MAX_REQUEST bytes of head: http.server's request and
    header parsing read through it, and `over` says whether it was cut."""

    def __init__(self, raw: io.BufferedIOBase) -> None:
        super().__init__()
        self.raw_stream = raw
        self.left = MAX_REQUEST
        self.over = False

    def readable(self) -> bool:
        return True

    def readline(self, size: int | None = -1, /) -> bytes:
        want = self.left if size is None or size < 0 else min(size, self.left)
        if want <= 0:
            self.over = self.over or self.left <= 0
            return b""
        line = self.raw_stream.readline(want)
        self.left -= len(line)
        if self.left <= 0 and not line.endswith(b"\n"):
            self.over = True  # a line the limit cut
        return line


class _Handler(QuietHandler):
    """One request: its head read through _HeadLimit within REQUEST_TIMEOUT (a client that
    trickles it in is hung up on then), each later read or write within REQUEST_TIMEOUT."""

    timeout = REQUEST_TIMEOUT

    def setup(self) -> None:
        super().setup()
        self.head = _HeadLimit(self.rfile)
        self.rfile = self.head
        self.hung_up = False
        self.head_deadline = threading.Timer(REQUEST_TIMEOUT, self._hang_up)
        self.head_deadline.daemon = True
        self.head_deadline.start()

    def _hang_up(self) -> None:
        self.hung_up = True
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)  # the blocked read returns: no request

    def parse_request(self) -> bool:
        if self.head.over:  # the request line alone passed the limit
            self.head_deadline.cancel()
            self.requestline, self.request_version, self.command = "", "", ""
            self._too_large()
            return False
        ok = super().parse_request()  # reads the headers
        self.head_deadline.cancel()  # the head is in (or cut): the rest has the socket timeout
        if self.hung_up:
            return False
        if ok and self.head.over:
            self._too_large()
            return False
        self.rfile = self.head.raw_stream  # a body, if any, is the app's to read (it reads none)
        return ok

    def finish(self) -> None:
        self.head_deadline.cancel()
        super().finish()

    def _too_large(self) -> None:
        self.close_connection = True
        self.send_response(431, "Request Header Fields Too Large")
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(TOO_LARGE)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(TOO_LARGE)
        self.wfile.flush()
        self._drain()

    def _drain(self) -> None:
        """Read and drop what the client still sends, until it hangs up (bounded in bytes and
        time): closing with a request unread resets the connection, and the client could lose
        the reply with it."""
        deadline = time.monotonic() + REQUEST_TIMEOUT
        left = DRAIN_LIMIT
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_WR)  # the reply is complete
            while left > 0 and (wait := deadline - time.monotonic()) > 0:
                self.connection.settimeout(wait)
                chunk = self.connection.recv(min(left, 65536))
                if not chunk:
                    break
                left -= len(chunk)


def _reply(start_response: StartResponse, status: str, body: bytes) -> list[bytes]:
    # HTTP/1.0: the connection closes after the reply (WSGI leaves Connection to the server).
    start_response(status, [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
    return [body]


class StatusServer:
    """Serves GET / (JSON status) on a unix socket at `path`."""

    def __init__(self, agent: Observed, path: str) -> None:
        self.agent = agent
        self.path = path
        self._loop: asyncio.AbstractEventLoop | None = None
        self._served: Served | None = None
        self._socket_id: tuple[int, int] | None = None

    async def start(self) -> StatusServer:
        """Listen (on the agent's loop: snapshots are taken on it)."""
        self._loop = asyncio.get_running_loop()
        await asyncio.to_thread(self._listen)
        log.info("status endpoint on %s", self.path)
        return self

    def _listen(self) -> None:
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(os.lstat(self.path).st_mode):
                os.unlink(self.path)  # stale socket of an earlier run
        self._served = serve_unix(self.app, self.path, "gpufrac-status", _Handler)
        # Root and the node's operators (group) may read the node's workload names; others not.
        os.chmod(self.path, 0o660)
        st = os.stat(self.path)
        self._socket_id = (st.st_dev, st.st_ino)

    async def stop(self) -> None:
        served, self._served = self._served, None
        if served is None:
            return
        await asyncio.to_thread(served.stop)
        try:
            st = os.stat(self.path)
            if (st.st_dev, st.st_ino) == self._socket_id:  # only our own socket
                os.unlink(self.path)
        except OSError:
            pass

    def app(self, environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        """The WSGI app: runs in the request's thread."""
        method = environ.get("REQUEST_METHOD", "")
        if method not in ("GET", "HEAD"):
            return _reply(
                start_response, "405 Method Not Allowed", b'{"error":"read-only endpoint: GET only"}'
            )
        if environ.get("PATH_INFO") not in ("/", "/status"):
            return _reply(start_response, "404 Not Found", b'{"error":"try GET /"}')
        try:
            assert self._loop is not None, "a request before start()"
            snap = capture_threadsafe(self.agent, self._loop)
            enrich(snap)
            body = json.dumps(snap.to_dict()).encode()
        except Exception:
            log.exception("status request failed")
            return _reply(
                start_response, "500 Internal Server Error", b'{"error":"internal error, see the agent log"}'
            )
        return _reply(start_response, "200 OK", b"" if method == "HEAD" else body)


async def start(agent: Observed) -> StatusServer | None:
    """Start the status endpoint at config.status_socket; None (and an error logged) if it cannot be
    served: the agent's real work goes on without it."""
    path = agent.config.status_socket
    try:
        return await StatusServer(agent, path).start()
    except OSError as e:
        log.error("status endpoint unavailable: cannot serve %s: %s", path, e.strerror or e)
        return None
