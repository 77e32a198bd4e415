"""Idle reaping end to end on the agent's parts, with short configured durations.

Real parts throughout: workloads are mg_ctest processes under the memguard shim on
the simulated GPU (their launches reach the usage file through the shim's hooks),
the activity tracker reads those usage files and NVML (the fake libnvidia-ml) in
this process, the ledger writes real container directories, and pod identity,
Events and evictions go through the real kubernetes client to kmock's apiserver
emulator.

kmock (0.8) does not serve the Eviction subresource (a POST to
/api/v1/namespaces/<ns>/pods/<name>/eviction answers 404 "Endpoint Not Found").
`EvictionApi` configures the emulator, through kmock's own reaction API, to answer
as the apiserver does: with a PodDisruptionBudget that allows no disruption, 429
TooManyRequests with the DisruptionBudget cause; otherwise 201 Success and the pod
deleted (a DELETED watch event); 409 when the uid precondition names another pod.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import kmock
import pytest

from gpufrac.agent.booking.ledger import ContainerAlloc, Ledger
from gpufrac.agent.booking.pods import PodIdentity
from gpufrac.agent.gpu.activity import ActivityTracker, NvmlUtilisation
from gpufrac.agent.gpu.inventory import read_inventory
from gpufrac.agent.idle.reaper import IdleReaper
from gpufrac.agent.kube.client import make_api_client
from gpufrac.agent.kube.evict import PodEvictor
from gpufrac.agent.kube.podcache import PodCache
from gpufrac.agent.kube.recorder import EventRecorder
from gpufrac.agent.metrics.registry import Metrics
from gpufrac.core import annotations
from gpufrac.core.config import Config, load
from gpufrac.core.slices import MEMORY, ContainerDevices, device_id
from gpufrac.memguard import abi
from gpufrac.simgpu.kubelet import Container as KContainer
from gpufrac.simgpu.kubelet import Pod as KPod
from gpufrac.simgpu.runtime import Container, ContainerRuntime, RuntimeUnavailable
from gpufrac.simgpu.spec import load_preset
from tests.fixtures.agentsim import Sim
from tests.fixtures.kube import PODS, KubeServer, pod_manifest, request_order
from tests.fixtures.memguard import Shim, read_line
from tests.fixtures.polling import until_async

NODE = "node-a"
MiB = 1 << 20
# What a workload's container holds: its 64 MiB and its process's CUDA context (the node is the
# dgx-h100 preset, whose contexts take the H100 estimate).
HELD = 64 * MiB + load_preset("dgx-h100").gpus[0].context_memory
DEADLINE = 90.0  # generous: a loaded 2-core box
INTERACTIVE = {annotations.WORKLOAD_CLASS: "interactive"}


# -- the apiserver's Eviction subresource ----------------------------------------------------------


class EvictionApi:
    """policy/v1 Eviction on kmock's emulator, with PodDisruptionBudget refusals."""

    def __init__(self, kube: KubeServer) -> None:
        self.kube = kube
        self.blocked: set[str] = set()  # pods whose disruption budget allows no eviction now
        self.attempts: dict[str, int] = {}
        self.evicted_at: dict[str, float] = {}  # wall-clock time the apiserver evicted each pod

        async def install(emu: Any) -> None:
            emu[kmock.method.POST, kmock.subresource("eviction")] << self._evict

        kube.call(install)

    async def _evict(self, request: kmock.Request) -> kmock.Response:
        emu = self.kube.emulator
        ns, name = request.namespace, request.name
        self.attempts[name] = self.attempts.get(name, 0) + 1
        if name in self.blocked:
            return _status(
                429,
                "TooManyRequests",
                "Cannot evict pod as it would violate the pod's disruption budget.",
                causes=[
                    {
                        "reason": "DisruptionBudget",
                        "message": f"The disruption budget {name}-pdb needs 1 healthy pods and has 1 now",
                    }
                ],
            )
        async with emu._lock:
            try:
                obj = emu.objects[PODS, ns, name]  # kmock's ObjectsArray has no .get()
            except KeyError:
                obj = None
            if obj is None or obj.deleted:
                return _status(404, "NotFound", f'pods "{name}" not found')
            want = ((request.data or {}).get("deleteOptions") or {}).get("preconditions", {}).get("uid")
            if want and want != obj.raw["metadata"].get("uid"):
                return _status(409, "Conflict", f"Precondition failed: UID in precondition: {want}")
            emu.resource_version += 1
            raw = dict(obj.raw)
            obj.delete()
            await emu._buses[PODS].put({"type": "DELETED", "object": raw})
            self.evicted_at[name] = time.time()
        return kmock.Response(
            status=201, payload={"kind": "Status", "apiVersion": "v1", "status": "Success", "code": 201}
        )


