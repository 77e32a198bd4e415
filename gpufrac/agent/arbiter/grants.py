"""The grant model: how many burst bytes a container may be given, as pure arithmetic.

No sockets, no NVML, no files, no clock: every figure (what each container holds, what the
driver says is free, the time now) is handed in, so the rules below can be tested alone.
Per GPU and container (u = used, r = request, g = grant):

    burst     = max(g, u - r, 0)
    committed = r + burst                 (lendUnusedRequests off)
              = min(u, r) + burst         (on: unused guarantees may be lent)
    pool      = allocatable - sum(committed)
    physical  = NVML free - grantMargin - sum(max(0, committed - u))

A burst of `extra` new bytes is granted only if extra <= min(pool, physical): the ledger's
arithmetic never outruns what the GPU really has. A container whose usage is unknown counts
as using all it may (request + grant).

Grants come back: the shim's release (and its grant_returned counter) lowers a grant to what
the container uses above its request, and a grant left unused for GRANT_STALE_AFTER seconds
is lowered by the sweep (GrantSweep).

What is missing for a request (a burst's or a guarantee's shortfall) is freed by evicting or
swapping others only beyond what hidden processes hold on the GPU (`coverable`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

GRANT_STALE_AFTER = 10.0  # a grant unused this long is taken back
STALE_SLACK = 64 << 20  # "well below": unused grant beyond this counts as stale
# A grant this young is not lowered to the container's usage: the shim it was given to
# charges its allocation right after the reply, so usage may not show it yet.
GRANT_SETTLE = 0.1


@dataclass(frozen=True)
class Share:
    """One container's standing on a GPU: what it holds (None: unknown), its request, its grant."""

    used: int | None
    request: int
    grant: int

    @property
    def holds(self) -> int:
        """What it counts as holding: its usage, or, unknown, all it may use."""
        return self.used if self.used is not None else self.request + self.grant

    @property
    def burst(self) -> int:
        """Bytes held above the request: max(grant, used - request, 0)."""
        return burst_held(self.holds, self.request, self.grant)


def burst_held(used: int, request: int, grant: int) -> int:
    return max(grant, used - request, 0)


def free_for(
    shares: Iterable[Share], allocatable: int, nvml_free: int | None, margin: int, lend: bool
) -> int:
    """Bytes that may be newly granted on a GPU whose containers hold `shares`: the ledger's
    pool and the driver's free memory less the margin, whichever is smaller. Nothing without
    a driver reading: never grant blindly."""
    committed = unused = 0
    for s in shares:
        used = s.holds
        c = (min(used, s.request) if lend else s.request) + burst_held(used, s.request, s.grant)
        committed += c
        unused += max(0, c - used)
    if nvml_free is None:
        return 0
    pool = allocatable - committed
    physical = nvml_free - margin - unused
    return max(0, min(pool, physical))


def burst_target(want: int, request: int) -> int:
    """The grant a container needs to hold `want` bytes in all."""
    return want - request


def kept_on_release(used: int, request: int, grant: int) -> int:
    """What is left of a grant once the part the container does not use is taken back."""
    return min(grant, max(0, used - request))


def settle_left(granted_at: float | None, now: float) -> float:
    """Seconds until a grant given at `granted_at` may be lowered to its container's usage."""
    if granted_at is None:
        return 0.0
    return max(0.0, granted_at + GRANT_SETTLE - now)


def guarantee_shortfall(request: int, held: int, nvml_free: int, margin: int, pending: int) -> int:
    """Bytes of a container's request that are not physically there: the request less what it
    holds, beyond the driver's free memory less the margin less what the others may still
    charge within their request + grant (`pending`)."""
    mine = min(request, request - held)
    return max(0, mine - (nvml_free - margin - pending))


def coverable(missing: int, hidden: int) -> int:
    """What of `missing` bytes on a GPU may be freed by evicting or swapping others: none of
    what hidden processes hold there (`hidden`: processes whose cgroup the kernel will not
    name, gpufrac.agent.gpu.processes.observe). That memory is nobody's, possibly the
    requester's own: the requester waits for the watchdog to kill its holder (enforce mode)
    rather than have a neighbour pay for it."""
    return max(0, missing - hidden)


def pending_of(request: int, grant: int, held: int) -> int:
    """What a container may still charge within its request + grant (not started: all of it)."""
    return max(0, request + grant - held)


@dataclass
class GrantSweep:
    """Which grants the periodic sweep takes back: one whose container's shim counted a return
    since the last look (grant_returned moved), and one left unused (more than STALE_SLACK
    below request + grant) for GRANT_STALE_AFTER seconds. Times are handed in."""

    returned: dict[str, int] = field(default_factory=dict)  # last grant_returned seen per container
    unused_since: dict[str, float] = field(default_factory=dict)

    def returned_now(self, key: str, counter: int) -> bool:
        """Whether the container's grant_returned counter moved since the last look. A usage
        file starts at 0: a grant returned before the first look still counts."""
        last = self.returned.setdefault(key, 0)
        if counter == last:
            return False
        self.returned[key] = counter
        return True

    def stale(self, key: str, unused: int, now: float) -> bool:
        """Whether a grant `unused` bytes of which lie unused has been so for long enough."""
        if unused <= STALE_SLACK:
            self.unused_since.pop(key, None)
            return False
        since = self.unused_since.setdefault(key, now)
        return now - since >= GRANT_STALE_AFTER

    def used(self, key: str) -> None:
        """The container's grant was just given or lowered: its unused clock starts again."""
        self.unused_since.pop(key, None)

    def forget(self, key: str) -> None:
        self.returned.pop(key, None)
        self.unused_since.pop(key, None)


def ungranted(used: int, request: int, grant: int, limit: int) -> int:
    """Bytes held above request + grant and within the limit: memory a process that skips the
    shim (or calls the driver directly) took without asking the arbiter.

    `used` is the larger of the driver's count and the clamped usage file (gpu/truth.py).
    The resolvers count it as a burst like any other: a neighbour's guarantee takes it back, a
    higher-priority burst may evict it. Above the limit is the watchdog's, not counted here;
    within the limit it costs no one until someone needs it (docs/watchdog.md says why).
    """
    return max(0, min(used, limit) - request - grant)
