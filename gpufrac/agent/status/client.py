"""The status endpoint's client: the agent's status document from its unix socket, for
`gpufrac status`, `gpufrac memguard inspect` and the demo."""

from __future__ import annotations

import http.client
import json
import socket
from typing import Any


class StatusUnavailable(Exception):
    """No agent answered on the status socket."""


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.unix_path = path

    def connect(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        try:
            s.connect(self.unix_path)
        except OSError:
            s.close()
            raise
        self.sock = s


def fetch(path: str, timeout: float = 30.0) -> dict[str, Any]:
    """The agent's status document from its socket; StatusUnavailable says why not."""
    conn = _UnixHTTPConnection(path, timeout)
    try:
        conn.request("GET", "/")
        resp = conn.getresponse()
        body = resp.read()
    except FileNotFoundError:
        raise StatusUnavailable(f"the gpufrac agent is not running (no status socket at {path})") from None
    except ConnectionRefusedError:
        raise StatusUnavailable(
            f"the gpufrac agent is not running (nothing listens on the status socket {path})"
        ) from None
    except PermissionError:
        raise StatusUnavailable(f"permission denied on the status socket {path} (run as root?)") from None
    except (OSError, http.client.HTTPException) as e:
        raise StatusUnavailable(f"the gpufrac agent did not answer on {path}: {e}") from None
    finally:
        conn.close()
    if resp.status != 200:
        raise StatusUnavailable(f"the gpufrac agent answered {resp.status} on {path}: {body[:200]!r}")
    try:
        data = json.loads(body)
    except ValueError as e:
        raise StatusUnavailable(f"the gpufrac agent sent invalid JSON on {path}: {e}") from None
    if not isinstance(data, dict):
        raise StatusUnavailable(
            f"the gpufrac agent sent a JSON {type(data).__name__}, not an object, on {path}"
        )
    return data
