"""One simulated GPU shared by containers under compute shares: bench/compute.py and the tests
of compute shares (tests/agent/compute/test_compute_shares.py) run their scenarios on it.

Every part that decides is the agent's own, in this process: the ledger, the compute loop
(gpufrac.agent.compute) on an event loop of its own thread, NVML's per-process utilisation from
the fake driver through the feed, callers told apart by their real cgroups (PeerLookup; the pod
status the apiserver would give is the `names` table here). The containers are real processes
in real cgroups (gpufrac.simgpu.runtime), started from the device plugin's own Allocate answer
(the shim preloaded, its config, usage and compute files mounted), running
gpufrac.simgpu.computeload: cuda-python over the fake libcuda, whose compute model
(docs/simgpu.md) time-slices the GPU between them. What a container really got is read from that
model (each process's busy time in the node-state file), not from what the controller measured.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Coroutine, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass
class Member:
    """A container on the shared GPU."""

    name: str
    key: str
    container: Any  # gpufrac.simgpu.runtime.Container
    app: Any  # gpufrac.simgpu.workload.WorkloadProcess driving computeload

    def do(self, cmd: str, timeout: float = 120.0) -> str:
        out = str(self.app.do(cmd, timeout))
        if not (out.startswith("ok") or out.startswith("lat")):
            raise RuntimeError(f"{self.name}: {cmd!r} answered {out!r}")
        return out


class _Policies:
    """Compute shares given to containers directly (the annotations' path is tested on its own)."""

    def __init__(self) -> None:
        self.shares: dict[str, float] = {}

    def policy(self, key: str) -> Any:
        from gpufrac.core.annotations import ContainerPolicy

        share = self.shares.get(key)
        return None if share is None else ContainerPolicy(0, 0, None, compute_share=share)


class ComputeNode:
    """A GPU (GPU 0 of the dgx-h100 preset, contexts free) and its containers. `mode`: the
    node's compute mode (fair, strict); `control`: run the compute loop at all (off: plain time
    slicing, what the GPU does alone)."""

    def __init__(
        self,
        mode: str = "fair",
        interval: float = 0.1,
        control: bool = True,
        *,
        real_gpu: bool = False,
        argv: list[str] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        """`real_gpu`: on this node's real GPU 0 instead (tests/gpu): the real NVML in this
        process, `argv` the containers' program (it speaks computeload's lines), `env` the base
        environment of their processes (the real driver's)."""
        import pynvml

        from gpufrac.agent.booking.ledger import Ledger
        from gpufrac.agent.compute.loop import ComputeLoop
        from gpufrac.agent.gpu.inventory import read_inventory
        from gpufrac.agent.gpu.utilisation import UtilisationFeed
        from gpufrac.agent.processes.callers import PeerLookup
        from gpufrac.core import native
        from gpufrac.core.config import load
        from gpufrac.core.eventloop import new_loop
        from gpufrac.simgpu.runtime import ContainerRuntime
        from gpufrac.simgpu.spec import create_node, spec_from_dict

        self.root = Path(tempfile.mkdtemp(prefix="gfc", dir="/tmp"))
        self.state = self.root / "node.state"
        self.real_gpu = real_gpu
        self._argv = argv or [sys.executable, "-m", "gpufrac.simgpu.computeload"]
        if not real_gpu:
            create_node(
                spec_from_dict({"preset": "dgx-h100", "gpu_defaults": {"context_memory": 0}}), self.state
            )
            ctypes.CDLL(str(native.library(native.FAKE_NVML)), mode=ctypes.RTLD_GLOBAL)
            native.library(native.FAKE_CUDA)
            os.environ["SIMGPU_STATE"] = str(self.state)
            os.environ.pop("NVIDIA_VISIBLE_DEVICES", None)
        pynvml.nvmlInit()
        self._pynvml = pynvml
        self.cfg = load(
            overrides={
                "nodeName": "bench",
                "paths": {
                    "stateDir": str(self.root / "state"),
                    "shimHostPath": str(native.library(native.SHIM)),
                },
                "compute": {"mode": mode, "interval": f"{interval}s"},
            }
        )
        self.ledger = Ledger(self.cfg, read_inventory())
        self.gpu = self.ledger.inventory.gpus[0].uuid
        self.names: dict[tuple[str, str], str] = {}
        self.policies = _Policies()
        self.loop = new_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.feed = UtilisationFeed.open()
        peers = PeerLookup(self.ledger, lambda uid, cid: self.names.get((uid, cid)))
        self.compute = ComputeLoop(self.cfg, self.ledger, self.policies, peers, self.feed)
        self._task: Any = None
        if control:
            self._task = self.run(self._start())
        self.runtime = ContainerRuntime(view_root=self.root / "v")
        self.members: list[Member] = []
        self._slices = 0
        self._env = (
            dict(env or os.environ)
            if real_gpu
            else {**os.environ, "SIMGPU_STATE": str(self.state), "LD_LIBRARY_PATH": str(native.native_dir())}
        )
        self._handle = pynvml.nvmlDeviceGetHandleByIndex(0)

    async def _start(self) -> Any:
        from gpufrac.agent.compute import leftover

        await leftover.Leftovers(self.ledger).undo()  # what a starting agent does first (gpufrac.agent.main)
        return asyncio.get_running_loop().create_task(self.compute.run())

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(120)

    def add(self, name: str, percent: int, share: float | None = None, shim: bool = True) -> Member:
        """A container of `percent` gpu-fraction slices (its memory share, and its compute share
        unless `share` says otherwise), running computeload under the shim (or not: `shim`)."""
        from gpufrac.core.slices import FRACTION, device_id
        from gpufrac.deviceplugin.server import container_response
        from gpufrac.simgpu.runtime import mounts_of
        from gpufrac.simgpu.workload import WorkloadProcess

        ids = [device_id(self.gpu, FRACTION, self._slices + i) for i in range(percent)]
        self._slices += percent
        uid = f"{len(self.members) + 1:08x}-0000-4000-8000-000000000000"

        async def book() -> Any:
            a = self.ledger.allocate(FRACTION, ids)
            self.ledger.bind(a.key, "bench", name, "main", uid)
            return a

        alloc = self.run(book())
        if share is not None:
            self.policies.shares[alloc.key] = share
        resp = container_response(alloc, self.cfg)
        envs = dict(resp.envs)
        if not shim:
            envs.pop("LD_PRELOAD", None)
        c = self.runtime.start(
            uid,
            "main",
            self._argv,
            env=self._env,
            envs=envs,
            mounts=mounts_of(resp),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        self.runtime.wait_entered(c)
        self.names[(uid, c.container_id)] = "main"
        m = Member(name, alloc.key, c, WorkloadProcess(c.proc, name, 120.0))
        self.members.append(m)
        return m

    # -- what the GPU gave each container (the compute model's own figures) ---------------------

    def busy(self, members: Iterable[Member] | None = None) -> dict[str, int]:
        """Each container's GPU time so far (ns), its processes' busy clocks in the node state."""
        from gpufrac.simgpu.nodestate import NodeState

        if self.real_gpu:
            raise RuntimeError("a real GPU keeps no busy clocks: measure the containers' own throughput")
        self._pynvml.nvmlDeviceGetUtilizationRates(self._handle)  # plays the schedule up to now
        members = list(self.members if members is None else members)
        with NodeState(self.state) as st:
            by_pid = {p.pid: int(p.busy_ns_total) for p in st.live_procs() if p.gpu == 0}
        return {m.name: sum(by_pid.get(pid, 0) for pid in m.container.pids()) for m in members}

    def shares(self, seconds: float, members: Iterable[Member] | None = None) -> dict[str, float]:
        """Each container's share of the GPU's time over the next `seconds`."""
        members = list(self.members if members is None else members)
        b0, t0 = self.busy(members), time.monotonic()
        time.sleep(seconds)
        b1, t1 = self.busy(members), time.monotonic()
        return {m.name: (b1[m.name] - b0[m.name]) / ((t1 - t0) * 1e9) for m in members}

    def figures(self, m: Member) -> Any:
        async def get() -> Any:
            return self.compute.figures(m.key)

        return self.run(get())

    def start_control(self) -> None:
        """Start the compute loop (as a restarted agent does), if it is not running."""
        if self._task is None:
            self._task = self.run(self._start())

    def stop_control(self) -> None:
        """Stop the compute loop as the agent does: paces lifted, stopped processes continued."""
        task, self._task = self._task, None
        if task is None:
            return

        async def stop() -> None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await self.compute.close()

        self.run(stop())

    def close(self) -> None:
        self.stop_control()
        for m in self.members:
            m.app.close(timeout=5)
        self.runtime.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(30)
        self.feed.close()
        self._pynvml.nvmlShutdown()
        shutil.rmtree(self.root, ignore_errors=True)
