"""How a message quotes what it was given: an annotation's key or value, a config value.

A tenant writes its pod's annotations (up to 256 KiB of them) and a message about them goes
into an Event and the agent's log: what is quoted is bounded and printable, so one refusal
is one line of a readable length and a newline in a value cannot forge a line of the log.
"""

from __future__ import annotations

SHOWN_CHARS = 128  # of a value, or of a key, in a message


def shown(text: str, limit: int = SHOWN_CHARS) -> str:
    """`text` cut to `limit` characters, saying how long it was, with what does not print
    escaped."""
    cut = text if len(text) <= limit else text[:limit]
    cut = "".join(c if c.isprintable() else repr(c)[1:-1] for c in cut)
    return cut if len(text) <= limit else f"{cut}...({len(text)} characters)"
