"""IDENTIFY tells a process its own host pid, and only its own.

The shim of a process in a pid namespace of its own asks the agent which pid NVML names it by
(op IDENTIFY) and then reads the driver's figures for that pid. The answer comes from the
kernel (SO_PEERCRED on the process's own connection), never from the request: a tenant that
writes a neighbour's pid into its request still learns its own, and a process of no gpufrac
container learns nothing. Real processes in real cgroups on the arbiter's real socket
(tests/fixtures/arbiter_harness.py).
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable

import pytest

from gpufrac.memguard import abi, wire
from tests.fixtures.arbiter_harness import ArbiterNode, go

pytestmark = pytest.mark.security

TIMEOUT = 60.0

# A tenant's process: once told to go, it sends IDENTIFY claiming the pid given on its command
# line, and prints its own pid and the answer.
ASK = r"""
import json, os, socket, sys
from gpufrac.memguard import abi, wire
path = wire.socket_path(os.environ["GPUFRAC_CONTAINER_DIR"])
print("ready", flush=True)
sys.stdin.readline()
claimed = int(sys.argv[1])
req = wire.BurstRequest(wire.BURST_MAGIC, abi.ABI_VERSION, wire.BURST_OP_IDENTIFY, claimed, 0, 0, 0, 0)
with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
    s.settimeout(30)
    s.connect(path)
    s.sendall(bytes(req))
    rep = wire.BurstReply.from_buffer_copy(s.recv(wire.REPLY_SIZE, socket.MSG_WAITALL))
print(json.dumps({"me": os.getpid(), "status": rep.status, "pid": rep.generation}), flush=True)
"""


def test_identify_answers_the_callers_own_pid_whatever_its_request_claims(
    make_node: Callable[..., ArbiterNode],
) -> None:
    node = make_node()
    neighbour = node.add("neighbour", 2, "8Gi")
    assert neighbour.container is not None
    tenant = node.add("tenant", 2, "8Gi", start=False)
    proc = node.start_script(tenant, ASK, neighbour.container.proc.pid)  # claims the neighbour's pid
    go(proc)
    out, _ = proc.communicate(timeout=TIMEOUT)
    answer = json.loads(out.decode().strip().splitlines()[-1])
    assert answer["status"] == wire.BURST_GRANTED
    assert answer["pid"] == answer["me"] != neighbour.container.proc.pid


def test_a_process_of_no_container_learns_nothing(make_node: Callable[..., ArbiterNode]) -> None:
    node = make_node()
    node.add("someone", 2, "8Gi")
    op = wire.BURST_OP_IDENTIFY
    req = wire.BurstRequest(wire.BURST_MAGIC, abi.ABI_VERSION, op, os.getpid(), 0, 0, 0, 0)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(TIMEOUT)
        s.connect(node.socket)  # the node-wide socket, from this test process: no kubelet container
        s.sendall(bytes(req))
        rep = wire.BurstReply.from_buffer_copy(s.recv(wire.REPLY_SIZE, socket.MSG_WAITALL))
    assert rep.status == wire.BURST_REFUSED and rep.generation == 0