def _status(
    code: int, reason: str, message: str, causes: list[dict[str, str]] | None = None
) -> kmock.Response:
    body: dict[str, Any] = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }
    if causes:
        body["details"] = {"causes": causes}
    return kmock.Response(status=code, payload=body)


# -- workloads -------------------------------------------------------------------------------------


class Workload:
    """mg_ctest under the shim in a container directory: allocates, optionally launches a
    kernel, then launches one more each time it is told to; otherwise only holds memory."""

    def __init__(
        self, shim: Shim, directory: str, *, launch_first: bool = True, launches: int = 2000
    ) -> None:
        cmds = ["alloc", str(64 * MiB)] + (["launch"] if launch_first else []) + ["hold", "launch"] * launches
        self.started = time.time()  # before the process exists: its slot is stamped later
        self.p = subprocess.Popen(
            shim.ctest_cmd(*cmds),
            env=shim.env(Path(directory)),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self._lock = threading.Lock()
        self._until("hold")

    def _until(self, cmd: str) -> None:
        while True:
            line = read_line(self.p, DEADLINE)
            if not line:
                raise AssertionError(f"workload exited ({self.p.poll()}): {self.p.stderr.read()}")  # type: ignore[union-attr]
            word, _, rc = line.partition(" ")
            assert rc.split()[0] == "0", f"workload command failed: {line!r}"
            if word == cmd:
                return

    def launch(self) -> None:
        """One kernel launch, returned once the workload has made it."""
        with self._lock:
            assert self.p.stdin is not None
            self.p.stdin.write("\n")
            self.p.stdin.flush()
            self._until("launch")

    def alive(self) -> bool:
        return self.p.poll() is None

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.p.kill()
        self.p.wait(30)
        for f in (self.p.stdin, self.p.stdout, self.p.stderr):
            if f is not None:
                f.close()


# -- the scenario ----------------------------------------------------------------------------------


class Scenario:
    def __init__(
        self,
        kube: KubeServer,
        ledger: Ledger,
        cfg: Config,
        shim: Shim,
        eviction_api: bool,
        runtime: ContainerRuntime,
    ) -> None:
        self.kube, self.ledger, self.cfg, self.shim, self.runtime = kube, ledger, cfg, shim, runtime
        self.pods: dict[str, tuple[str, str, str]] = {}  # container key -> (namespace, pod, pod UID)
        self.containers: dict[str, Container] = {}  # container key -> its kubelet container
        self.v1 = kube.core_v1()
        self.evictions = EvictionApi(kube) if eviction_api else None
        self.listing: dict[str, ContainerDevices] = {}
        self.workloads: list[Workload] = []
        self.reaper: IdleReaper | None = None
        self.passes = 0
        self._next_slice = 0

    def pod(self, name: str, ann: dict[str, str], namespace: str = "default") -> ContainerAlloc:
        """A pod in the apiserver, its container's allocation, and what pod-resources lists."""
        with contextlib.suppress(Exception):
            self.v1.create_namespace({"metadata": {"name": namespace}})
        created = self.v1.create_namespaced_pod(
            namespace, pod_manifest(name, node=NODE, namespace=namespace, annotations=ann)
        )
        gpu = self.ledger.inventory.gpus[0].uuid
        ids = [device_id(gpu, MEMORY, self._next_slice)]
        self._next_slice += 1
        alloc = self.ledger.allocate(MEMORY, ids)
        self.listing[alloc.key] = ContainerDevices(namespace, name, "main", MEMORY, tuple(ids))
        assert created.metadata is not None and created.metadata.uid
        self.pods[alloc.key] = (namespace, name, created.metadata.uid)
        return alloc

    def workload(self, alloc: ContainerAlloc, **kw: Any) -> Workload:
        w = Workload(self.shim, alloc.directory, **kw)
        self.workloads.append(w)
        self.enter(alloc, w.p.pid)
        return w

    def enter(self, alloc: ContainerAlloc, pid: int) -> None:
        """Put process `pid` in the cgroup of `alloc`'s pod's container, as the kubelet's
        runtime places a container's processes, and name that container's ID in the pod's
        status: the driver's samples of a process count for a container only when the
        kernel places it there (gpufrac.agent.gpu.activity)."""
        c = self.containers.get(alloc.key)
        namespace, name, uid = self.pods[alloc.key]
        if c is None:
            c = self.containers[alloc.key] = self.runtime.start(uid, "main", ["sleep", "3600"])
            self.runtime.wait_entered(c)
            cs = {
                "name": "main",
                "containerID": c.runtime_id,
                "image": "app",
                "imageID": "app",
                "ready": True,
            }
            self.v1.patch_namespaced_pod(
                name,
                namespace,
                {"status": {"phase": "Running", "containerStatuses": [{**cs, "restartCount": 0}]}},
            )
        (c.cgroup_dir / "cgroup.procs").write_text(str(pid))

    def run(self, body: Callable[[IdleReaper], Awaitable[None]], *, reaping: bool = True) -> None:
        """Run `body` with the reaper passing every idle.interval (or not, with reaping=False)."""

        async def main() -> None:
            api = make_api_client(host=self.kube.url)
            cache = PodCache(api, NODE)
            cache.start()
            metrics = Metrics()
            ident = PodIdentity(self.cfg, self.ledger, cache, EventRecorder(api, NODE), metrics=metrics)
            tracker = ActivityTracker(nvml=await asyncio.to_thread(NvmlUtilisation))
            reaper = self.reaper = IdleReaper(
                self.cfg,
                self.ledger,
                tracker,
                ident,
                evictor=PodEvictor(api, allow_delete=self.cfg.idle.allow_delete),
                metrics=metrics,
            )
            task = None
            stop = asyncio.Event()
            try:
                assert await cache.wait_synced(30)
                await ident.resolve(self.listing)
                if reaping:
                    task = asyncio.create_task(self._loop(reaper, stop))
                await body(reaper)
            finally:
                # Let a pass in flight finish: cancelling it between an eviction and its
                # Event would lose the Event the test then looks for.
                stop.set()
                if task is not None:
                    await asyncio.wait_for(task, 30)
                await ident.close()
                tracker.close()

        try:
            asyncio.run(main())
        finally:
            for w in self.workloads:
                w.close()

    async def _loop(self, reaper: IdleReaper, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await reaper.tick()
            self.passes += 1
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), self.cfg.idle.interval)

    async def passes_later(self, n: int) -> None:
        """Wait for n more reaper passes (time for the reaper to have acted, if it would)."""
        target = self.passes + n
        await until(lambda: self.passes >= target, what=f"{n} reaper passes")

    # -- what the apiserver saw -------------------------------------------------------------------

    def events(self, pod: str, reason: str | None = None) -> list[dict[str, Any]]:
        return [
            e
            for e in self.kube.events()
            if e["involvedObject"]["name"] == pod and (reason is None or e["reason"] == reason)
        ]

    def exists(self, pod: str, namespace: str = "default") -> bool:
        return any(p["metadata"]["name"] == pod for p in self.kube.objects(PODS, namespace))

    def writes_to(self, pod: str) -> list[tuple[str, str]]:
        """Evictions and deletions of a pod the apiserver was asked for."""
        return [
            (m, path)
            for m, path, _ in self.kube.requests()
            if (m == "DELETE" and path.split("/")[-2:] == ["pods", pod])
            or path.endswith(f"/pods/{pod}/eviction")
        ]

    def request_order(self) -> list[str]:
        """Eviction POSTs and the reasons of Event POSTs, in the order the apiserver got them."""
        return request_order(self.kube)


