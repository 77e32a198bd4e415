"""A hostile container's arbiter flood: `python -m gpufrac.simgpu.flood MODE N` in a container.

What a tenant can do with its end of the arbiter socket, for the fairness tests and the
bench (gpufrac.agent.arbiter.fairness is the defence):

    idle N   keep N connections open that never send a byte (reopened when closed)
    slow N   the same, each having sent half a request (slowloris)
    rate N [BYTES]  N processes sending BURST requests (of BYTES, default 1 GiB) back to
             back, as fast as answers come (a burst that has to wait holds its process)
    junk N   N processes sending random bytes, a connection each
    churn N  N processes connecting and closing at once, never waiting for an answer,
             retrying a full backlog at once (non-blocking connect): the agent's listen
             queue kept full

It prints "ready" once the flood is under way, then one line per second:
"<connects> <replies> <busy replies>" (for rate and junk, the first process's counts
only). It runs until killed.
"""

from __future__ import annotations

import ctypes
import os
import random
import resource
import selectors
import signal
import socket
import sys
import time

from gpufrac.memguard import abi, wire

CONTAINER_DIR_ENV = "GPUFRAC_CONTAINER_DIR"


def _path() -> str:
    return wire.socket_path(os.environ.get(CONTAINER_DIR_ENV, abi.DEFAULT_DIR))


def _request(nbytes: int) -> bytes:
    return bytes(
        wire.BurstRequest(
            wire.BURST_MAGIC,
            abi.ABI_VERSION,
            wire.BURST_OP_BURST,
            os.getpid(),
            0,
            nbytes,
            nbytes,
            0,
        )
    )


def hold(path: str, n: int, half: bool) -> None:
    """Keep `n` connections open, each silent or with half a request sent. A connection the
    agent's listen queue has no room for (EAGAIN: the agent stopped accepting this container's)
    is tried again every round, as a flooder would, never waited for."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, n + 64)), hard))
    sel = selectors.DefaultSelector()
    stats = [0, 0, 0]
    partial = _request(1 << 30)[: ctypes.sizeof(wire.BurstRequest) // 2]

    def open_one() -> bool:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK)
        try:
            s.connect(path)
            if half:
                s.send(partial)
        except OSError:
            s.close()
            return False
        stats[0] += 1
        sel.register(s, selectors.EVENT_READ)
        return True

    for _ in range(n):
        if not open_one():
            time.sleep(0.001)
    print("ready", flush=True)
    last = time.monotonic()
    while True:
        for key, _ in sel.select(0.05):
            s = key.fileobj
            assert isinstance(s, socket.socket)
            try:
                data = s.recv(64)
            except OSError:
                data = b""
            if len(data) >= 8:
                stats[1] += 1
                stats[2] += int.from_bytes(data[6:8], sys.byteorder) == wire.BURST_BUSY
            sel.unregister(s)
            s.close()
        for _ in range(min(64, n - len(sel.get_map()))):  # back to n, as far as the agent lets it
            if not open_one():
                break
        if time.monotonic() - last >= 1:
            last = time.monotonic()
            print(*stats, flush=True)


def hammer(path: str, junk: bool, report: bool, nbytes: int) -> None:
    """Requests back to back, each on a new connection, as the shim sends them."""
    stats = [0, 0, 0]
    rng = random.Random(os.getpid())
    req = _request(nbytes)
    last = time.monotonic()
    while True:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(120)
            try:
                s.connect(path)
                stats[0] += 1
                s.sendall(rng.randbytes(rng.randrange(1, 200)) if junk else req)
                data = s.recv(64)
                if len(data) >= 8:
                    stats[1] += 1
                    stats[2] += int.from_bytes(data[6:8], sys.byteorder) == wire.BURST_BUSY
            except OSError:
                pass
        if report and time.monotonic() - last >= 1:
            last = time.monotonic()
            print(*stats, flush=True)


def churn(path: str, report: bool) -> None:
    """Connect and close, as fast as the kernel lets: a full backlog (EAGAIN) is retried at once."""
    stats = [0, 0, 0]
    last = time.monotonic()
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK)
        try:
            s.connect(path)
            stats[0] += 1
        except OSError:
            pass
        finally:
            s.close()
        if report and time.monotonic() - last >= 1:
            last = time.monotonic()
            print(*stats, flush=True)


def main(argv: list[str]) -> int:
    mode, n = argv[0], int(argv[1])
    nbytes = int(argv[2]) if len(argv) > 2 else 1 << 30
    path = _path()
    if mode in ("idle", "slow"):
        hold(path, n, mode == "slow")
        return 0
    if mode not in ("rate", "junk", "churn"):
        print(f"unknown mode {mode}", file=sys.stderr)
        return 2
    children = []
    for _ in range(n - 1):
        pid = os.fork()
        if pid == 0:
            try:
                if mode == "churn":
                    churn(path, False)
                hammer(path, mode == "junk", False, nbytes)
            finally:
                os._exit(0)
        children.append(pid)

    def stop(*_: object) -> None:
        for pid in children:
            os.kill(pid, signal.SIGKILL)
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    print("ready", flush=True)
    try:
        if mode == "churn":
            churn(path, True)
        hammer(path, mode == "junk", True, nbytes)
    finally:
        stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
