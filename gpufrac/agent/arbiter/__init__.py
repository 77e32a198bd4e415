"""The burst arbiter and what settles collisions (docs/arbiter-protocol.md).

service    the Arbiter: decides each request on the agent's loop
server     a connection: reads, times out, counts and answers requests; the node-wide socket
listeners  each container's own socket, paused while its container holds its limit
fairness   each caller's connection, rate and in-flight limits
grants     the grant model: pure arithmetic, no I/O
queue      the order of requests on a GPU: waiters and claims
readings   the NVML cache
usage      the containers' usage and config files
chain      the resolver chain the node config names
resolvers  the wait and evict resolvers, and the chain they run in
swap/      the swap resolver (host RAM, through the driver's checkpoint API)
admission  a new container's request freed at its start (the guarantee's reclaim)
recovery   grants across an agent restart
sweep      unused grants taken back
"""
