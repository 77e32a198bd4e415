"""Structured logs: one line per decision, plain text or JSON (config logJson).

Every decision the agent takes (an allocation, a release, a limit applied, a burst
granted or denied, an eviction, a swap, a reap) is one log line with its facts as
fields, so `jq 'select(.decision=="evict")'` or a log pipeline can find them:

    from gpufrac.core import logs
    logs.decision(log, "allocate", "allocated %s on %s", key, gpu,
                  container=key, resource=resource, gpu=gpu, request_bytes=n)

Text:  2026-01-05T10:00:00.123Z INFO gpufrac.agent: allocated m-… on GPU-… decision=allocate container=m-… …
JSON:  {"time":"…","level":"INFO","logger":"gpufrac.agent","msg":"allocated …","decision":"allocate",…}

Other log lines (warnings, errors) go through the same formatters, fields optional.
"""

from __future__ import annotations

import datetime
import json
import logging
import sys
from typing import IO, Any

from gpufrac.core.config import Config

# The LogRecord attribute holding a line's structured fields.
FIELDS = "gpufrac_fields"
# Names the JSON document itself uses; a field of the same name is prefixed with "field_".
_RESERVED = frozenset({"time", "level", "logger", "msg", "exception"})


def _time(record: logging.LogRecord) -> str:
    t = datetime.datetime.fromtimestamp(record.created, tz=datetime.timezone.utc)
    return t.strftime("%Y-%m-%dT%H:%M:%S.") + f"{int(record.msecs):03d}Z"


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    return dict(getattr(record, FIELDS, None) or {})


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, msg, the line's fields, exception."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "time": _time(record),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for k, v in _fields(record).items():
            doc[f"field_{k}" if k in _RESERVED else k] = v
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str, separators=(",", ":"))


def _text_value(v: Any) -> str:
    s = str(v)
    return json.dumps(s) if (not s or any(c in s for c in ' "=\n\t')) else s


class TextFormatter(logging.Formatter):
    """time level logger: message key=value ... (values with spaces quoted)."""

    def format(self, record: logging.LogRecord) -> str:
        line = f"{_time(record)} {record.levelname} {record.name}: {record.getMessage()}"
        fields = _fields(record)
        if fields:
            line += " " + " ".join(f"{k}={_text_value(v)}" for k, v in fields.items())
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def setup(cfg: Config, stream: IO[str] | None = None) -> logging.Handler:
    """Configure the root logger from the node config (logLevel, logJson); returns the handler."""
    return configure(cfg.log_level, cfg.log_json, stream)


def configure(
    level: str = "info", json_lines: bool = False, stream: IO[str] | None = None
) -> logging.Handler:
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if json_lines else TextFormatter())
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level.upper())
    return handler


def decision(
    logger: logging.Logger, what: str, msg: str, /, *args: Any, level: int = logging.INFO, **fields: Any
) -> None:
    """Log one decision: `what` (allocate, release, limit, grant, deny, evict, swap-out, swap-in,
    reap, ...) goes into the field `decision`, the keyword arguments into fields of their own."""
    logger.log(level, msg, *args, extra={FIELDS: {"decision": what, **fields}})
