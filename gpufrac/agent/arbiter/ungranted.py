"""GPU memory a container holds above its request with no grant covering it.

Between its request and its limit a container may hold memory only under a grant of the
arbiter: the shim asks for the grant before it allocates and gives it back after it frees
(docs/arbiter-protocol.md), so a process under the shim never holds more than request +
grant. A process that does not load the shim (or calls the driver directly) can allocate up
to the limit without asking: memory the arbiter never weighed against the neighbours' waits,
priorities and guarantees. The arbiter counts it, on the driver's count (NVML's per-process
memory summed over the container's processes, less one allowance: gpufrac.agent.gpu.truth), as a
burst like any other (gpufrac.agent.arbiter.resolvers.EvictResolver): a neighbour's guarantee takes it
back, a higher-priority burst may evict it.

Above the limit is the watchdog's (gpufrac.agent.watchdog.service: the newest processes killed
within one interval), not counted here. The watchdog does not act on memory within the limit:
it costs no one until someone needs it, and then the reclaim or eviction takes it
(docs/watchdog.md says why).
"""

from __future__ import annotations


def ungranted(used: int, request: int, grant: int, limit: int) -> int:
    """Bytes held above request + grant and within the limit (`used` the larger of the
    driver's count and the clamped usage file, gpufrac.agent.gpu.truth)."""
    return max(0, min(used, limit) - request - grant)
