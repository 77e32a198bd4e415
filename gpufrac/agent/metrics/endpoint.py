"""/metrics, /healthz and /readyz: one WSGI app (prometheus-client's for /metrics), served by
gpufrac.agent.status.httpd on metrics.bindAddress:metrics.port."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, make_wsgi_app

if TYPE_CHECKING:  # typeshed's WSGI types (wsgiref.types is Python 3.11+): annotations only
    from _typeshed.wsgi import StartResponse, WSGIApplication, WSGIEnvironment

# Liveness: the loop's heartbeat task beats this often; a beat older than
# HEARTBEAT_STALE_AFTER means the loop is stuck (/healthz fails). Not the arbiter's
# grant staleness: a different clock with a different job.
HEARTBEAT_INTERVAL = 1.0
HEARTBEAT_STALE_AFTER = 15.0


class Probes:
    """/healthz: the loop's heartbeat is fresh. /readyz: live, and `ready_check()` says so."""

    def __init__(
        self, stale_after: float = HEARTBEAT_STALE_AFTER, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.stale_after = stale_after
        self.clock = clock
        self.last_beat: float | None = None
        self.ready_check: Callable[[], tuple[bool, str]] = lambda: (False, "starting")

    def beat(self) -> None:
        self.last_beat = self.clock()

    def live(self) -> tuple[bool, str]:
        if self.last_beat is None:
            return False, "the agent loop has not started"
        age = self.clock() - self.last_beat
        if age > self.stale_after:
            return False, f"the agent loop has not run for {age:.0f}s"
        return True, "ok"

    def ready(self) -> tuple[bool, str]:
        ok, why = self.live()
        if not ok:
            return ok, why
        try:
            return self.ready_check()
        except Exception as e:  # a probe answers, it never raises
            return False, f"readiness check failed: {e}"


def wsgi_app(registry: CollectorRegistry, probes: Probes) -> WSGIApplication:
    """/metrics (and /: prometheus-client's app over `registry`), /healthz, /readyz."""
    metrics_app = make_wsgi_app(registry)

    def probe(result: tuple[bool, str], start_response: StartResponse) -> list[bytes]:
        ok, why = result
        body = (why + "\n").encode()
        start_response(
            "200 OK" if ok else "503 Service Unavailable",
            [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body)))],
        )
        return [body]

    def app(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO") or "/"
        if path == "/healthz":
            return probe(probes.live(), start_response)
        if path == "/readyz":
            return probe(probes.ready(), start_response)
        if path in ("/metrics", "/"):
            exposition: Iterable[bytes] = metrics_app(environ, start_response)
            return exposition
        body = b"not found: try /metrics, /healthz or /readyz\n"
        start_response("404 Not Found", [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
        return [body]

    return app
