"""Errors of the allocation service, free of any transport.

The ledger and the agent say what went wrong (an ErrorKind); a front end says it in its
own terms: gpufrac.deviceplugin.server maps each kind to a gRPC status code for the kubelet.
"""

from __future__ import annotations

import enum


class ErrorKind(enum.Enum):
    """Why an allocation request was refused."""

    # The request itself is wrong: unknown or repeated device IDs, a set no rule allows.
    INVALID_REQUEST = "invalid-request"
    # The request is well formed but the node's state refuses it: devices taken, a GPU
    # Unhealthy, not enough unrequested memory, devices never allocated.
    STATE_CONFLICT = "state-conflict"
    # The agent could not do its part: a container directory it could not create.
    NODE_FAILURE = "node-failure"


class AllocationError(Exception):
    """A request the allocation service cannot honour: its kind and a message naming why."""

    def __init__(self, kind: ErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
