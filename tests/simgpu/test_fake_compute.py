"""simgpu's compute model (docs/simgpu.md "Compute model"), driven by real cuda-python workloads.

Kernels take GPU time and occupy SMs: kernels of one context share its SMs and run side by side;
contexts of different processes time-slice the GPU; NVML's device and per-process utilisation come
from that schedule. Figures are read in the model's own time (the node-state file's busy clocks,
events resolved to the wall time the GPU reached them), so a loaded host delays when work is
submitted but not what the model says the GPU did with it.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

import pynvml
import pytest

from tests.fixtures.fakecuda import Workload, gpu_fields, ok, run_py, slot_fields
from tests.fixtures.polling import until
from tests.fixtures.simnode import SimNode, nvml_in_process

MS = 1_000_000
SMS = 132  # the dgx-h100 preset's SM count

# A process that, on "go", queues `n` busy_us kernels of `us` microseconds (grid of `blocks`) on
# a stream of its own, says so, and on "sync" waits for them and says how long its work took on
# the GPU (an event before the first kernel to one after the last).
HOG = """
n, us, blocks = {n}, {us}, {blocks}
dev, ctx = setup(0)
k = kernels()
s = ck(d.cuStreamCreate(0))
e0, e1 = ck(d.cuEventCreate(0)), ck(d.cuEventCreate(0))
say(ready=True)
wait_for("go")
ck(d.cuEventRecord(e0, s))
for _ in range(n):
    ck(d.cuLaunchKernel(k["busy_us"], blocks, 1, 1, 1, 1, 1, 0, s, ((us,), (U64,)), 0))
ck(d.cuEventRecord(e1, s))
say(queued=True)
wait_for("sync")
ck(d.cuStreamSynchronize(s))
say(ms=ck(d.cuEventElapsedTime(e0, e1)))
wait_for("exit")
"""


def hogs(node: SimNode, count: int, n: int, us: int, blocks: int = SMS) -> list[Workload]:
    """`count` HOG processes, started, then told to queue their work together."""
    ws = [Workload(node, HOG.format(n=n, us=us, blocks=blocks)) for _ in range(count)]
    for w in ws:
        assert w.read()["ready"]
    for w in ws:
        w.send("go")
    for w in ws:
        assert w.read()["queued"]
    return ws


def busy_ns(node: SimNode, pid: int) -> int:
    return sum(s["busy_ns_total"] for s in slot_fields(node, pid))


@pytest.mark.parametrize("flavour", ["release", "asan"])
def test_kernels_of_one_context_share_its_sms(make_sim_node: Callable[..., SimNode], flavour: str) -> None:
    """Two 20 ms kernels on two streams of one context: side by side when each asks for half the
    SMs, one after the other's SM work when each asks for all of them. A 200 ms kernel on a third
    stream holds both back (cuStreamWaitEvent) so they start together however slow the host is."""
    node = make_sim_node(flavour=flavour)
    (res,) = ok(
        run_py(
            node,
            """
            dev, ctx = setup(0)
            k = kernels()
            gate, s1, s2 = (ck(d.cuStreamCreate(0)) for _ in range(3))
            out = {}
            for blocks in (66, 132):
                go, e1, e2 = (ck(d.cuEventCreate(0)) for _ in range(3))
                ck(d.cuLaunchKernel(k["busy_us"], 132, 1, 1, 1, 1, 1, 0, gate, ((200_000,), (U64,)), 0))
                ck(d.cuEventRecord(go, gate))
                for s, e in ((s1, e1), (s2, e2)):
                    ck(d.cuStreamWaitEvent(s, go, 0))
                    ck(d.cuLaunchKernel(k["busy_us"], blocks, 1, 1, 1, 1, 1, 0, s, ((20_000,), (U64,)), 0))
                    ck(d.cuEventRecord(e, s))
                ck(d.cuCtxSynchronize())
                out[blocks] = max(ck(d.cuEventElapsedTime(go, e)) for e in (e1, e2))
            say(half=out[66], full=out[132])
            """,
        )
    )
    assert res["half"] == pytest.approx(20.0, abs=0.1)
    assert res["full"] == pytest.approx(40.0, abs=0.1)


def test_processes_time_slice_the_gpu(make_sim_node: Callable[..., SimNode]) -> None:
    """Two processes with work queued share the GPU in time slices: NVML gives each half of it and
    the device all of it, the GPU switches between them about once per slice, and the one that
    finishes last has waited for the other's work as well as its own."""
    node = make_sim_node()
    a, b = hogs(node, 2, 100, 10_000)  # 1 s of work each
    try:
        with nvml_in_process(node.path):
            h = pynvml.nvmlDeviceGetHandleByIndex(0)
            pynvml.nvmlDeviceGetUtilizationRates(h)
            pynvml.nvmlDeviceGetProcessUtilization(h, 0)
            switches0 = gpu_fields(node, 0)["switches"]
            t0 = time.monotonic()
            time.sleep(0.2)
            util = pynvml.nvmlDeviceGetUtilizationRates(h).gpu
            procs = {s.pid: s.smUtil for s in pynvml.nvmlDeviceGetProcessUtilization(h, 0)}
            span = time.monotonic() - t0
            switches = gpu_fields(node, 0)["switches"] - switches0
        assert util == 100
        assert procs[a.p.pid] == pytest.approx(50, abs=3) and procs[b.p.pid] == pytest.approx(50, abs=3)
        slices = span / 0.002  # the preset's 2 ms time slice
        assert 0.8 * slices <= switches <= 1.2 * slices + 2
        for w in (a, b):
            w.send("sync")
        took = sorted(w.read()["ms"] for w in (a, b))
        # Each ran its own 1 s; the later one also waited while the other ran (most of its 1 s).
        assert took[1] > 1800
        assert busy_ns(node, a.p.pid) == busy_ns(node, b.p.pid) == 1000 * MS
    finally:
        a.kill()
        b.kill()