async def until(cond: Callable[[], Any], what: str = "condition") -> Any:
    """cond() asks the apiserver (a blocking call): it runs in a thread."""
    return await until_async(cond, DEADLINE, what, interval=0.05, in_thread=True)


@pytest.fixture
def make_scenario(kube_server: KubeServer, in_process_nvml: Any, tmp_path: Path) -> Iterator[Any]:
    made: list[Ledger] = []
    try:
        runtime = ContainerRuntime(view_root=tmp_path / "v")
    except RuntimeUnavailable as e:
        pytest.skip(str(e))

    def make(eviction_api: bool = True, **idle: Any) -> Scenario:
        base = {"interval": "100ms", "action": "evict"}
        cfg = load(
            overrides={
                "nodeName": NODE,
                "paths": {"stateDir": str(tmp_path / "state")},
                "idle": {**base, **idle},
            }
        )
        ledger = Ledger(cfg, read_inventory())
        made.append(ledger)
        return Scenario(kube_server, ledger, cfg, Shim(in_process_nvml.env, "release"), eviction_api, runtime)

    with runtime:
        yield make
    for led in made:
        for a in led.containers():
            led.release(a.key)


# -- tests -----------------------------------------------------------------------------------------


def test_idle_interactive_pod_is_warned_then_evicted_and_no_other_pod_is_touched(make_scenario: Any) -> None:
    s = make_scenario(idleTimeout="2s", gracePeriod="1s", exemptNamespaces=["kube-system", "vip"])
    nb = s.pod("nb", INTERACTIVE)
    others = {
        "train": s.pod("train", {}),  # batch
        "server": s.pod("server", {annotations.WORKLOAD_CLASS: "inference"}),
        "vip-nb": s.pod("vip-nb", INTERACTIVE, namespace="vip"),
        "pinned": s.pod("pinned", {**INTERACTIVE, annotations.IDLE_EXEMPT: "true"}),
    }
    for alloc in [nb, *others.values()]:
        s.workload(alloc)  # one launch, then idle with 64 MiB held

    async def body(reaper: IdleReaper) -> None:
        await until(lambda: not s.exists("nb"), what="the idle pod evicted")
        # As long again as nb needed, for the others: idle just as long, never touched.
        await s.passes_later(40)
        assert all(w.alive() for w in s.workloads[1:])

    s.run(body)
    order = s.request_order()
    assert order.index("IdleWarning:nb") < order.index("eviction:nb")
    assert order.count("eviction:nb") == 1
    evicted = s.events("nb", "IdleEvicted")
    assert len(evicted) == 1 and evicted[0]["type"] == "Warning"
    msg = evicted[0]["message"]
    assert "no GPU work for" in msg and "idle-timeout 2s from node config idle.idleTimeout" in msg
    assert "class interactive" in msg and "evicted through the Eviction API" in msg
    for name in others:
        assert [e["reason"] for e in s.events(name) if e["reason"].startswith(("Idle", "MaxRuntime"))] == []
        assert s.writes_to(name) == []
    assert all(s.exists(n) for n in ("train", "server", "pinned")) and s.exists("vip-nb", "vip")


