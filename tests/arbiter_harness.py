"""A node for arbiter tests: the real ledger, pod identity on kmock's apiserver, the arbiter on
its own event loop, and "containers" that are real processes in real cgroups
(gpufrac.simgpu.runtime) speaking the shim's protocol on the real socket.

Allocation goes as on a node: the ledger books slices, the device plugin's
ContainerAllocateResponse gives the container its envs and mounts, the pod (with
its annotations and priority) lives in the apiserver and its
status.containerStatuses names the container ID the runtime chose, and
PodIdentity applies the pod's policy to the config file.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
from agentsim_fixtures import short_tmpdir
from kube_fixtures import KubeServer, pod_manifest
from polling import until_async
from simnode_fixtures import nvml_node

from gpufrac.agent.arbiter import Arbiter
from gpufrac.agent.callers import PeerLookup, namer_from_pods
from gpufrac.agent.inventory import read_inventory
from gpufrac.agent.kube import EventRecorder, PodCache, make_api_client
from gpufrac.agent.ledger import ContainerAlloc, Ledger
from gpufrac.agent.metrics import Metrics
from gpufrac.agent.pods import PodIdentity
from gpufrac.core import native
from gpufrac.core.config import Config, arbiter_socket, load
from gpufrac.core.eventloop import new_loop
from gpufrac.core.slices import MEMORY, ContainerDevices, device_id
from gpufrac.deviceplugin.server import container_response
from gpufrac.memguard import abi
from gpufrac.simgpu.runtime import Container, ContainerRuntime, WorkloadDriver, mounts_of
from gpufrac.simgpu.workload import WorkloadProcess

T = TypeVar("T")
NODE = "node-a"
GiB = 1 << 30
MiB = 1 << 20


class LoopThread:
    """An event loop in a background thread: the agent's loop for these tests."""

    def __init__(self) -> None:
        self.loop = new_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="arbiter-loop", daemon=True)
        self._thread.start()

    def call(self, fn: Callable[[], Coroutine[Any, Any, T]] | Callable[[], T], timeout: float = 60.0) -> T:
        async def run() -> T:
            r = fn()
            return await r if asyncio.iscoroutine(r) else r  # type: ignore[return-value]

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(30)
        self.loop.close()


class CudaApp(WorkloadProcess):
    """The real GPU workload (gpufrac.simgpu.workload) in a box's container: cuda-python over
    the fake libcuda under the memguard shim, in the container's cgroup."""

    def __init__(self, box: Box, container: Container, timeout: float) -> None:
        self.box, self.c, self.pid = box, container, container.proc.pid
        super().__init__(container.proc, box.pod, timeout)


class Workload(WorkloadDriver):
    """A container process running the stand-in workload; `do` sends one command."""

    def __init__(self, box: Any, container: Container) -> None:
        super().__init__(container, box.pod)
        self.box = box


@dataclass
class Box:
    """One pod with one GPU container on the node."""

    pod: str
    uid: str
    alloc: ContainerAlloc
    container: Container | None = None
    workload: Workload | None = None

    def config(self) -> abi.ContainerConfig:
        return abi.read_config(self.alloc.directory)

    def used(self) -> int:
        return int(abi.read_usage(self.alloc.directory).total_used)


