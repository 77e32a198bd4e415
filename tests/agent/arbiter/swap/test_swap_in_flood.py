"""A flood of SWAP_INs from one container costs the agent a bounded number of /proc scans.

A container's `swapped` flags live in its own usage file. Flagged, a SWAP_IN from a container
this agent did not swap out makes the agent look for the container's processes (a previous
agent may have swapped them out): a scan of every process on the node by cgroup, and a driver
call for each of the container's (gpufrac.agent.arbiter.swap.takeover). Each SWAP_IN used to take a
scan of its own, and the arbiter lets a container send 200 requests a second: one tenant kept
a worker thread scanning /proc, on any node whose driver has the checkpoint API, swap in its
resolvers or not. Now one container's scans begin at least RESCAN_SPACING apart and the
SWAP_INs in between share the last one's conclusion; a neighbour a previous agent swapped out
still comes back at once, bytes intact.

The arbiter runs in this process (tests/fixtures/arbiter_harness.py) with the fake driver's
checkpoint API; the flooder is a process in its pod's real cgroup on its real socket, the
neighbour the real workload under the real shim.
"""

from __future__ import annotations

import ctypes
import json
import threading
import time
from collections.abc import Callable

import pytest

from gpufrac.agent.arbiter.swap import takeover as swap_takeover
from gpufrac.agent.arbiter.swap.takeover import RESCAN_SPACING
from gpufrac.agent.booking.ledger import ContainerAlloc
from gpufrac.agent.processes.callers import PeerLookup
from gpufrac.core import native
from gpufrac.memguard import abi
from tests.fixtures.arbiter_harness import ArbiterNode, GiB, go

pytestmark = pytest.mark.security

Make = Callable[..., ArbiterNode]
TIMEOUT = 120.0

# A tenant process: it claims a slot of its container's usage file under its own identity,
# then from `threads` threads, for `seconds`, sets that slot's swapped flag (the agent clears
# it when it finds the process running) and sends SWAP_IN, back to back, once told to go. It
# prints how many requests were answered, by status.
FLOOD = r"""
import json, os, sys, threading, time
from gpufrac.agent.processes.proc import proc_identity
from gpufrac.memguard import abi, wire
d = os.environ["GPUFRAC_CONTAINER_DIR"]
path = wire.socket_path(d)
threads, seconds = int(sys.argv[1]), float(sys.argv[2])
usage = abi.UsageFile(d)
slot = usage.usage.slots[0]
slot.pid, slot.start_time = proc_identity(os.getpid())
print("ready", flush=True)
sys.stdin.readline()
out = []
def run():
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        slot.swapped = 1
        rep = wire.request(path, wire.BURST_OP_SWAP_IN, 0, 0, timeout=20)
        out.append(None if rep is None else rep.status)
ts = [threading.Thread(target=run) for _ in range(threads)]
for t in ts:
    t.start()
for t in ts:
    t.join()
print(json.dumps({wire.STATUS_NAMES.get(s, str(s)): out.count(s) for s in set(out)}), flush=True)
"""


def test_a_swap_in_flood_forces_a_bounded_number_of_process_scans(
    make_node: Make, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The agent's side of the checkpoint API is cuda-python in this process: the fake
    # libcuda.so.1 loaded first is what it finds by soname (its cuInit binds make_node's node).
    ctypes.CDLL(str(native.library(native.FAKE_CUDA)), mode=ctypes.RTLD_GLOBAL)
    node = make_node(
        resolvers=["swap", "wait"],
        paths={"shimHostPath": str(native.library(native.SHIM))},
    )
    swap = node.arbiter.swap
    assert swap is not None and node.on_loop(swap.detect).available

    # A neighbour swapped out, then the agent restarted: this one knows nothing of it.
    n = node.add("neighbour", 2, "8Gi", start=False)
    node.swappable(n)
    app = node.start_cuda(n, timeout=TIMEOUT)
    assert app.do(f"alloc {GiB} 1111", TIMEOUT) == "ok 1"
    ok, why = node.on_loop(lambda: swap.swap_out(n.alloc, "the test"))
    assert ok, why
    node.on_loop(swap.swapped.clear)

    scans: list[float] = []
    real = swap_takeover.processes_of

    def counted(alloc: ContainerAlloc, peers: PeerLookup) -> list[int] | None:
        scans.append(time.monotonic())
        return real(alloc, peers)

    monkeypatch.setattr(swap_takeover, "processes_of", counted)
    flood_s = 4.0
    t = node.add("tenant", 2, "8Gi", start=False)
    proc = node.start_script(t, FLOOD, 8, flood_s)  # the SWAP_IN flood, ready to go
    go(proc)
    node.until(lambda: len(scans) >= 2, timeout=TIMEOUT, what="the flood under way")

    # In the middle of the flood, the neighbour's next GPU work brings it back, promptly.
    back = threading.Event()
    answer: list[str] = []

    def neighbour() -> None:
        answer.append(app.do("check 1", TIMEOUT))
        back.set()

    t0 = time.monotonic()
    threading.Thread(target=neighbour, daemon=True).start()
    assert back.wait(TIMEOUT) and answer == ["ok"], answer
    took = time.monotonic() - t0
    out, _ = proc.communicate(timeout=TIMEOUT)
    statuses = json.loads(out)

    # The flood was served (GRANTED: nothing of the tenant is held by the driver), hundreds of
    # requests ...
    assert statuses.get("granted", 0) >= 100, statuses
    # ... on at most one scan per RESCAN_SPACING (and a few more: the neighbour's), not one each.
    assert len(scans) <= flood_s / RESCAN_SPACING + 4, (
        len(scans),
        statuses,
        " ".join(f"{s - scans[0]:.3f}" for s in scans),
    )
    # The neighbour came back within a few spacings, flood or not, and is no longer swapped.
    assert took < 10 * RESCAN_SPACING + 5, took
    assert not swap.is_swapped(n.alloc.key)
    assert not any(s.swapped for s in abi.read_usage(n.alloc.directory).slots)
