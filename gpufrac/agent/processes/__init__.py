"""Processes on the node, as the kernel reports them.

callers       who a caller or a process is: its credentials, cgroup, container and pod
knowncallers  callers seen before, kept by pidfd so a reused pid is not mistaken for them
placements    which container each GPU process is in, kept by pidfd (the compute loop's reads)
kill          how a process is killed: by pidfd, and only while it is still in its container
"""