def test_gpu_work_in_the_grace_period_spares_the_pod(make_scenario: Any) -> None:
    s = make_scenario(idleTimeout="2s", gracePeriod="1m")
    nb = s.pod("nb", INTERACTIVE)
    w = s.workload(nb)

    async def body(reaper: IdleReaper) -> None:
        await until(lambda: s.events("nb", "IdleWarning"), what="IdleWarning")
        await asyncio.to_thread(w.launch)  # the user comes back
        await until(lambda: s.events("nb", "IdleCancelled"), what="IdleCancelled")
        assert w.alive()

    s.run(body)
    cancelled = s.events("nb", "IdleCancelled")[0]
    assert cancelled["type"] == "Normal" and "GPU work resumed" in cancelled["message"]
    assert s.exists("nb")
    assert s.writes_to("nb") == []


def test_max_runtime_reaps_a_busy_interactive_pod_at_its_limit(make_scenario: Any) -> None:
    s = make_scenario(idleTimeout="2s", gracePeriod="1s")
    nb = s.pod("nb", {**INTERACTIVE, annotations.MAX_RUNTIME: "5s"})
    w = s.workload(nb)
    stop = threading.Event()

    def busy() -> None:
        while not stop.is_set() and w.alive():
            w.launch()
            stop.wait(0.2)

    async def body(reaper: IdleReaper) -> None:
        worker = asyncio.create_task(asyncio.to_thread(busy))
        try:
            await until(lambda: not s.exists("nb"), what="the pod evicted at its max runtime")
        finally:
            stop.set()
            await worker
        act = reaper.tracker.get(nb.key)
        assert act is not None and act.launches >= 5  # it was busy, and the tracker saw it

    s.run(body)
    # Not before its limit: the apiserver got the eviction at least 5 s after the allocation.
    assert s.evictions is not None and s.evictions.evicted_at["nb"] - nb.created >= 5.0
    reasons = [e["reason"] for e in s.events("nb")]
    assert "MaxRuntimeWarning" in reasons and "MaxRuntimeEvicted" in reasons
    assert "IdleWarning" not in reasons  # never idle
    msg = s.events("nb", "MaxRuntimeEvicted")[0]["message"]
    assert "max runtime reached" in msg and "max-runtime 5s from annotation gpufrac.dev/max-runtime" in msg


