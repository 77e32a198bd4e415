"""A PyTorch process keeping a real GPU busy, speaking gpufrac.simgpu.computeload's lines (so the
compute-share harness, bench/_compute_node.py, drives it as it drives the simulated one):

    spin MS DEPTH THREADS KIND  THREADS threads each run square matmuls sized to take about MS
                                milliseconds alone, on a stream of their own, at most DEPTH
                                unfinished; KIND launch (plain kernels) or graph (each step a
                                captured CUDA graph replayed), a comma-separated list taken in
                                turn -> "ok"
    procs N US DEPTH            N more processes of this program (the same container) spinning
                                one thread of plain kernels each, until `stop` -> "ok"
    stop                        -> "ok launches=<matmuls done here> seconds=<spinning>"
    lat US N GAP_MS             N small matmuls (about US microseconds alone) one at a time,
                                GAP_MS apart, timed by CUDA events -> "lat p50=<ms> p99=<ms> max=<ms>"
    exit                        -> "bye"

What the test reads is its throughput (matmuls a second): the share of the GPU it got, measured
the way users measure it, against the same process alone.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import torch

DEV = torch.device("cuda", 0)


def _size_for(ms: float) -> int:
    """A matmul size n (n x n, fp16) taking about `ms` milliseconds alone on this GPU."""
    n = 1024
    while True:
        a = torch.randn(n, n, device=DEV, dtype=torch.float16)
        for _ in range(3):
            a @ a
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            a @ a
        torch.cuda.synchronize()
        took = (time.perf_counter() - t0) / 5 * 1000
        if took >= ms or n >= 32768:
            return n
        n = int(n * max(1.1, min(2.0, (ms / max(took, 1e-3)) ** (1 / 3))))


class Spin:
    def __init__(self, ms: float, depth: int, threads: int, kinds: list[str]) -> None:
        self.n = _size_for(ms)
        self.stopping = threading.Event()
        self.done = 0
        self.lock = threading.Lock()
        self.t0 = time.monotonic()
        self.threads = [
            threading.Thread(target=self.run, args=(max(1, depth), kinds[i % len(kinds)]), daemon=True)
            for i in range(threads)
        ]
        for t in self.threads:
            t.start()

    def run(self, depth: int, kind: str) -> None:
        stream = torch.cuda.Stream(device=DEV)
        a = torch.randn(self.n, self.n, device=DEV, dtype=torch.float16)
        out = torch.empty_like(a)
        step = lambda: torch.matmul(a, a, out=out)  # noqa: E731
        with torch.cuda.stream(stream):
            if kind == "graph":
                step()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, stream=stream):
                    torch.matmul(a, a, out=out)
                step = g.replay
            events = [torch.cuda.Event() for _ in range(depth)]
            i = 0
            while not self.stopping.is_set():
                if i >= depth:
                    events[i % depth].synchronize()
                    with self.lock:
                        self.done += 1
                step()
                events[i % depth].record(stream)
                i += 1
            stream.synchronize()

    def stop(self) -> tuple[int, float]:
        self.stopping.set()
        for t in self.threads:
            t.join()
        return self.done, time.monotonic() - self.t0


def latency(us: float, n: int, gap_ms: float) -> str:
    size = _size_for(us / 1000)
    a = torch.randn(size, size, device=DEV, dtype=torch.float16)
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    took = []
    for _ in range(n):
        e0.record()
        a @ a
        e1.record()
        e1.synchronize()
        took.append(e0.elapsed_time(e1))
        time.sleep(gap_ms / 1000)
    took.sort()
    pct = lambda p: took[min(len(took) - 1, round(p / 100 * (len(took) - 1)))]  # noqa: E731
    return f"lat p50={pct(50):.3f} p99={pct(99):.3f} max={took[-1]:.3f}"


def main() -> int:
    torch.ones(1, device=DEV)  # the context first
    if sys.argv[1:2] == ["--spin"]:
        alone = Spin(float(sys.argv[2]) / 1000, int(sys.argv[3]), 1, ["launch"])
        print("ready", flush=True)
        sys.stdin.read()  # until the parent closes it
        alone.stop()
        return 0
    print("ready", flush=True)
    spin: Spin | None = None
    children: list[subprocess.Popen[bytes]] = []
    for line in sys.stdin:
        cmd, *a = line.split() or [""]
        if cmd == "spin":
            spin = spin or Spin(float(a[0]) / 1000, int(a[1]), int(a[2]), a[3].split(","))
            print("ok", flush=True)
        elif cmd == "procs":
            for _ in range(int(a[0])):
                p = subprocess.Popen(
                    [sys.executable, __file__, "--spin", a[1], a[2]],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                )
                assert p.stdout is not None and p.stdout.readline().strip() == b"ready"
                children.append(p)
            print("ok", flush=True)
        elif cmd == "stop":
            done, seconds = spin.stop() if spin else (0, 0.0)
            spin = None
            for p in children:
                assert p.stdin is not None
                p.stdin.close()
                p.wait(120)
            children.clear()
            print(f"ok launches={done} seconds={seconds:.3f}", flush=True)
        elif cmd == "lat":
            print(latency(float(a[0]), int(a[1]), float(a[2])), flush=True)
        elif cmd == "exit":
            print("bye", flush=True)
            return 0
        else:
            print(f"error unknown command {cmd!r}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
