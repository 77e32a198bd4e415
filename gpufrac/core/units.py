"""Parsing of the quantities and durations users write in annotations and config."""

from __future__ import annotations

import math
import re
from decimal import Decimal, InvalidOperation, Underflow, localcontext

_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|h|m|s)")
_DURATION_SCALE = {"ms": Decimal("0.001"), "s": Decimal(1), "m": Decimal(60), "h": Decimal(3600)}
# The largest size any field of the shim holds (u64 bytes, memguard_abi.h).
MAX_BYTES = 2**64 - 1
# The longest duration accepted anywhere: past it timers overflow, and no setting needs more.
MAX_DURATION_S = 100 * 365 * 86400
# Durations the shim holds in a u32 of milliseconds (memguard_abi.h: arbiter_timeout_ms,
# wait_timeout_ms): about 49.7 days.
MAX_MS_FIELD_S = (2**32 - 1) / 1000
# The least arbiterTimeout the agent can honour (memguard_abi.h MG_MIN_ARBITER_TIMEOUT_MS, which
# the shim reads a smaller value as): it drops a connection whose request has not come within it
# of the accept, and the shim gives up connect and send within it; on a loaded node a shim is
# descheduled between its connect and its send, and the agent's loop between an accept and its
# read, for tens of milliseconds (docs/arbiter-protocol.md, "Timeouts").
MIN_ARBITER_TIMEOUT_MS = 100
# A Kubernetes quantity's suffix: a power of 1000 (n u m k K M G T P E), or of 1024 when an
# "i" follows K M G T P or E (Ki Mi Gi ...). Read here, not with the kubernetes client, so
# the bottom layer needs no client library; the number before it is read as a Decimal.
_SUFFIX_POWER = {"n": -3, "u": -2, "m": -1, "k": 1, "K": 1, "M": 2, "G": 3, "T": 4, "P": 5, "E": 6}


def _quantity(value: object) -> Decimal:
    """A quantity as an exact Decimal; ValueError or InvalidOperation when it is none."""
    if isinstance(value, int | float | Decimal):
        return Decimal(value)
    text = str(value)
    if text.endswith("i") and len(text) >= 2 and text[-2] in _SUFFIX_POWER:
        if _SUFFIX_POWER[text[-2]] < 1 or text[-2] == "k":
            raise ValueError(f"{text!r}: {text[-2:]} is not a suffix")
        return Decimal(text[:-2]) * Decimal(1024) ** _SUFFIX_POWER[text[-2]]
    if text and text[-1] in _SUFFIX_POWER:
        return Decimal(text[:-1]) * Decimal(1000) ** _SUFFIX_POWER[text[-1]]
    return Decimal(text)


def parse_bytes(value: str | int) -> int:
    """A Kubernetes quantity ("24Gi", "2500Mi", "8G", 1073741824) as whole bytes.

    Raises ValueError naming the value when it is not a non-negative whole byte count."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a quantity")
    try:
        # An underflow trapped: "1e-999999999999Ki" would otherwise come out as 0 bytes,
        # where "1e-9" is refused as not a whole number of bytes.
        with localcontext() as ctx:
            ctx.traps[Underflow] = True
            q = _quantity(value)
    except (ValueError, InvalidOperation, TypeError, ArithmeticError) as e:
        raise ValueError(f"{value!r} is not a quantity like 24Gi or 2500Mi") from e
    if not q.is_finite():  # Decimal accepts "NaN" and "Infinity"
        raise ValueError(f"{value!r} is not a finite quantity")
    if q < 0:
        raise ValueError(f"{value!r} is negative")
    if q > MAX_BYTES:  # also keeps "1e400" from reaching float arithmetic
        raise ValueError(f"{value!r} is more than the 16Ei (2^64 - 1 bytes) a size field holds")
    if q != q.to_integral_value():
        raise ValueError(f"{value!r} is not a whole number of bytes")
    return int(q)


def parse_duration(value: str | int | float) -> float:
    """A Go-style duration ("30m", "1h30m", "250ms", "45s") or plain seconds, as seconds."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a duration")
    if isinstance(value, (int, float)):
        if not math.isfinite(value):  # YAML reads .nan and .inf as floats
            raise ValueError(f"{value!r} is not a finite duration")
        if value < 0:
            raise ValueError(f"{value!r} is negative")
        if value > MAX_DURATION_S:
            raise ValueError(f"{value!r} is longer than 100 years")
        return float(value)
    text = str(value).strip()
    if not text:
        raise ValueError("empty duration")
    pos, total = 0, Decimal(0)
    for m in _DURATION_PART.finditer(text):
        if m.start() != pos:
            break
        total += Decimal(m.group(1)) * _DURATION_SCALE[m.group(2)]
        pos = m.end()
    if pos != len(text):
        raise ValueError(f"{value!r} is not a duration like 30m, 1h30m or 45s")
    if total > MAX_DURATION_S:
        raise ValueError(f"{value!r} is longer than 100 years")
    return float(total)


def format_bytes(n: int) -> str:
    """Human-readable binary size: 1536 MiB -> '1.5Gi'."""
    if abs(n) >= 1 << 80:  # beyond any real size (and beyond float division): say how big
        return f"{Decimal(n):.3E}B"
    for unit, scale in (("Ti", 1 << 40), ("Gi", 1 << 30), ("Mi", 1 << 20), ("Ki", 1 << 10)):
        if abs(n) >= scale:
            v = n / scale
            return f"{v:.0f}{unit}" if v == int(v) else f"{v:.1f}{unit}"
    return f"{n}B"


def format_duration(seconds: float) -> str:
    """A duration the way parse_duration reads it: 3725 -> '1h2m5s', 0.25 -> '250ms'."""
    if seconds < 1:
        return f"{round(max(0.0, seconds) * 1000)}ms"
    total = round(seconds)
    h, rest = divmod(total, 3600)
    m, s = divmod(rest, 60)
    return "".join(f"{v}{u}" for v, u in ((h, "h"), (m, "m"), (s, "s")) if v) or "0s"