def test_dry_run_reports_and_changes_nothing(make_scenario: Any, caplog: pytest.LogCaptureFixture) -> None:
    s = make_scenario(idleTimeout="1s", gracePeriod="500ms", dryRun=True)
    nb = s.pod("nb", INTERACTIVE)
    w = s.workload(nb)

    async def body(reaper: IdleReaper) -> None:
        await until(lambda: s.events("nb", "IdleDryRun"), what="IdleDryRun")
        await s.passes_later(20)
        assert w.alive()
        assert abi.read_usage(nb.directory).total_used == HELD  # its GPU memory untouched

    with caplog.at_level("WARNING", logger="gpufrac.agent.idle.reaper"):
        s.run(body)
    assert "dry run: would evict the pod" in s.events("nb", "IdleDryRun")[0]["message"]
    assert s.events("nb", "IdleWarning")[0]["message"].startswith("dry run: ")
    assert any("would evict" in r.getMessage() for r in caplog.records)
    assert s.writes_to("nb") == [] and s.exists("nb")


def test_pdb_refusal_is_retried_and_reported_never_forced(make_scenario: Any) -> None:
    # allowDelete on: even so a PodDisruptionBudget's refusal is never answered with a delete.
    s = make_scenario(idleTimeout="1s", gracePeriod="500ms", allowDelete=True)
    nb = s.pod("nb", INTERACTIVE)
    s.workload(nb)
    assert s.evictions is not None
    s.evictions.blocked.add("nb")

    async def body(reaper: IdleReaper) -> None:
        await until(lambda: s.evictions.attempts.get("nb", 0) >= 3, what="three eviction attempts")  # type: ignore[union-attr]
        await until(lambda: sum(e.get("count", 1) for e in s.events("nb", "IdleEvictionBlocked")) >= 3)
        assert s.exists("nb")
        s.evictions.blocked.discard("nb")  # type: ignore[union-attr]  # the budget allows it again
        await until(lambda: not s.exists("nb"), what="the pod evicted once the budget allows")

    s.run(body)
    blocked = s.events("nb", "IdleEvictionBlocked")
    assert len(blocked) == 1 and blocked[0]["count"] >= 3  # one Event, aggregated
    assert "disruption budget" in blocked[0]["message"] and "never forcing" in blocked[0]["message"]
    assert not [w for w in s.writes_to("nb") if w[0] == "DELETE"]
    assert len(s.events("nb", "IdleEvicted")) == 1


@pytest.mark.parametrize("allow_delete", [False, True])
def test_without_the_eviction_api_a_pod_is_deleted_only_when_configured(
    make_scenario: Any, allow_delete: bool
) -> None:
    # No Eviction subresource here: kmock answers 404 for it while the pod exists.
    s = make_scenario(eviction_api=False, idleTimeout="1s", gracePeriod="500ms", allowDelete=allow_delete)
    nb = s.pod("nb", INTERACTIVE)
    s.workload(nb)

    async def body(reaper: IdleReaper) -> None:
        if allow_delete:
            await until(lambda: not s.exists("nb"), what="the pod deleted")
        else:
            await until(lambda: s.events("nb", "IdleEvictionFailed"), what="IdleEvictionFailed")
            await s.passes_later(20)
            assert s.exists("nb")

    s.run(body)
    deletes = [w for w in s.writes_to("nb") if w[0] == "DELETE"]
    if allow_delete:
        assert len(deletes) == 1
        assert "Eviction API not served" in s.events("nb", "IdleDeleted")[0]["message"]
    else:
        assert deletes == []
        assert "set idle.allowDelete" in s.events("nb", "IdleEvictionFailed")[0]["message"]


