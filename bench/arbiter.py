"""Arbiter latency on the simulated node: `python -m bench.arbiter` -> bench/results/arbiter.json.

The arbiter runs on its own event loop in this process with the real ledger and the real
fake NVML; the callers are real processes in real cgroups (gpufrac.simgpu.runtime) speaking
the shim's protocol on the real socket, so identity (SO_PEERCRED -> /proc -> cgroup) is on
the measured path. Times are CLOCK_MONOTONIC, shared by all processes on the node.

* burst_grant_*_us: a burst request sent -> its GRANTED reply received (the grant already
  written to the config file), with free memory available. Each burst starts from no grant:
  a RELEASE lowers a grant only once it is GRANT_SETTLE old (docs/arbiter-protocol.md), so
  the bench waits for that after each release; otherwise the next burst would find the
  grant still there and take the shim's fast path, never reaching the arbiter.
* wait_handoff_*_ms: one container's release sent -> the waiting container's GRANTED reply
  received (docs/arbiter-protocol.md: wake-up follows a release, no polling period). The
  releasing grant is older than GRANT_SETTLE, so the release frees its bytes at once.
* grant_p99_us_under_flood: the same burst grant as burst_grant_p99_us while another
  container floods the arbiter (gpufrac.simgpu.flood, in its own cgroup): the worst of
  its floods (flood.<mode>: requests back to back from 4 processes; 1100 silent
  connections reopened as they are closed; half-sent requests; 4500 silent connections,
  past the node's connection cap; connect-and-close churn from 4 processes, never a
  request). Target: p50 and p99 each within 2x of rest (flood_p50_ratio, flood_p99_ratio:
  the worst flood's; per flood in flood.<mode>). Rest (burst_grant_p50_us, _p99_us) is
  sampled at the start and again before each flood (a third as many each time), pooled: a
  shared machine's load drifts over the minutes a run takes. The per-container limits
  (gpufrac.agent.arbiter.fairness) are at their defaults. The flooder's processes run in a CPU
  cgroup of their own with the weight a pod requesting FLOOD_CPU_REQUEST gets from the
  kubelet (cpu.shares 1024 per core requested, cgroup v1 here), as a tenant's pod does on a
  real node; the agent's loop and the neighbour keep the default weight. On a machine of few
  cores the flood's own processes compete with the agent for them: without that weight the
  figure measures the flooder's CPU as much as the agent's (`flood_cpu` in the result says
  which applied).
* swap_roundtrip_ms_per_gib_sim is not measured here: bench/swap.py (the swap resolver's
  bench) reports it; `notes` says which applies.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar

from bench import quick, results_dir

T = TypeVar("T")
GiB = 1 << 30
BURSTS, HANDOFFS = 300, 100
QUICK_BURSTS, QUICK_HANDOFFS = 4, 3


def _pct(xs: Sequence[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))]


class _Loop:
    def __init__(self) -> None:
        from gpufrac.core.eventloop import new_loop

        self.loop = new_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(120)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)


# (label, gpufrac.simgpu.flood mode, processes or connections). idle-past-cap tries to hold
# more connections than the node's cap (arbiterLimits.maxConnections, 4096); on its own
# socket the agent takes no more than its connection limit of them at a time.
FLOODS = (
    ("rate", "rate", 4),
    ("idle", "idle", 1100),
    ("slow", "slow", 1100),
    ("idle-past-cap", "idle", 4500),
    ("churn", "churn", 4),
)


# The flooding pod's CPU request, in millicores: its processes get cpu.shares of
# request * 1024 / 1000, the kubelet's rule for a Burstable pod.
FLOOD_CPU_REQUEST = 100
CPU_HIERARCHY = Path("/sys/fs/cgroup/cpu")


def _cpu_weighted(pids: Sequence[int], name: str, millicores: int) -> Path | None:
    """Move `pids` into a new CPU cgroup weighted as a pod requesting `millicores`; None
    where no cgroup v1 cpu hierarchy can be written (the flood then runs unweighted)."""
    d = CPU_HIERARCHY / name
    try:
        d.mkdir()
        (d / "cpu.shares").write_text(str(max(2, millicores * 1024 // 1000)))
        for pid in pids:
            (d / "cgroup.procs").write_text(str(pid))
    except OSError:
        _cpu_release(d)
        return None
    return d


def _cpu_release(d: Path | None) -> None:
    if d is None:
        return
    try:
        for pid in (d / "cgroup.procs").read_text().split():
            (CPU_HIERARCHY / "cgroup.procs").write_text(pid)
        d.rmdir()
    except OSError:
        pass


def run(
    bursts: int = BURSTS, handoffs: int = HANDOFFS, flood_cpu_request: int = FLOOD_CPU_REQUEST
) -> dict[str, Any]:
    import pynvml

    from gpufrac.agent.arbiter.grants import GRANT_SETTLE
    from gpufrac.agent.arbiter.service import Arbiter
    from gpufrac.agent.booking.ledger import Ledger
    from gpufrac.agent.gpu.inventory import read_inventory
    from gpufrac.agent.metrics.registry import Metrics
    from gpufrac.agent.processes.callers import PeerLookup
    from gpufrac.core import native
    from gpufrac.core.config import arbiter_socket, load
    from gpufrac.core.slices import MEMORY, device_id
    from gpufrac.deviceplugin.server import container_response
    from gpufrac.simgpu.runtime import ContainerRuntime, WorkloadDriver, mounts_of
    from gpufrac.simgpu.spec import create_node, load_preset

    from .shim import build_driver

    load_start = os.getloadavg()[0]
    root = Path(tempfile.mkdtemp(prefix="gfb", dir="/tmp"))
    create_node(load_preset("dgx-h100"), root / "node.state")
    ctypes.CDLL(str(native.library(native.FAKE_NVML)), mode=ctypes.RTLD_GLOBAL)
    os.environ["SIMGPU_STATE"] = str(root / "node.state")
    pynvml.nvmlInit()
    cfg = load(
        overrides={
            "nodeName": "bench",
            "paths": {
                "stateDir": str(root / "state"),
                "shimHostPath": str(native.library(native.SHIM)),
            },
            "resolvers": ["wait"],
        }
    )
    ledger = Ledger(cfg, read_inventory())
    gpu = ledger.inventory.gpus[0].uuid
    names: dict[
        tuple[str, str], str
    ] = {}  # (pod uid, container ID) -> container name, as the pod status says
    peers = PeerLookup(ledger, lambda uid, cid: names.get((uid, cid)))
    lt = _Loop()
    loop_kind = type(lt.loop).__module__.split(".")[0]
    arb = Arbiter(cfg, ledger, peers, arbiter_socket(cfg), metrics=Metrics())
    lt.run(arb.start())
    runtime = ContainerRuntime(view_root=root / "v")
    shim_driver = build_driver()
    nxt = 0

    def book(pod: str, gib: int, limit_gib: int) -> tuple[Any, str, Any]:
        """A container of `gib` GiB request on GPU 0: its allocation, pod uid and Allocate reply."""
        nonlocal nxt
        ids = [device_id(gpu, MEMORY, nxt + i) for i in range(gib)]
        nxt += gib
        uid = f"{nxt:08x}-0000-4000-8000-000000000000"  # nxt only grows: unique

        async def go() -> Any:
            a = ledger.allocate(MEMORY, ids)
            ledger.bind(a.key, "bench", pod, "main", uid)
            ledger.update_config(a.key, limit_bytes=limit_gib * GiB, wait_timeout_ms=60000)
            return a

        alloc = lt.run(go())
        return alloc, uid, container_response(alloc, cfg)

    def container(pod: str, gib: int, limit_gib: int) -> tuple[Any, WorkloadDriver]:
        alloc, uid, resp = book(pod, gib, limit_gib)
        c = runtime.start(
            uid,
            "main",
            [sys.executable, "-m", "gpufrac.simgpu.runtime"],
            envs={k: v for k, v in resp.envs.items() if k != "LD_PRELOAD"},
            mounts=mounts_of(resp),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        names[(uid, c.container_id)] = "main"
        return alloc, WorkloadDriver(c, pod)

    def shim_bursts(n: int) -> tuple[list[float], int]:
        """Burst latency as an application sees it: cuMemAlloc past the request under the real
        shim (C client). Returns the samples (µs) and how many bursts the arbiter granted.
        The driver pauses after each free until the shim's release has settled (twice
        GRANT_SETTLE: slack for a busy loop), so the next alloc needs a new grant."""
        _, uid, resp = book("shim", 1, 8)
        env = dict(
            os.environ, SIMGPU_STATE=str(root / "node.state"), LD_LIBRARY_PATH=str(native.native_dir())
        )
        granted = arb.stats.granted
        c = runtime.start(
            uid,
            "main",
            [str(shim_driver), "burst", "1", str(n), str(2 * GiB), str(round(2000 * GRANT_SETTLE))],
            env=env,
            envs=dict(resp.envs),
            mounts=mounts_of(resp),
            stdout=subprocess.PIPE,
        )
        names[(uid, c.container_id)] = "main"
        c.proc.wait(timeout=300)  # its output (a line per burst) fits the pipe
        assert c.proc.stdout is not None
        out = c.proc.stdout.read()
        if c.proc.returncode != 0:
            raise RuntimeError(f"shim_bench burst exited {c.proc.returncode}")
        samples = [
            int(line.split("=")[1]) / 1e3 for line in out.decode().split() if line.startswith("burst_ns=")
        ]
        granted = arb.stats.granted - granted
        # The figure is the arbiter's only if (nearly) every burst went to it: a release that
        # no longer frees the grant in time would leave the shim on its fast path.
        if 2 * granted <= len(samples):
            raise RuntimeError(
                f"the arbiter granted {granted} of {len(samples)} shim bursts: "
                "the rest took the fast path (a grant not yet released)"
            )
        return samples, granted

    def grant_of(alloc: Any) -> int:
        async def get() -> int:
            return ledger.get(alloc.key).config.grant_bytes

        return lt.run(get())

    def released(alloc: Any) -> None:
        """Wait until the arbiter has taken the container's grant back (GRANT_SETTLE after the
        grant, docs/arbiter-protocol.md), so its next burst needs a new one."""
        deadline = time.monotonic() + 10 * GRANT_SETTLE + 10
        while grant_of(alloc) > 0:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{alloc.pod}: grant of {grant_of(alloc)} bytes never released")
            time.sleep(0.002)

    def settled(granted_ns: int) -> None:
        """Sleep until a grant whose reply came at `granted_ns` (CLOCK_MONOTONIC) is older than
        GRANT_SETTLE: a release lowers it at once from then on."""
        time.sleep(max(0.0, granted_ns / 1e9 + GRANT_SETTLE + 0.005 - time.monotonic()))

    def timed(w: WorkloadDriver, cmd: str, want: str = "granted") -> tuple[int, int]:
        status, t0, t1 = w.do("t " + cmd).split()
        if status != want:
            raise RuntimeError(f"{w.name}: {cmd} -> {status}, expected {want}")
        return int(t0), int(t1)

    def grants(alloc: Any, w: WorkloadDriver, count: int = bursts) -> list[float]:
        """`count` burst grants of 1 GiB over the request, each given back before the next."""
        out = []
        for _ in range(count):
            t0, t1 = timed(w, f"alloc {GiB}")
            out.append((t1 - t0) / 1e3)
            timed(w, f"free {GiB}")
            released(alloc)
        return out

    def flooded(label: str, mode: str, n: int, alloc: Any, w: WorkloadDriver) -> tuple[list[float], int, int]:
        """The grants while another container floods the arbiter; how many of its connections
        or requests were refused BUSY meanwhile, and how many connections the agent took
        from it (on its own socket: gpufrac.agent.arbiter.listeners)."""
        flood_alloc, uid, resp = book(f"flood-{label}", 1, 2)
        c = runtime.start(
            uid,
            "main",
            [sys.executable, "-m", "gpufrac.simgpu.flood", mode, str(n)],
            envs={k: v for k, v in resp.envs.items() if k != "LD_PRELOAD"},
            mounts=mounts_of(resp),
            stdout=subprocess.PIPE,
        )
        names[(uid, c.container_id)] = "main"
        cpu: Path | None = None
        try:
            assert c.proc.stdout is not None
            if c.proc.stdout.readline().strip() != b"ready":
                raise RuntimeError(f"flood {mode} did not start")
            threading.Thread(target=c.proc.stdout.read, daemon=True).start()
            if flood_cpu_request > 0:
                cpu = _cpu_weighted(c.pids(), f"{root.name}-{label}", flood_cpu_request)
            flood_cpu[label] = cpu is not None
            own = arb.sockets.listeners[flood_alloc.key]
            busy, accepted, slowed = arb.stats.busy, own.accepted, own.slowed
            samples = grants(alloc, w)
            flood_slowed[label] = own.slowed - slowed
            return samples, arb.stats.busy - busy, own.accepted - accepted
        finally:
            c.stop()
            _cpu_release(cpu)

    try:
        # -- burst grants: a asks for 1 GiB over its grant, then gives it back.
        a_alloc, a = container("a", 8, 16)
        assert a.do(f"alloc {8 * GiB}") == "fast"
        grant_us = grants(a_alloc, a)
        flood_us: dict[str, list[float]] = {}
        flood_busy: dict[str, int] = {}
        flood_accepted: dict[str, int] = {}
        flood_cpu: dict[str, bool] = {}
        flood_slowed: dict[str, int] = {}
        rest_before: dict[str, list[float]] = {}
        for label, mode, n in FLOODS:
            # Rest again right before each flood, pooled with the first: the floods are compared
            # with rest sampled across the same run (a shared machine's load drifts in minutes).
            rest_before[label] = grants(a_alloc, a, max(1, bursts // 3))
            grant_us += rest_before[label]
            flood_us[label], flood_busy[label], flood_accepted[label] = flooded(label, mode, n, a_alloc, a)
        shim_us, shim_granted = shim_bursts(bursts)

        # -- wait handoff: b holds everything grantable; c waits; b's release wakes c.
        _, b = container("b", 20, 78)
        c_alloc, c = container("c", 20, 40)
        assert b.do(f"alloc {20 * GiB}") == "fast" and c.do(f"alloc {20 * GiB}") == "fast"
        b_alloc = ledger.get(next(k.key for k in ledger.containers() if k.pod == "b"))
        free = lt.run(arb.grantable(b_alloc))
        _, b_granted = timed(b, f"alloc {free}")
        handoff_ms = []
        for _ in range(handoffs):
            c.send(f"t alloc {GiB}")
            deadline = time.monotonic() + 30
            while lt.run(_waiters(arb)) < 1:
                if time.monotonic() > deadline:
                    raise RuntimeError("c never waited")
                time.sleep(0.001)
            settled(b_granted)
            r0, _ = timed(b, f"free {GiB}")
            status, _, c1 = c.line().split()
            if status != "granted":
                raise RuntimeError(f"c: waited alloc -> {status}")
            handoff_ms.append((int(c1) - r0) / 1e6)
            timed(c, f"free {GiB}")
            released(c_alloc)
            _, b_granted = timed(b, f"alloc {GiB}")
        del a_alloc
    finally:
        runtime.close()
        lt.run(arb.stop())
        lt.close()
        for alloc in ledger.containers():
            ledger.release(alloc.key)
        pynvml.nvmlShutdown()
        shutil.rmtree(root, ignore_errors=True)

    rest_p50, rest_p99 = statistics.median(grant_us), _pct(grant_us, 99)
    flood_p50 = {mode: statistics.median(xs) for mode, xs in flood_us.items()}
    flood_p99 = {mode: _pct(xs, 99) for mode, xs in flood_us.items()}
    worst = max(flood_p99.values())
    out: dict[str, Any] = {
        "burst_grant_p50_us": round(rest_p50, 1),
        "burst_grant_p99_us": round(rest_p99, 1),
        # The same grants while another container floods the arbiter: the worst flood's p99.
        "grant_p99_us_under_flood": round(worst, 1),
        "flood_p99_ratio": round(worst / rest_p99, 2),
        "flood_p50_ratio": round(max(flood_p50.values()) / rest_p50, 2),
        "flood": {
            label: {
                "processes_or_connections": n,
                "grant_p50_us": round(flood_p50[label], 1),
                "grant_p99_us": round(flood_p99[label], 1),
                "p50_ratio": round(flood_p50[label] / rest_p50, 2),
                "p99_ratio": round(flood_p99[label] / rest_p99, 2),
                # The rest sampled right before it (a third as many grants): its p50.
                "rest_before_p50_us": round(statistics.median(rest_before[label]), 1),
                "refused_busy": flood_busy[label],
                "connections_accepted": flood_accepted[label],
                # Times its socket stopped accepting for its rate (connections charged at accept).
                "slowed_at_accept": flood_slowed[label],
            }
            for label, _, n in FLOODS
        },
        # Whether the flood ran under the CPU weight of its pod's request (see the docstring).
        "flood_cpu": {
            "request_millicores": flood_cpu_request,
            "weighted": all(flood_cpu.values()),
        },
        # The same grant seen by an application: cuMemAlloc past the request under the C shim.
        "burst_grant_shim_p50_us": round(statistics.median(shim_us), 1),
        "burst_grant_shim_p99_us": round(_pct(shim_us, 99), 1),
        "wait_handoff_p50_ms": round(statistics.median(handoff_ms), 3),
        "wait_handoff_p99_ms": round(_pct(handoff_ms, 99), 3),
        "samples": {
            "bursts": len(grant_us),  # at rest, all segments
            "shim_bursts": len(shim_us),
            "shim_bursts_granted_by_arbiter": shim_granted,
            "flood_bursts": {mode: len(xs) for mode, xs in flood_us.items()},
            "handoffs": len(handoff_ms),
        },
        # The 1-minute load average at the start and the end of the run: how quiet it was.
        "machine": {"cpus": os.cpu_count(), "load_1m_start": load_start, "load_1m": os.getloadavg()[0]},
        "event_loop": loop_kind,  # the agent's loop (gpufrac.core.eventloop): uvloop or asyncio
        "notes": [
            "client-side times from a Python client process speaking the shim's protocol "
            "(includes its socket connect and the agent's SO_PEERCRED/cgroup identity lookup)",
        ],
    }
    out["notes"].append("swap_roundtrip_ms_per_gib_sim: measured by bench/swap.py (the swap resolver's)")
    return out


async def _waiters(arb: Any) -> int:
    return sum(len(v) for v in arb.queue.waiters.values())


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.arbiter", description=__doc__.splitlines()[0])
    p.add_argument("--bursts", type=int, default=QUICK_BURSTS if quick() else BURSTS)
    p.add_argument("--handoffs", type=int, default=QUICK_HANDOFFS if quick() else HANDOFFS)
    p.add_argument("--out", type=Path, default=results_dir() / "arbiter.json")
    p.add_argument(
        "--flood-cpu-request",
        type=int,
        default=FLOOD_CPU_REQUEST,
        help="the flooding pod's CPU request in millicores (its cgroup's weight); 0: unweighted",
    )
    args = p.parse_args(argv)
    result = run(args.bursts, args.handoffs, args.flood_cpu_request)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
