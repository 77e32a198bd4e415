"""The agent's HTTP servers: WSGI apps served by prometheus-client's threaded WSGI server
(wsgiref, a thread per request), each in its own thread, so a slow client never blocks the
agent's loop. /metrics, /healthz and /readyz listen on TCP (gpufrac.agent.metrics), the
status document on a unix socket (gpufrac.agent.status.server)."""

from __future__ import annotations

import logging
import socket
import socketserver
import threading
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client.exposition import ThreadingWSGIServer

if TYPE_CHECKING:  # typeshed's WSGI types (wsgiref.types is Python 3.11+): annotations only
    from _typeshed.wsgi import WSGIApplication

log = logging.getLogger(__name__)


class QuietHandler(WSGIRequestHandler):
    """No access log line per request (a scrape, a probe, a `gpufrac status`)."""

    def log_message(self, format: str, *args: Any) -> None:
        pass


class UnixWSGIServer(ThreadingWSGIServer):
    """The threaded WSGI server on a unix socket path instead of a TCP address."""

    address_family = socket.AF_UNIX

    def __init__(self, path: str, handler: type[WSGIRequestHandler]) -> None:
        # typeshed types HTTPServer's address as (host, port); socketserver takes a unix path.
        super().__init__(path, handler)  # type: ignore[arg-type]

    def server_bind(self) -> None:
        # Bind the path as TCPServer does; HTTPServer's own would take the path for a host
        # name and look it up.
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = "localhost", 0
        self.setup_environ()

    def get_request(self) -> tuple[socket.socket, tuple[str, int]]:
        conn, _ = self.socket.accept()
        # A unix peer has no address; WSGI's REMOTE_ADDR wants a (host, port) pair.
        return conn, ("local", 0)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that hung up or stalled past the handler's timeout: nothing for the log
        # beyond a debug line (socketserver would print a traceback to stderr).
        log.debug("request on %s failed", self.server_address, exc_info=True)


class Served:
    """A WSGI server and the thread serving it until stop()."""

    def __init__(self, server: ThreadingWSGIServer, name: str) -> None:
        self.server = server
        self._thread = threading.Thread(target=server.serve_forever, name=name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Blocking: stops accepting and closes the socket (requests in flight finish alone)."""
        self.server.shutdown()
        self.server.server_close()


def serve_tcp(app: WSGIApplication, host: str, port: int, name: str) -> Served:
    """Serve `app` on host:port (IPv6 when host is an IPv6 address). OSError if it cannot bind."""

    class Server(ThreadingWSGIServer):
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

    return Served(make_server(host, port, app, Server, handler_class=QuietHandler), name)


def serve_unix(
    app: WSGIApplication, path: str, name: str, handler: type[WSGIRequestHandler] = QuietHandler
) -> Served:
    """Serve `app` on a unix socket at `path` (created; the caller sets its mode and removes
    it). OSError if it cannot bind."""
    server = UnixWSGIServer(path, handler)
    server.set_app(app)
    return Served(server, name)