def test_a_short_kernel_waits_for_the_holders_time_slice(make_sim_node: Callable[..., SimNode]) -> None:
    """A 1 ms kernel of a process whose neighbour has long kernels queued waits until the
    neighbour's slice ends (at most 2 ms), then runs: a kernel at a time, as the GPU switches
    contexts, never behind the neighbour's whole queue."""
    node = make_sim_node()
    (neighbour,) = hogs(node, 1, 40, 50_000)  # 2 s of 50 ms kernels
    try:
        (res,) = ok(
            run_py(
                node,
                """
                dev, ctx = setup(0)
                k = kernels()
                s = ck(d.cuStreamCreate(0))
                e0, e1 = ck(d.cuEventCreate(0)), ck(d.cuEventCreate(0))
                took = []
                for _ in range(25):
                    ck(d.cuEventRecord(e0, s))
                    ck(d.cuLaunchKernel(k["busy_us"], 132, 1, 1, 1, 1, 1, 0, s, ((1000,), (U64,)), 0))
                    ck(d.cuEventRecord(e1, s))
                    ck(d.cuEventSynchronize(e1))
                    took.append(ck(d.cuEventElapsedTime(e0, e1)))
                say(took=sorted(took))
                """,
            )
        )
        took = res["took"]
        median = took[len(took) // 2]
        assert took[0] >= 1.0 and 1.2 < median <= 3.5, took  # 1 ms of its own plus part of a slice
    finally:
        neighbour.kill()


def test_graph_launches_take_their_kernels_time(sim_node: SimNode) -> None:
    """A graph's kernel nodes take GPU time like launched kernels: five 4 ms nodes, launched
    three times, are 60 ms of the context's work and 15 launches."""
    w = Workload(
        sim_node,
        """
        dev, ctx = setup(0)
        k = kernels()
        s = ck(d.cuStreamCreate(0))
        ck(d.cuStreamBeginCapture(s, d.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL))
        for _ in range(5):
            ck(d.cuLaunchKernel(k["busy_us"], 132, 1, 1, 1, 1, 1, 0, s, ((4000,), (U64,)), 0))
        g = ck(d.cuStreamEndCapture(s))
        ge = ck(d.cuGraphInstantiate(g, 0))
        e0, e1 = ck(d.cuEventCreate(0)), ck(d.cuEventCreate(0))
        ck(d.cuEventRecord(e0, s))
        for _ in range(3):
            ck(d.cuGraphLaunch(ge, s))
        ck(d.cuEventRecord(e1, s))
        ck(d.cuStreamSynchronize(s))
        say(ms=ck(d.cuEventElapsedTime(e0, e1)))
        wait_for("exit")
        """,
    )
    try:
        ms = w.read()["ms"]
        (slot,) = slot_fields(sim_node, w.p.pid)
        assert slot["busy_ns_total"] == 60 * MS and slot["launches"] == 15
        assert ms >= 60.0  # at least its own work; more only if the host was slow to launch
    finally:
        w.kill()


def test_a_killed_process_stops_holding_the_gpu(make_sim_node: Callable[..., SimNode]) -> None:
    """Work queued by a process that is killed goes with its context: a neighbour's kernel then
    waits at most one more slice, not for the dead one's 10 s of queue."""
    node = make_sim_node()
    (dead,) = hogs(node, 1, 100, 100_000)  # 10 s of work
    dead.p.send_signal(signal.SIGKILL)
    dead.p.wait(timeout=30)
    (res,) = ok(
        run_py(
            node,
            """
            dev, ctx = setup(0)
            k = kernels()
            s = ck(d.cuStreamCreate(0))
            e0, e1 = ck(d.cuEventCreate(0)), ck(d.cuEventCreate(0))
            ck(d.cuEventRecord(e0, s))
            ck(d.cuLaunchKernel(k["busy_us"], 132, 1, 1, 1, 1, 1, 0, s, ((10_000,), (U64,)), 0))
            ck(d.cuEventRecord(e1, s))
            ck(d.cuStreamSynchronize(s))
            say(ms=ck(d.cuEventElapsedTime(e0, e1)))
            """,
        )
    )
    assert 10.0 <= res["ms"] < 100.0
    # And the device goes idle once the live work is done.
    with nvml_in_process(node.path):
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        pynvml.nvmlDeviceGetUtilizationRates(h)
        until(lambda: pynvml.nvmlDeviceGetUtilizationRates(h).gpu == 0, timeout=30, what="the GPU idle")
