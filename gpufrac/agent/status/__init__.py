"""The node at a glance: one model of the agent's state, read-only, for humans and tools.

    model.py    the documents: NodeStatus, GpuStatus, ContainerStatus, UsageView
    capture.py  a copy of the agent's state, taken on its loop (no I/O); what it reads of the
                agent is the `Observed` Protocol there
    enrich.py   NVML and usage-file figures added off the loop (blocking reads)
    server.py   GET / as JSON on the status unix socket (config statusSocket)
    client.py   fetch(): that document, for `gpufrac status` and `memguard inspect`
    cli.py      `gpufrac status`: the table and the command

Both the Prometheus collector (gpufrac.agent.metrics) and the status socket serve this one
model. Import the module you need; this package file imports none of them.
"""
