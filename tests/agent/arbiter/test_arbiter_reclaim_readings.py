"""A flood of RECLAIMs from one container does not make the agent read the driver for each.

A RECLAIM says "the driver refused an allocation within my request". The agent must judge it
on an NVML reading taken after the request came (a cached one may predate the burst that
holds the memory), and a full reading lists every GPU process and reads its cgroup. Each
RECLAIM used to take a reading of its own, before even the refusals that need none: a
container within its fairness limits could have hundreds taken a second. Now the refusals
on the caller's own word come first, requests that need a reading share the one under way
when it began after they came (one reading at a time, a sample never replaced by an older
one), and the readings one container's RECLAIMs force are at least RECLAIM_SPACING apart
(gpufrac.agent.arbiter.readings.DriverReadings.taken_since,
gpufrac.agent.arbiter.Arbiter._reclaim_reading_at). A neighbour's RECLAIM meanwhile still
gets a reading taken after it asked.

The arbiter runs in this process on simgpu's NVML (tests/fixtures/arbiter_harness.py); the
RECLAIMs come over the real sockets from processes in the pods' real cgroups.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Callable

import pytest

from gpufrac.agent.arbiter.service import RECLAIM_SPACING
from gpufrac.agent.gpu.processes import Observed
from tests.fixtures.arbiter_harness import ArbiterNode, Box, MiB, go

pytestmark = pytest.mark.security

Make = Callable[..., ArbiterNode]

# A container process sending RECLAIMs (each "the driver refused `nbytes` within my request")
# from `threads` threads, back to back for `seconds` (at least one each), once told to go.
# It prints how many were answered GRANTED, how many answered at all, and the monotonic times
# around its first request.
RECLAIMS = r"""
import json, os, sys, threading, time
from gpufrac.memguard import wire
path = wire.socket_path(os.environ["GPUFRAC_CONTAINER_DIR"])
threads, seconds, nbytes = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
print("ready", flush=True)
sys.stdin.readline()
out, first = [], []
def run():
    end = time.monotonic() + seconds
    while True:
        t0 = time.monotonic()
        rep = wire.request(path, wire.BURST_OP_RECLAIM, nbytes, nbytes, timeout=20)
        if not first:
            first.append((t0, time.monotonic()))
        out.append(None if rep is None else rep.status)
        if time.monotonic() >= end:
            break
ts = [threading.Thread(target=run) for _ in range(threads)]
for t in ts:
    t.start()
for t in ts:
    t.join()
granted = sum(1 for s in out if s == wire.BURST_GRANTED)
statuses = {wire.STATUS_NAMES.get(s, str(s)): out.count(s) for s in set(out)}
print(json.dumps({"granted": granted, "statuses": statuses, "first": first[0]}), flush=True)
"""


def reclaimer(node: ArbiterNode, box: Box, threads: int, seconds: float) -> subprocess.Popen[bytes]:
    """Start `box`'s container with the RECLAIM sender, ready to go (its container ID known)."""
    return node.start_script(box, RECLAIMS, threads, seconds, 64 * MiB)


def result(proc: subprocess.Popen[bytes]) -> dict[str, object]:
    out, _ = proc.communicate(timeout=120)
    return dict(json.loads(out))


def test_a_reclaim_flood_forces_a_bounded_number_of_driver_readings(make_node: Make) -> None:
    node = make_node(resolvers=["evict", "wait"])
    t = node.add("t", 4, "8Gi", start=False)
    n = node.add("n", 4, "8Gi", start=False)
    readings = node.arbiter.readings
    real = readings.read_processes
    began: list[float] = []
    lock = threading.Lock()

    def listing() -> list[Observed]:
        with lock:
            began.append(time.monotonic())
        return real()

    flood_s = 3.0
    flooder = reclaimer(node, t, threads=16, seconds=flood_s)
    neighbour = reclaimer(node, n, threads=1, seconds=0)
    readings.read_processes = listing
    try:
        go(flooder)
        node.until(lambda: len(began) >= 3, what="the flood under way")
        go(neighbour)  # one RECLAIM, in the middle of the flood
        mine = result(neighbour)
        theirs = result(flooder)
    finally:
        readings.read_processes = real
    # The flood was served, not turned away: its RECLAIMs (within its request, its guarantee
    # physically free) were granted, hundreds of them.
    granted = theirs["granted"]
    assert isinstance(granted, int) and granted >= 40, theirs
    # ... on at most one reading per RECLAIM_SPACING (and a few more: the neighbour's, the
    # loop's own), not one each.
    assert len(began) <= flood_s / RECLAIM_SPACING + 8, (
        len(began),
        theirs,
        " ".join(f"{b - began[0]:.3f}" for b in began),
    )
    # The neighbour's RECLAIM was granted on a reading begun after it asked.
    assert mine["granted"] == 1, mine
    sent, answered = mine["first"]  # type: ignore[misc]
    assert any(sent <= b <= answered for b in began), (sent, answered, began)
