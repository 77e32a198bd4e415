"""A compute workload for the simulated node: a real CUDA program (cuda-python over the fake
libcuda, under the memguard shim when LD_PRELOAD says so) that keeps the GPU busy with kernels,
driven line by line on stdin (compute shares: docs/compute.md; the bench and the tests).

    python -m gpufrac.simgpu.computeload

Commands, one per line; each answers exactly one line:

    spin US DEPTH THREADS KIND  THREADS threads launch busy_us(US) kernels (all the GPU's SMs) by
                                KIND (launch: cuLaunchKernel, ex: cuLaunchKernelEx, graph: a
                                captured graph of one kernel, cuGraphLaunch; a comma-separated
                                list: the threads take them in turn), each on its own stream, at
                                most DEPTH unfinished at a time, until `stop` -> "ok"
    procs N US DEPTH            N more processes of this program (the same container: they
                                inherit its cgroup and environment), each spinning one thread
                                of launches, until `stop` -> "ok"
    stop                        stop spinning (threads and processes) -> "ok launches=<N>"
    lat US N GAP_MS             N kernels of US microseconds one at a time, GAP_MS apart, each
                                timed by events around it (what the GPU took, waiting for the
                                neighbours' time slices included)
                                -> "lat p50=<ms> p99=<ms> max=<ms>"
    exit                        -> "bye"

It prints "ready" once CUDA is initialised. With `--spin US DEPTH` it spins one thread at once
and exits when stdin closes (the processes `procs` starts).
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
import threading
import time
from typing import Any

MODULE_IMAGE = b"SIMGPU-MODULE"
SMS = 132  # a grid this large occupies every SM of the presets' GPUs


class _Gpu:
    def __init__(self) -> None:
        from cuda.bindings import driver as cu

        self.cu = cu
        self.chk(cu.cuInit(0))
        dev = self.chk(cu.cuDeviceGet(0))
        self.ctx = self.chk(cu.cuDevicePrimaryCtxRetain(dev))
        self.chk(cu.cuCtxSetCurrent(self.ctx))
        mod = self.chk(cu.cuModuleLoadData(MODULE_IMAGE))
        self.busy = self.chk(cu.cuModuleGetFunction(mod, b"busy_us"))

    def chk(self, result: Any) -> Any:
        err, *rest = result if isinstance(result, tuple) else (result,)
        if int(err) != 0:
            raise RuntimeError(self.cu.cuGetErrorName(err)[1].decode())
        return rest[0] if len(rest) == 1 else rest

    def params(self, us: int) -> Any:
        return ((us,), (ctypes.c_uint64,))

    def launcher(self, kind: str, us: int, stream: Any) -> Any:
        """A function making one launch of busy_us(us) on `stream` by `kind`."""
        cu, busy = self.cu, self.busy
        if kind == "ex":
            cfg = cu.CUlaunchConfig()
            cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = SMS, 1, 1
            cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = 1, 1, 1
            cfg.hStream = stream
            return lambda: self.chk(cu.cuLaunchKernelEx(cfg, busy, self.params(us), 0))
        if kind == "graph":
            self.chk(
                cu.cuStreamBeginCapture(stream, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            )
            self.chk(cu.cuLaunchKernel(busy, SMS, 1, 1, 1, 1, 1, 0, stream, self.params(us), 0))
            graph = self.chk(cu.cuStreamEndCapture(stream))
            exe = self.chk(cu.cuGraphInstantiate(graph, 0))
            return lambda: self.chk(cu.cuGraphLaunch(exe, stream))
        return lambda: self.chk(cu.cuLaunchKernel(busy, SMS, 1, 1, 1, 1, 1, 0, stream, self.params(us), 0))


class _Spin:
    """Threads launching until stopped; each keeps at most `depth` launches unfinished."""

    def __init__(self, gpu: _Gpu, us: int, depth: int, threads: int, kind: str) -> None:
        self.gpu = gpu
        self.stopping = threading.Event()
        self.launches = 0
        self._lock = threading.Lock()
        kinds = kind.split(",")
        self.threads = [
            threading.Thread(target=self._run, args=(us, max(1, depth), kinds[i % len(kinds)]), daemon=True)
            for i in range(threads)
        ]
        for t in self.threads:
            t.start()

    def _run(self, us: int, depth: int, kind: str) -> None:
        gpu = self.gpu
        cu = gpu.cu
        gpu.chk(cu.cuCtxSetCurrent(gpu.ctx))
        stream = gpu.chk(cu.cuStreamCreate(1))  # non-blocking: no order with the null stream
        launch = gpu.launcher(kind, us, stream)
        events = [gpu.chk(cu.cuEventCreate(2)) for _ in range(depth)]  # CU_EVENT_DISABLE_TIMING
        n = 0
        while not self.stopping.is_set():
            ev = events[n % depth]
            if n >= depth:
                gpu.chk(cu.cuEventSynchronize(ev))  # the launch `depth` ago is done
            launch()
            gpu.chk(cu.cuEventRecord(ev, stream))
            n += 1
            with self._lock:
                self.launches += 1
        gpu.chk(cu.cuStreamSynchronize(stream))

    def stop(self) -> int:
        self.stopping.set()
        for t in self.threads:
            t.join()
        return self.launches


def _latency(gpu: _Gpu, us: int, n: int, gap_ms: float) -> str:
    cu = gpu.cu
    stream = gpu.chk(cu.cuStreamCreate(1))
    e0, e1 = gpu.chk(cu.cuEventCreate(0)), gpu.chk(cu.cuEventCreate(0))
    took = []
    for _ in range(n):
        gpu.chk(cu.cuEventRecord(e0, stream))
        gpu.chk(cu.cuLaunchKernel(gpu.busy, SMS, 1, 1, 1, 1, 1, 0, stream, gpu.params(us), 0))
        gpu.chk(cu.cuEventRecord(e1, stream))
        gpu.chk(cu.cuEventSynchronize(e1))
        took.append(float(gpu.chk(cu.cuEventElapsedTime(e0, e1))))
        time.sleep(gap_ms / 1000)
    took.sort()

    def pct(p: float) -> float:
        return took[min(len(took) - 1, round(p / 100 * (len(took) - 1)))]

    return f"lat p50={pct(50):.3f} p99={pct(99):.3f} max={took[-1]:.3f}"


def _serve() -> int:
    gpu = _Gpu()
    if sys.argv[1:2] == ["--spin"]:
        alone = _Spin(gpu, int(sys.argv[2]), int(sys.argv[3]), 1, "launch")
        print("ready", flush=True)
        sys.stdin.read()  # until the parent closes it
        alone.stop()
        return 0
    print("ready", flush=True)
    spin: _Spin | None = None
    children: list[subprocess.Popen[bytes]] = []
    for line in sys.stdin:
        cmd, *a = line.split() or [""]
        try:
            if cmd == "spin":
                if spin is None:
                    spin = _Spin(gpu, int(a[0]), int(a[1]), int(a[2]), a[3])
                print("ok", flush=True)
            elif cmd == "procs":
                argv = [sys.executable, "-m", "gpufrac.simgpu.computeload", "--spin", a[1], a[2]]
                for _ in range(int(a[0])):
                    p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
                    assert p.stdout is not None
                    if p.stdout.readline().strip() != b"ready":
                        raise RuntimeError("a spinning process did not start")
                    children.append(p)
                print("ok", flush=True)
            elif cmd == "stop":
                launches = spin.stop() if spin is not None else 0
                spin = None
                for p in children:
                    assert p.stdin is not None
                    p.stdin.close()
                for p in children:
                    p.wait(60)
                children.clear()
                print(f"ok launches={launches}", flush=True)
            elif cmd == "lat":
                print(_latency(gpu, int(a[0]), int(a[1]), float(a[2])), flush=True)
            elif cmd == "exit":
                for p in children:
                    p.kill()
                print("bye", flush=True)
                return 0
            else:
                print(f"error unknown command {cmd!r}", flush=True)
        except (RuntimeError, IndexError, ValueError) as e:
            print(f"error {e}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(_serve())
