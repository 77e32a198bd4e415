"""Running real workload processes under the memguard shim on a simulated node.

A `Container` is a per-container directory as the agent writes it (config via
abi.ConfigFile, usage via abi.create_usage). A `Shim` starts processes
on the simulated node under LD_PRELOAD of the shim (release or ASan flavour):
mg_ctest (a C program linked against libcuda: direct symbols), or Python
snippets using cuda-python (cuGetProcAddress_v2), ctypes and pynvml (dlsym).
"""

from __future__ import annotations

import ctypes
import json
import os
import queue
import socket
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest

from gpufrac.memguard import abi, build, wire
from gpufrac.simgpu.nodestate import NodeState

MiB = 1 << 20
CUDA_ERROR_OUT_OF_MEMORY = 2
TIMEOUT = 180  # generous: a loaded 2-core box, ASan builds


@dataclass
class Container:
    dir: Path
    cfg: abi.ContainerConfig
    file: abi.ConfigFile = field(repr=False)

    def set(self, **changes: Any) -> int:
        """The agent changes this container's config (in place, under the seqlock)."""
        self.cfg = replace(self.cfg, **changes)
        return self.file.write(self.cfg)

    def usage(self) -> abi.UsageStruct:
        return abi.read_usage(self.dir)

    def total(self) -> int:
        return int(self.usage().total_used)

    def live_slots(self) -> list[abi.ProcSlot]:
        return [s for s in self.usage().slots if s.pid != 0]


def grant_burst(c: Container, conn: socket.socket) -> wire.BurstRequest | None:
    """Play the agent for one connection to the arbiter socket: a BURST gets its grant
    raised in the container's config, then GRANTED with the new generation. Any other
    request (a RELEASE) is returned unanswered; a short read (EOF) gives None."""
    data = conn.recv(64)
    if len(data) != ctypes.sizeof(wire.BurstRequest):
        return None
    req = wire.BurstRequest.from_buffer_copy(data)
    if req.op == wire.BURST_OP_BURST:
        gen = c.set(grant_bytes=req.total_after - c.cfg.request_bytes)
        reply = wire.BurstReply(
            magic=wire.BURST_MAGIC,
            version=abi.ABI_VERSION,
            status=wire.BURST_GRANTED,
            generation=gen,
        )
        conn.sendall(bytes(reply))
    return req


def answer_bursts(
    server: socket.socket, c: Container, served: list[wire.BurstRequest], until: Callable[[], bool]
) -> None:
    """Play the agent on `server` (a listening socket with a short timeout) until `until()`:
    each connection goes through grant_burst, and each request read is added to `served`."""
    while not until():
        try:
            conn, _ = server.accept()
        except TimeoutError:
            continue
        conn.settimeout(30)
        with conn:
            req = grant_burst(c, conn)
            if req is not None:  # None: a connection that sent nothing (EOF)
                served.append(req)


def make_container(directory: Path, request: int, limit: int, **kw: Any) -> Container:
    directory.mkdir(parents=True, exist_ok=True)
    cfg = abi.ContainerConfig(gpu_uuid="", request_bytes=request, limit_bytes=limit, **kw)
    f = abi.ConfigFile(directory)
    f.write(cfg)
    abi.create_usage(directory)
    return Container(directory, cfg, f)


@dataclass
class Line:
    cmd: str
    rc: int
    kv: dict[str, str]

    def int(self, key: str) -> int:
        return int(self.kv[key], 0)


def parse_ctest(stdout: str) -> list[Line]:
    out = []
    for raw in stdout.splitlines():
        parts = raw.split()
        if len(parts) < 2 or not parts[1].lstrip("-").isdigit():
            continue
        kv = dict(p.split("=", 1) for p in parts[2:] if "=" in p)
        out.append(Line(parts[0], int(parts[1]), kv))
    return out


# Prelude of every Python workload: a context through cuda-python, the usage
# file at hand, and `out` printed as JSON at the end.
PY_PRELUDE = """
import ctypes, json, os, sys
from cuda.bindings import driver as cu
from gpufrac.memguard import abi, wire
DIR = os.environ["GPUFRAC_CONTAINER_DIR"]
def rc(r):
    return int(r[0] if isinstance(r, tuple) else r)
def chk(r):
    if rc(r) != 0:
        raise SystemExit(f"CUDA error {r!r}")
    return r[1] if len(r) == 2 else r[1:]
def used():
    return int(abi.read_usage(DIR).total_used)
chk(cu.cuInit(0))
dev = chk(cu.cuDeviceGet(0))
ctx = chk(cu.cuDevicePrimaryCtxRetain(dev))
chk(cu.cuCtxSetCurrent(ctx))
out = {}
"""

# For workloads that set their count beside the driver's: nvml() is the GPU memory
# the fake driver holds for this process (NVML's per-process figure).
NVML = """
from gpufrac.simgpu.nodestate import NodeState
pid = os.getpid()
def nvml():
    with NodeState(os.environ["SIMGPU_STATE"]) as n:
        return sum(p.used_bytes for p in n.live_procs() if p.pid == pid)
"""