def test_cpu_only_phase_is_not_reaped_before_the_pods_own_timeout(make_scenario: Any) -> None:
    # The node says 1 s; the pod says 5 s. Its process holds memory and only uses the CPU.
    s = make_scenario(idleTimeout="1s", gracePeriod="500ms")
    nb = s.pod("nb", {**INTERACTIVE, annotations.IDLE_TIMEOUT: "5s"})
    w = s.workload(nb, launch_first=False)

    async def body(reaper: IdleReaper) -> None:
        assert abi.read_usage(nb.directory).total_used == HELD
        await until(lambda: not s.exists("nb"), what="eviction after its own timeout")

    s.run(body)
    warning = s.events("nb", "IdleWarning")[0]["message"]
    assert "idle-timeout 5s from annotation gpufrac.dev/idle-timeout" in warning
    # The process started (and its slot was stamped) after w.started: evicted once idle for its
    # own 5 s and the 500 ms grace period after the warning, never on the node's 1 s.
    assert s.evictions is not None and s.evictions.evicted_at["nb"] - w.started >= 5.5


def test_nvml_utilisation_keeps_a_long_kernel_active(make_scenario: Any) -> None:
    """A kernel that runs for seconds is launched once: the shim's stamp ages, NVML's per-process
    utilisation shows the work, mapped to the container through the process's pid."""
    s = make_scenario()
    nb = s.pod("nb", INTERACTIVE)
    code = """
        import time
        mod = chk(cu.cuModuleLoadData(b"SIMGPU-MODULE"))
        f = chk(cu.cuModuleGetFunction(mod, b"busy_us"))
        d = chk(cu.cuMemAlloc(64 << 20))
        chk(cu.cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, 0, ((30_000_000,), (ctypes.c_uint64,)), 0))
        print("launched", flush=True)
        sys.stdin.readline()
    """
    p = s.shim.python_popen(nb.directory, code)  # type: ignore[arg-type]
    s.enter(nb, p.pid)

    async def body(reaper: IdleReaper) -> None:
        try:
            assert (await asyncio.to_thread(read_line, p, DEADLINE)).strip() == "launched"
            launched = time.monotonic()
            deadline = launched + DEADLINE
            while True:
                act = (await reaper.tracker.poll([nb], reaper.container_ids([nb]))).get(nb.key)
                # Work seen later than the launch stamp could explain: NVML's samples.
                if act is not None and act.why == "nvml" and act.last_active > launched + 1.0:
                    break
                assert time.monotonic() < deadline, (
                    f"NVML utilisation never attributed to the container: {act}"
                )
                await asyncio.sleep(0.2)
            assert act.launches == 1  # one launch, long ago by now
        finally:
            p.kill()
            p.wait(30)

    s.run(body, reaping=False)


def test_the_agent_reaps_through_its_idle_task(make_sim: Callable[..., Sim], kube_server: KubeServer) -> None:
    """The whole chain: the kubelet emulator admits pods, the real agent (a subprocess) finds
    them through pod-resources and the apiserver, and its idle task evicts the idle interactive
    one (its container never touched the GPU) while the idle batch one stays."""
    evictions = EvictionApi(kube_server)
    node = "sim-node-1"
    idle = {"idleTimeout": "2s", "gracePeriod": "1s", "interval": "200ms", "action": "evict"}
    sim = make_sim(config={"nodeName": node, "apiServer": kube_server.url, "idle": idle})
    v1 = kube_server.core_v1()
    for name, ann in (("nb", INTERACTIVE), ("train", {})):
        pod = KPod("default", name, [KContainer("main", {MEMORY: 1})], annotations=ann)
        v1.create_namespaced_pod("default", pod_manifest(name, node=node, uid=pod.uid, annotations=ann))
        sim.kubelet.admit(pod)

    def gone() -> bool:
        return not any(p["metadata"]["name"] == "nb" for p in kube_server.objects(PODS, "default"))

    try:
        sim.kubelet.wait_for(gone, DEADLINE)
    except TimeoutError:
        raise AssertionError(
            f"the idle pod was never evicted; agent log:\n{sim.agent.log()[-4000:]}"
        ) from None

    def reasons() -> set[tuple[str, str]]:
        return {(e["involvedObject"]["name"], e["reason"]) for e in kube_server.events("default")}

    # The Event recorder posts in the background: the eviction can land first.
    try:
        sim.kubelet.wait_for(lambda: {("nb", "IdleWarning"), ("nb", "IdleEvicted")} <= reasons(), 10)
    except TimeoutError:
        raise AssertionError(f"events: {sorted(reasons())}; agent log:\n{sim.agent.log()[-4000:]}") from None
    assert not [r for p, r in reasons() if p == "train" and r.startswith("Idle")]
    assert evictions.attempts == {"nb": 1}
