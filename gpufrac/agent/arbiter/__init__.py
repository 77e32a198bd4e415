"""The burst arbiter (docs/arbiter-protocol.md): what other parts of the agent use of it.

service    the Arbiter: decides each request on the agent's loop
server     a connection: reads, times out, counts and answers requests; the node-wide socket
listeners  each container's own socket, paused while its container holds its limit
grants     the grant model: pure arithmetic, no I/O
queue      the order of requests on a GPU: waiters and claims
readings   the NVML cache
usage      the containers' usage and config files
chain      the resolver chain the node config names
recovery   grants across an agent restart
"""

from gpufrac.agent.arbiter.grants import GRANT_SETTLE, GRANT_STALE_AFTER
from gpufrac.agent.arbiter.readings import NVML_FRESH, NVML_STALE
from gpufrac.agent.arbiter.recovery import adopt_grants, published_grants
from gpufrac.agent.arbiter.server import Stats
from gpufrac.agent.arbiter.service import Arbiter, EventSink

__all__ = [
    "GRANT_SETTLE",
    "GRANT_STALE_AFTER",
    "NVML_FRESH",
    "NVML_STALE",
    "Arbiter",
    "EventSink",
    "Stats",
    "adopt_grants",
    "published_grants",
]
