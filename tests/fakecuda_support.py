"""Real workloads on simgpu's fake libcuda.so.1, for the tests of the fake driver itself
(test_fake_cuda*.py): cuda-python snippets in subprocesses with thin helpers over
cuda.bindings.driver (PRELUDE), run once (run_py + ok) or driven line by line (Workload),
and the node-state file read back (gpu_fields, slot_fields).

Scenario tests that need a GPU program rather than driver calls use gpufrac.simgpu.workload.
"""

from __future__ import annotations

import ctypes
import json
import queue
import subprocess
import sys
import textwrap
import threading

from simnode_fixtures import SimNode

from gpufrac.core import native
from gpufrac.simgpu.nodestate import NodeState

GIB = 1 << 30
MIB = 1 << 20

# Shared by every workload: thin helpers over cuda.bindings.driver.
PRELUDE = textwrap.dedent(
    """
    import ctypes, json, sys
    from cuda.bindings import driver as d

    def ck(r):
        err = r[0] if isinstance(r, tuple) else r
        if err != d.CUresult.CUDA_SUCCESS:
            raise SystemExit(f"CUDA call failed: {r!r}")
        rest = r[1:] if isinstance(r, tuple) else ()
        return rest[0] if len(rest) == 1 else (rest or None)

    def err(r):
        return int((r[0] if isinstance(r, tuple) else r).value)

    def setup(ordinal=0):
        ck(d.cuInit(0))
        dev = ck(d.cuDeviceGet(ordinal))
        ctx = ck(d.cuDevicePrimaryCtxRetain(dev))
        ck(d.cuCtxSetCurrent(ctx))
        return dev, ctx

    def kernels():
        mod = ck(d.cuModuleLoadData(b"SIMGPU-MODULE\\0"))
        return {n: ck(d.cuModuleGetFunction(mod, n.encode())) for n in ("fill_u32", "check_u32", "busy_us")}

    U64, U32 = ctypes.c_uint64, ctypes.c_uint32

    def fill(k, buf, n, value, stream=0):
        ck(d.cuLaunchKernel(k["fill_u32"], 1, 1, 1, 128, 1, 1, 0, stream,
                            ((int(buf), n, value), (U64, U64, U32)), 0))

    def mismatches(k, buf, n, value, stream=0):
        res = ck(d.cuMemAlloc(8))
        ck(d.cuLaunchKernel(k["check_u32"], 1, 1, 1, 128, 1, 1, 0, stream,
                            ((int(buf), n, value, int(res)), (U64, U64, U32, U64)), 0))
        ck(d.cuStreamSynchronize(stream))
        out = U64()
        ck(d.cuMemcpyDtoH(ctypes.addressof(out), res, 8))
        ck(d.cuMemFree(res))
        return out.value

    def say(**kw):
        print(json.dumps(kw), flush=True)

    def wait_for(word):
        line = sys.stdin.readline().strip()
        if line != word:
            raise SystemExit(f"expected {word!r} on stdin, got {line!r}")
    """
)


def proc_env(node: SimNode, **extra: str) -> dict[str, str]:
    """Environment of a simulated process; an ASan build needs its runtime preloaded."""
    env = node.process_env(**extra)
    if node.flavour == "asan":
        env["LD_PRELOAD"] = ":".join(native.asan_runtime())
        env["ASAN_OPTIONS"] = "detect_leaks=0"
    return env


def run_py(node: SimNode, code: str, timeout: float = 120, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(code)],
        env=proc_env(node, **extra),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def ok(r: subprocess.CompletedProcess[str]) -> list[dict]:
    assert r.returncode == 0, f"workload failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
    return [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]


class Workload:
    """A long-running workload we talk to over stdin/stdout, line by line."""

    def __init__(self, node: SimNode, code: str, **extra: str) -> None:
        self.p = subprocess.Popen(
            [sys.executable, "-c", PRELUDE + textwrap.dedent(code)],
            env=proc_env(node, **extra),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def read(self, timeout: float = 60) -> dict:
        """The workload's next JSON line (a reader thread feeds a queue, so nothing
        buffered is missed)."""
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            line = None
        if line is None:
            self.p.kill()
            raise AssertionError(f"workload said nothing more; stderr:\n{self.p.stderr.read()}")
        return json.loads(line)

    def _pump(self) -> None:
        for line in self.p.stdout:
            if line.startswith("{"):
                self._lines.put(line)
        self._lines.put(None)

    def send(self, word: str) -> None:
        self.p.stdin.write(word + "\n")
        self.p.stdin.flush()

    def finish(self, timeout: float = 60) -> None:
        self.p.stdin.close()
        rc = self.p.wait(timeout=timeout)
        assert rc == 0, f"workload failed ({rc}):\n{self.p.stderr.read()}"

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait(timeout=30)


def _plain(rec: ctypes.Structure) -> dict:
    """Scalar fields of a node-state record, copied (arrays would keep the mapping open)."""
    out = {}
    for name, _ in rec._fields_:
        value = getattr(rec, name)
        if not isinstance(value, ctypes.Array):
            out[name] = value
    return out


def gpu_fields(node: SimNode, gpu: int) -> dict:
    """Plain values of a GPU's node-state record (no reference into the mapping survives)."""
    with NodeState(node.path) as st:
        out = _plain(st.node.gpus[gpu])
        out["driver"] = st.node.cuda_driver_version
        out["gpu_count"] = st.node.gpu_count
    return out


def slot_fields(node: SimNode, pid: int) -> list[dict]:
    with NodeState(node.path) as st:
        return [_plain(p) for p in st.live_procs() if p.pid == pid]


def slot_used(node: SimNode, pid: int) -> int:
    return sum(p["used_bytes"] for p in slot_fields(node, pid))


def gpu_used(node: SimNode, gpu: int = 0) -> int:
    return gpu_fields(node, gpu)["used_bytes"]


def ctx_bytes(node: SimNode, gpu: int = 0) -> int:
    """Device memory each CUDA context takes on the GPU (the node spec's context_memory)."""
    return int(gpu_fields(node, gpu)["ctx_mib"]) << 20