class Shim:
    def __init__(self, sim_env: dict[str, str], flavour: str) -> None:
        self.sim_env = sim_env
        self.flavour = flavour

    def env(self, c: Container | Path | str, **extra: str) -> dict[str, str]:
        base = dict(os.environ)
        base.update(self.sim_env)
        env = build.shim_env(c.dir if isinstance(c, Container) else c, self.flavour, base)
        env.update(extra)
        return env

    def ctest_cmd(self, *cmds: object) -> list[str]:
        return [str(build.ctest_path(self.flavour)), *map(str, cmds)]

    def ctest(
        self, c: Container | Path | str, *cmds: object, env: dict[str, str] | None = None
    ) -> list[Line]:
        p = subprocess.run(
            self.ctest_cmd(*cmds), env=env or self.env(c), capture_output=True, text=True, timeout=TIMEOUT
        )
        assert p.returncode == 0, f"mg_ctest {cmds} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}"
        return parse_ctest(p.stdout)

    def ctest_popen(self, c: Container, *cmds: object) -> subprocess.Popen[str]:
        return subprocess.Popen(
            self.ctest_cmd(*cmds),
            env=self.env(c),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def python(self, c: Container | Path | str, body: str, **extra: str) -> dict[str, Any]:
        """Run a cuda-python workload under the shim; returns its `out` dict."""
        code = PY_PRELUDE + textwrap.dedent(body) + "\nprint(json.dumps(out))\n"
        p = subprocess.run(
            [sys.executable, "-c", code],
            env=self.env(c, **extra),
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
        assert p.returncode == 0, f"workload failed ({p.returncode}):\n{p.stdout}\n{p.stderr}"
        return json.loads(p.stdout.strip().splitlines()[-1])

    def python_popen(self, c: Container, body: str) -> subprocess.Popen[str]:
        code = PY_PRELUDE + textwrap.dedent(body)
        return subprocess.Popen(
            [sys.executable, "-c", code],
            env=self.env(c),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )


def read_line(p: subprocess.Popen[str], timeout: float = TIMEOUT) -> str:
    """The next stdout line of a workload ("" at EOF). A reader thread owns the
    pipe, so lines that arrive together are not lost in a buffer."""
    q: queue.Queue[str] | None = getattr(p, "_mg_lines", None)
    if q is None:
        q = queue.Queue()
        p._mg_lines = q  # type: ignore[attr-defined]
        lines = q

        def pump() -> None:
            assert p.stdout is not None
            for line in p.stdout:
                lines.put(line)
            lines.put("")

        threading.Thread(target=pump, daemon=True).start()
    try:
        return q.get(timeout=timeout)
    except queue.Empty:
        raise AssertionError("workload printed nothing in time") from None


def held(
    shim: Shim, c: Container, *script: object, then: tuple[object, ...] = ()
) -> tuple[list[str], int, int, list[str]]:
    """Run mg_ctest's `script`, then "hold", then `then`: the lines it printed up to
    the hold, what the fake driver held for the process then (NVML's per-process
    figure), the container's count then, and the lines it printed once let go (it
    exits 0)."""
    node = NodeState(shim.sim_env["SIMGPU_STATE"])
    p = shim.ctest_popen(c, *script, "hold", *then)
    try:
        out: list[str] = []
        while not out or not out[-1].startswith("hold"):
            line = read_line(p)
            assert line, f"mg_ctest ended early: {out}"
            out.append(line)
        physical = sum(pr.used_bytes for pr in node.live_procs() if pr.pid == p.pid)
        counted = c.total()
        assert p.stdin is not None
        p.stdin.write("\n")
        p.stdin.close()
        rest = list(iter(lambda: read_line(p), ""))
        assert p.wait(timeout=120) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        node.close()
    return out, physical, counted, rest


# ---------------------------------------------------------------- fixtures
# Imported by the test_memguard*.py modules.

REQUEST = 64 * MiB
LIMIT = 96 * MiB


@pytest.fixture(params=["release", "asan"])
def flavour(request: pytest.FixtureRequest) -> str:
    """Release builds, and ASan+UBSan builds of both the shim and the fake driver."""
    return str(request.param)


@pytest.fixture
def shim(make_sim_node: Callable[..., Any], flavour: str) -> Shim:
    # Contexts cost nothing on this node: these tests check the shim's allocation accounting
    # to the byte with containers of tens of MiB, which a real context (512 MiB on the H100
    # preset) would not fit in. The context's own charge is tested on a node that has one
    # (test_memguard_context.py, and end to end on the presets).
    node = make_sim_node("dgx-h100", flavour=flavour, context_memory=0)
    return Shim(node.env, flavour)


@pytest.fixture
def container(tmp_path: Path) -> Callable[..., Container]:
    """Factory: a container directory as the agent writes it (default request 64 MiB, limit 96 MiB)."""
    n = iter(range(1000))

    def make(request: int = REQUEST, limit: int = LIMIT, **kw: Any) -> Container:
        return make_container(tmp_path / f"ctr-{next(n)}", request, limit, **kw)

    return make
