"""The arbiter socket's wire protocol (memguard_abi.h mg_burst_req_t / mg_burst_rep_t) and a
small client that speaks it as the shim does (tests, the bench, simgpu's stand-in workload).

The agent serves it (gpufrac.agent.arbiter); docs/arbiter-protocol.md describes it. One
connection carries one fixed-size request and one fixed-size reply, in host byte order.
"""

from __future__ import annotations

import ctypes
import os
import socket
import stat
import struct
import time

from gpufrac.memguard.abi import ABI_VERSION, SOCKET_DIR, SOCKET_FILE

u32, u64, i32 = ctypes.c_uint32, ctypes.c_uint64, ctypes.c_int32

# On BURST_GRANTED the agent has already published the larger grant_bytes in the container's
# config before replying.
BURST_MAGIC = 0x3142474D
BURST_OP_BURST = 1
BURST_GRANTED, BURST_DENIED = 0, 1
# Added with the arbiter (docs/arbiter-protocol.md): the shim gives back grant it no
# longer uses; swap-in is reserved for the swap resolver. Statuses other than GRANTED
# all mean "refused" to the shim; the extra ones say why.
BURST_OP_RELEASE, BURST_OP_SWAP_IN = 2, 3
BURST_REFUSED, BURST_INVALID, BURST_UNAVAILABLE = 2, 3, 4
# The driver refused an allocation within the request (others' bursts hold the guarantee):
# the agent takes burst memory back; GRANTED means retry once.
BURST_OP_RECLAIM = 4
# The caller's container is over its arbiter limits (connections, requests in flight,
# request rate: gpufrac.agent.arbiter.fairness); sent without any work done for the request.
BURST_BUSY = 5
# The caller asks for its own pid as the agent sees it (SO_PEERCRED: the host's pid namespace,
# where NVML's pids are); GRANTED carries it in the reply's `generation`.
BURST_OP_IDENTIFY = 5


class BurstRequest(ctypes.Structure):
    _fields_ = [
        ("magic", u32),
        ("version", ctypes.c_uint16),
        ("op", ctypes.c_uint16),
        ("pid", i32),
        ("pad0", u32),
        ("bytes", u64),
        ("total_after", u64),
        ("generation", u64),
    ]


class BurstReply(ctypes.Structure):
    _fields_ = [
        ("magic", u32),
        ("version", ctypes.c_uint16),
        ("status", ctypes.c_uint16),
        ("generation", u64),
    ]


REQUEST_SIZE = ctypes.sizeof(BurstRequest)
REPLY_SIZE = ctypes.sizeof(BurstReply)

# Names of ops and statuses: metric label values (gpufrac_arbiter_requests_total{kind,outcome})
# and what simgpu's stand-in workload prints.
OP_NAMES = {
    BURST_OP_BURST: "burst",
    BURST_OP_RELEASE: "release",
    BURST_OP_SWAP_IN: "swap_in",
    BURST_OP_RECLAIM: "reclaim",
    BURST_OP_IDENTIFY: "identify",
}
STATUS_NAMES = {
    BURST_GRANTED: "granted",
    BURST_DENIED: "denied",
    BURST_REFUSED: "refused",
    BURST_INVALID: "invalid",
    BURST_UNAVAILABLE: "unavailable",
    BURST_BUSY: "busy",
}


def well_formed(req: BurstRequest) -> bool:
    """Whether a request is one this protocol version knows (else it is answered INVALID)."""
    return req.magic == BURST_MAGIC and req.version == ABI_VERSION and req.op in OP_NAMES


def reply(status: int, generation: int = 0) -> bytes:
    """One encoded reply."""
    return bytes(BurstReply(BURST_MAGIC, ABI_VERSION, status, generation))


def socket_path(container_dir: str) -> str:
    """The arbiter socket as a container's shim picks it (mg_arbiter.c mg_sock): the one in the
    directory mount, else the socket file an older agent mounted; the first when neither is
    there (the agent is away: connecting fails)."""
    current = os.path.join(container_dir, SOCKET_DIR, SOCKET_FILE)
    legacy = os.path.join(container_dir, SOCKET_FILE)
    return legacy if not _is_socket(current) and _is_socket(legacy) else current


def _is_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError:
        return False


def request(
    path: str,
    op: int,
    nbytes: int = 0,
    total_after: int = 0,
    *,
    generation: int = 0,
    timeout: float = 5.0,
) -> BurstReply | None:
    """One request on the arbiter socket, as the shim sends it; the reply, or None when the
    agent closed the connection or did not answer in time (the shim then refuses)."""

    req = BurstRequest(BURST_MAGIC, ABI_VERSION, op, os.getpid(), 0, nbytes, total_after, generation)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            connect_by(s, path, time.monotonic() + timeout)
            s.settimeout(timeout)
            s.sendall(bytes(req))
            data = b""
            while len(data) < REPLY_SIZE:
                chunk = s.recv(REPLY_SIZE - len(data))
                if not chunk:
                    return None
                data += chunk
        except (TimeoutError, OSError):
            return None
    return BurstReply.from_buffer_copy(data)


def connect_by(s: socket.socket, path: str, deadline: float) -> None:
    """Connect as the shim does (mg_arbiter.c mg_connect_by): a blocking connect waits for room in
    a full backlog (bounded by SO_SNDTIMEO) instead of failing with EAGAIN at once."""
    nap = 0.001
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("no room in the arbiter's backlog")
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", int(left), int(left % 1 * 1e6)))
        try:
            s.connect(path)
            return
        except (BlockingIOError, InterruptedError):
            time.sleep(min(nap, max(0.0, deadline - time.monotonic())))
            nap = min(0.005, nap + 0.001)
