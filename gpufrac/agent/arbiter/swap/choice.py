"""Which idle containers the swap resolver moves to host RAM for a need: pure, no I/O."""

from __future__ import annotations

from collections.abc import Sequence

from gpufrac.agent.arbiter.resolvers import Holding


def win(h: Holding, lend: bool) -> int:
    """Bytes the arbiter may hand out once `h` is swapped: all it uses if unused guarantees
    may be lent, else only what it uses above its guarantee (which stays reserved for it)."""
    return h.used if lend else max(0, h.used - h.request)


def pick(candidates: Sequence[Holding], missing: int, ram_left: int, lend: bool) -> list[Holding]:
    """The victims to swap for `missing` bytes, least disruption first: one victim if any
    single one suffices (lowest priority, longest idle, least to move), else the fewest
    (largest wins first, lower priorities before higher), each within the host RAM left.
    Empty when even all of them together would not free enough: swapping some would
    disturb them for nothing."""
    fits = [h for h in candidates if h.used <= ram_left and win(h, lend) > 0]
    single = [h for h in fits if win(h, lend) >= missing]
    if single:
        return [min(single, key=lambda h: (h.priority, -h.idle_s, h.used))]
    chosen: list[Holding] = []
    won = ram = 0
    for h in sorted(fits, key=lambda h: (h.priority, -win(h, lend), -h.idle_s)):
        if ram + h.used > ram_left:
            continue
        chosen.append(h)
        won += win(h, lend)
        ram += h.used
        if won >= missing:
            return chosen
    return []