class ArbiterNode:
    def __init__(self, kube: KubeServer, overrides: dict[str, Any] | None = None) -> None:
        self.kube = kube
        self.v1 = kube.core_v1()
        self.root = short_tmpdir("gfa")
        base: dict[str, Any] = {"nodeName": NODE, "resolvers": ["wait"], **(overrides or {})}
        base["paths"] = {"stateDir": str(self.root / "state"), **base.get("paths", {})}
        self.cfg: Config = load(overrides=base)
        try:
            self.runtime = ContainerRuntime(view_root=self.root / "v")  # needs cgroups: fails clearly
        except BaseException:
            shutil.rmtree(self.root, ignore_errors=True)
            raise
        self.lt = LoopThread()
        self.ledger = Ledger(self.cfg, read_inventory())
        self.gpu = self.ledger.inventory.gpus[0].uuid
        self.listing: dict[str, ContainerDevices] = {}
        self.boxes: list[Box] = []
        self.state_path: Path | None = None  # the sim node-state file (make_node sets it)
        self._next_slice = 0
        self.metrics = Metrics()  # what the node's parts count, as the agent's Metrics

        async def setup() -> tuple[PodIdentity, Arbiter]:
            api = make_api_client(host=kube.url)
            pods = PodCache(api, NODE)
            pods.start()
            assert await pods.wait_synced(30)
            ident = PodIdentity(self.cfg, self.ledger, pods, EventRecorder(api, NODE), metrics=self.metrics)
            arb = Arbiter(
                self.cfg,
                self.ledger,
                PeerLookup(self.ledger, namer_from_pods(pods)),
                arbiter_socket(self.cfg),
                events=ident.events,
                metrics=self.metrics,
            )
            await arb.start()
            return ident, arb

        try:
            self.identity, self.arbiter = self.lt.call(setup)
        except BaseException:
            self.lt.close()
            self.runtime.close()
            shutil.rmtree(self.root, ignore_errors=True)
            raise

    @property
    def socket(self) -> str:
        return arbiter_socket(self.cfg)

    def add(
        self,
        pod: str,
        request_gib: int,
        limit: str | None = None,
        *,
        priority: int = 0,
        preemptible: bool = True,
        wait_timeout: str | None = None,
        start: bool = True,
    ) -> Box:
        """Book `request_gib` GiB for pod/main, create the pod, start its container."""
        ids = [device_id(self.gpu, MEMORY, self._next_slice + i) for i in range(request_gib)]
        self._next_slice += request_gib
        alloc = self.lt.call(lambda: self.ledger.allocate(MEMORY, ids))
        self.listing[alloc.key] = ContainerDevices("default", pod, "main", MEMORY, tuple(ids))
        ann = {"gpufrac.dev/preemptible": str(preemptible).lower()}
        if limit:
            ann["gpufrac.dev/gpu-memory-limit"] = limit
        if wait_timeout:
            ann["gpufrac.dev/wait-timeout"] = wait_timeout
        created = self.v1.create_namespaced_pod(
            "default", pod_manifest(pod, node=NODE, annotations=ann, priority=priority)
        )
        box = Box(pod, created.metadata.uid, alloc)
        self.boxes.append(box)
        self.lt.call(lambda: self.identity.resolve(self.listing))
        assert box.config().pod_uid == box.uid
        if start:
            self.start(box)
        return box

    def start(self, box: Box) -> Workload:
        resp = container_response(box.alloc, self.cfg)
        c = self.runtime.start(
            box.uid,
            "main",
            [sys.executable, "-m", "gpufrac.simgpu.runtime"],
            # The stand-in workload does the shim's part itself: no LD_PRELOAD.
            envs={k: v for k, v in resp.envs.items() if k != "LD_PRELOAD"},
            mounts=mounts_of(resp),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        box.container = c
        self.set_container_id(box.pod, box.uid, c.runtime_id)
        return self._attach(box, c)

    def start_cuda(self, box: Box, state: Path | None = None, timeout: float = 120.0) -> CudaApp:
        """Start box's container with the real GPU workload under the shim (LD_PRELOAD, as
        the Allocate response gives it) on the simulated node `state` (default: make_node's)."""
        state = state or self.state_path
        assert state is not None, "no simulated node: pass its state file"
        resp = container_response(box.alloc, self.cfg)
        env = dict(os.environ, SIMGPU_STATE=str(state), LD_LIBRARY_PATH=str(native.native_dir()))
        c = self.runtime.start(
            box.uid,
            "main",
            WorkloadProcess.argv(),
            env=env,
            envs=dict(resp.envs),
            mounts=mounts_of(resp),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        box.container = c
        self.set_container_id(box.pod, box.uid, c.runtime_id)
        return CudaApp(box, c, timeout)

    def _attach(self, box: Box, c: Container) -> Workload:
        box.workload = Workload(box, c)
        return box.workload

    def set_container_id(self, pod: str, uid: str, runtime_id: str, container: str = "main") -> None:
        """What the kubelet reports once the container runs: status.containerStatuses."""
        cs = {"name": container, "containerID": runtime_id, "image": "app", "imageID": "app", "ready": True}
        status = {"phase": "Running", "containerStatuses": [{**cs, "restartCount": 0}]}
        self.v1.patch_namespaced_pod(pod, "default", {"status": status})
        cid = runtime_id.split("://", 1)[-1]

        def seen() -> bool:
            p = self.identity.pods.by_uid(uid)  # type: ignore[union-attr]
            return p is not None and cid in p.container_ids

        self.until(seen, what=f"{pod}'s container ID in the pod cache")

    def until(self, cond: Callable[[], bool], timeout: float = 30.0, what: str = "condition") -> None:
        """Poll cond() on the agent's loop until it holds."""
        self.lt.call(lambda: until_async(cond, timeout, what, interval=0.01), timeout + 5)

    def on_loop(self, fn: Callable[[], Awaitable[T]] | Callable[[], T]) -> T:
        return self.lt.call(fn)  # type: ignore[arg-type]

    def close(self) -> None:
        self.runtime.close()

        async def down() -> None:
            await self.arbiter.stop()
            await self.identity.close()

        try:
            self.lt.call(down)
        finally:
            self.lt.close()
            for b in self.boxes:
                self.ledger.release(b.alloc.key)
            shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture
def make_node(tmp_path: Path, kube_server: KubeServer) -> Iterator[Callable[..., ArbiterNode]]:
    """make_node(resolvers=[...], **config overrides) -> an ArbiterNode on a fresh sim node."""
    made: list[ArbiterNode] = []
    with nvml_node(tmp_path) as path:

        def make(**overrides: Any) -> ArbiterNode:
            n = ArbiterNode(kube_server, overrides)
            n.state_path = path
            made.append(n)
            return n

        try:
            yield make
        finally:
            for n in made:
                n.close()
