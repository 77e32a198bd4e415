"""`gpufrac run`: the agent on this node, or a simulated GPU node with a short demo.

On a real node (an NVIDIA driver and a kubelet present) this is the agent itself.
Elsewhere it builds a simulated node and runs every real part against it: the
agent as its own process, the kubelet emulator driving it over the device-plugin
gRPC API, kmock's apiserver emulator holding the pods, and "containers" that are
real processes in real cgroups running CUDA (cuda-python over simgpu's fake
libcuda) under the memguard shim. It then walks through sharing, bursting and
collisions, printing each step, and serves the agent's metrics on localhost. A second
simulated node runs the agent in DRA mode (a DRA driver, started alongside the first so its
start costs no time): a claim is placed on the GPU that has room, held to its limit, and
bursts. Over 500 lines: one walk-through, read top to bottom as the user sees it printed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpufrac.agent.metrics import names
from gpufrac.core import native
from gpufrac.core.units import format_bytes

KUBELET_SOCKET = "/var/lib/kubelet/device-plugins/kubelet.sock"
NODE = "sim-node"
DRA_NODE = "sim-dra-node"  # a second simulated node, in DRA mode
DRA_PRESET = "a100x2-nvlink"
DRIVER = "gpufrac.dev"
GiB = 1 << 30
FRACTION = "gpufrac.dev/gpu-fraction"
MEMORY = "gpufrac.dev/gpu-memory"
# Metric families the demo prints when non-zero (what the collisions left behind).
COUNTERS_SHOWN = {
    names.CONTAINER_EVICTIONS,
    names.CONTAINER_SWAPS,
    names.CONTAINER_WAIT_SECONDS + "_count",
    names.ARBITER_REQUESTS,
}
# The llm-server pod's memory series the demo prints.
LLM_MEMORY_SHOWN = {
    names.CONTAINER_MEMORY_REQUEST,
    names.CONTAINER_MEMORY_LIMIT,
    names.CONTAINER_MEMORY_USED,
    names.CONTAINER_MEMORY_BURST_GRANTED,
}


# Signals that end the demo. Python's default for SIGTERM and SIGHUP ends the process on
# the spot, skipping every `with` below: the agent process kept serving :9410, and the
# temp directory and the containers' cgroups stayed behind.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Stopped(KeyboardInterrupt):
    """A stop signal, raised where the demo happens to be so that everything unwinds;
    a KeyboardInterrupt so it ends the demo exactly as Ctrl-C always has."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP all raise Stopped in the main thread. Once one has
    arrived, further ones are ignored until the block is left: a cleanup half done by an
    impatient second Ctrl-C is what leaks."""

    def stop(signum: int, _frame: Any) -> None:
        for s in STOP_SIGNALS:
            signal.signal(s, signal.SIG_IGN)
        raise Stopped(signum)

    before = {s: signal.signal(s, stop) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def real_node_present() -> bool:
    """A real GPU node: the NVIDIA driver's device files and a kubelet socket."""
    return os.path.exists("/dev/nvidiactl") and os.path.exists(KUBELET_SOCKET)


def banner(title: str) -> None:
    print(f"\n=== {title} " + "=" * max(0, 74 - len(title)), flush=True)


def say(text: str) -> None:
    print(text, flush=True)


def free_port(preferred: int) -> int:
    """`preferred` if nothing listens there, else any free port (the demo must not fail
    because something else on the machine already serves 9410)."""
    for port in (preferred, 0):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return int(s.getsockname()[1])
    raise RuntimeError("no free TCP port on 127.0.0.1")


def until(cond: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"demo: {what} did not happen within {timeout:.0f}s")
        time.sleep(0.05)


@dataclass
class DemoPod:
    namespace: str
    name: str
    resource: str
    count: int
    annotations: dict[str, str]
    priority: int = 0
    uid: str = ""
    gpu: str = ""
    workload: Any = None  # gpufrac.simgpu.workload.WorkloadProcess once started


class SimNode:
    """Every part of a simulated node, started in order and stopped in reverse."""

    def __init__(self, preset: str, root: Path, stack: contextlib.ExitStack) -> None:
        from gpufrac.simgpu.apiserver import KubeServer
        from gpufrac.simgpu.kubelet import AgentProcess, KubeletEmulator
        from gpufrac.simgpu.runtime import ContainerRuntime
        from gpufrac.simgpu.spec import create_node, load_preset

        self.root = root
        self.state = root / "node.state"
        create_node(load_preset(preset, node_name=NODE), self.state)
        self.libdir = native.native_dir()
        for lib in (native.FAKE_NVML, native.FAKE_CUDA, native.SHIM):
            native.library(lib)
        self.env = dict(os.environ)
        self.env["SIMGPU_STATE"] = str(self.state)
        self.env["LD_LIBRARY_PATH"] = f"{self.libdir}:{self.env.get('LD_LIBRARY_PATH', '')}".rstrip(":")
        self.api = KubeServer()
        stack.callback(self.api.close)
        self.v1 = self.api.core_v1()
        # The Node object a cluster has for every node: the agent keeps its labels.
        # The client sends a plain dict body as it is; its hints name only the model class.
        node = {"metadata": {"name": NODE, "labels": {"gpufrac.dev/enabled": "true"}}}
        self.v1.create_node(node)  # type: ignore[arg-type]
        self.kubelet = KubeletEmulator(root / "k").start()
        stack.callback(self.kubelet.stop)
        self.metrics_port = free_port(9410)
        self.status_socket = root / "status.sock"
        self.agent = AgentProcess(
            root / "a",
            self.state,
            root / "k",
            {
                "nodeName": NODE,
                "apiServer": self.api.url,
                "statusSocket": str(self.status_socket),
                "metrics": {"port": self.metrics_port, "bindAddress": "127.0.0.1"},
                "waitTimeout": "20s",
                "evictIdleThreshold": "10m",
                "swap": {"idleThreshold": "2s"},
            },
        )
        stack.callback(self.agent.stop)  # before start(): a stop signal may come at any point
        self.agent.start()
        self.runtime = ContainerRuntime(view_root=root / "v")
        stack.callback(self.runtime.close)

    def gpufrac(self, *args: str) -> str:
        """A gpufrac CLI command on the simulated node, as a user would run it."""
        r = subprocess.run(
            [sys.executable, "-m", "gpufrac.agent.cli.commands", *args],
            env=self.env,
            capture_output=True,
            text=True,
            check=False,
        )
        if r.returncode != 0:
            raise RuntimeError(f"gpufrac {' '.join(args)} failed: {r.stderr.strip()}")
        return r.stdout

    def admit(self, p: DemoPod) -> None:
        """The scheduler binds the pod to this node; the kubelet admits it through the plugin."""
        from gpufrac.simgpu.apiserver import pod_manifest
        from gpufrac.simgpu.kubelet import Container, Pod

        manifest = pod_manifest(
            p.name, node=NODE, namespace=p.namespace, annotations=p.annotations, priority=p.priority
        )
        created = self.v1.create_namespaced_pod(p.namespace, manifest)  # type: ignore[arg-type]  # a dict body, as above
        p.uid = (created.metadata.uid if created.metadata else None) or ""
        pod = Pod(
            p.namespace, p.name, [Container("main", {p.resource: p.count})], p.uid, p.annotations, p.priority
        )
        devices = self.kubelet.admit(pod)["main"][p.resource]
        p.gpu = devices[0].split("::")[0]

    def start(self, p: DemoPod, argv: list[str] | None = None) -> None:
        """The container runtime starts the pod's container with what Allocate returned
        (running `argv`: default the memory workload, gpufrac.simgpu.workload)."""
        from gpufrac.simgpu.runtime import mounts_of
        from gpufrac.simgpu.workload import WorkloadProcess

        resp = self.kubelet.allocate_response(p.uid, "main", p.resource)
        c = self.runtime.start(
            p.uid,
            "main",
            argv or WorkloadProcess.argv(),
            env=self.env,
            envs=dict(resp.envs),
            mounts=mounts_of(resp),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        cs = {"name": "main", "containerID": c.runtime_id, "image": "app", "imageID": "app", "ready": True}
        self.v1.patch_namespaced_pod(
            p.name,
            p.namespace,
            {"status": {"phase": "Running", "containerStatuses": [{**cs, "restartCount": 0}]}},
        )
        p.workload = WorkloadProcess(c.proc, p.name)

    def status(self) -> dict[str, Any]:
        from gpufrac.agent.status.client import fetch

        return fetch(str(self.status_socket))

    def start_dra(self, stack: contextlib.ExitStack) -> None:
        """The second node, in DRA mode: its own GPUs, the kubelet's DRA side, the agent as a
        DRA driver; only started here, awaited by the DRA section."""
        from kubernetes import client

        from gpufrac.simgpu.dra_scheduler import Allocator
        from gpufrac.simgpu.kubelet import AgentProcess
        from gpufrac.simgpu.kubelet.dra import DraKubelet
        from gpufrac.simgpu.spec import create_node, load_preset

        root = self.root / "dra"
        self.dra_state = root / "node.state"
        create_node(load_preset(DRA_PRESET, node_name=DRA_NODE), self.dra_state)
        api = self.api.api_client()
        self.resource = client.ResourceV1Api(api)
        # What an install creates (deploy/dra/deviceclasses.yaml): a share of a GPU's memory.
        device_class = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "DeviceClass",
            "metadata": {"name": f"gpu-memory.{DRIVER}"},
            "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{DRIVER}"'}}]},
        }
        self.resource.create_device_class(device_class, _preload_content=False)  # type: ignore[arg-type]  # a dict body
        self.dra_kubelet = DraKubelet(root / "k", api, DRA_NODE, cdi_dir=root / "cdi").start()
        stack.callback(self.dra_kubelet.stop)
        self.allocator = Allocator(api)
        self.dra_agent = AgentProcess(
            root / "a",
            self.dra_state,
            root / "k",
            {
                "mode": "dra",
                "nodeName": DRA_NODE,
                "apiServer": self.api.url,
                "statusSocket": str(root / "status.sock"),
                "metrics": {"port": free_port(9411), "bindAddress": "127.0.0.1"},
                "dra": {"cdiSpecDir": str(root / "cdi")},
            },
        )
        stack.callback(self.dra_agent.stop)
        self.dra_agent.start()

    def container(self, p: DemoPod) -> dict[str, Any] | None:
        for c in self.status().get("containers", []):
            if c.get("pod") == p.name and c.get("namespace") == p.namespace:
                found: dict[str, Any] = c
                return found
        return None

    def events(self, since: int = 0) -> list[dict[str, Any]]:
        evs = sorted(self.api.events(), key=lambda e: e.get("metadata", {}).get("creationTimestamp", ""))
        return evs[since:]


def used_bytes(node: SimNode, p: DemoPod) -> int:
    """What the shim counts for the pod's container (its usage file, read by the agent)."""
    c = node.container(p) or {}
    return int(c.get("used_bytes") or 0)


def show_events(node: SimNode, seen: list[int]) -> None:
    """Print the Kubernetes Events posted since the last call."""
    evs = node.events()
    for e in evs[seen[0] :]:
        obj = e.get("involvedObject", {})
        who = f"{obj.get('kind', '')}/{obj.get('name', '')}"
        say(f"  event  {e.get('type', ''):7} {e.get('reason', ''):22} {who}: {e.get('message', '')}")
    seen[0] = len(evs)


def gib(n: float) -> int:
    return int(n * GiB)


@contextlib.contextmanager
def simulated_node(preset: str) -> Iterator[SimNode]:
    # Short root: unix socket paths must stay under 108 bytes.
    with tempfile.TemporaryDirectory(prefix="gfdemo", dir="/tmp") as tmp, contextlib.ExitStack() as stack:
        node = SimNode(preset, Path(tmp), stack)
        node.start_dra(stack)
        yield node


def run_demo(args: argparse.Namespace) -> int:
    with stop_on_signals():
        return _run_demo(args)


def _run_demo(args: argparse.Namespace) -> int:
    try:
        with simulated_node(args.preset) as node:
            try:
                return _walkthrough(node, args)
            except Exception:
                # What the agent said is what explains a failed step.
                say("\n--- the demo failed; the agent's log ends with:")
                say("\n".join(node.agent.log().splitlines()[-40:]))
                raise
    except Exception as e:  # setup (no cgroups, no native build, bad preset) or a failed step
        print(f"gpufrac run: the simulated-node demo failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


def _walkthrough(node: SimNode, args: argparse.Namespace) -> int:
    from gpufrac.agent.cli.status import format_status

    banner(f"A simulated GPU node: preset {args.preset}")
    say(f"node state {node.state}; fake NVML and CUDA driver libraries in {node.libdir}")
    banner("GPU inventory (gpufrac gpus)")
    say(node.gpufrac("gpus").rstrip())
    banner("Topology (gpufrac topo)")
    say(node.gpufrac("topo").rstrip())

    banner("The agent registers two resources with the kubelet")
    until(lambda: node.kubelet.connected(FRACTION) and node.kubelet.connected(MEMORY), "registration")
    for r in (FRACTION, MEMORY):
        say(f"  {r:26} allocatable {node.kubelet.allocatable(r)} slices")

    banner("Node labels the agent keeps (kubectl get node --show-labels)")

    def node_labels() -> dict[str, str]:
        meta = node.v1.read_node(NODE).metadata
        return dict((meta.labels if meta else None) or {})

    until(lambda: "gpufrac.dev/gpu.count" in node_labels(), "node labels")
    for k, v in sorted(node_labels().items()):
        say(f"  {k}={v}")

    pods = [
        DemoPod(
            "inference",
            "llm-server",
            MEMORY,
            16,
            {"gpufrac.dev/gpu-memory-limit": "40Gi", "gpufrac.dev/workload-class": "inference"},
            1000,
        ),
        DemoPod("batch", "embedder", MEMORY, 16, {"gpufrac.dev/gpu-memory-limit": "60Gi"}, 0),
        DemoPod(
            "research",
            "notebook",
            MEMORY,
            8,
            {
                "gpufrac.dev/workload-class": "interactive",
                "gpufrac.dev/swappable": "true",
                "gpufrac.dev/gpu-memory-limit": "16Gi",
            },
            0,
        ),
        DemoPod("training", "trainer", FRACTION, 200, {}, 500),
        DemoPod("research", "sandbox", FRACTION, 5, {"gpufrac.dev/gpu-memory-limit": "nonsense"}, 0),
    ]
    server, embedder, notebook = pods[0], pods[1], pods[2]
    banner("Pods arrive; the kubelet admits them through the device plugin")
    inv = {g["uuid"]: g for g in node.status().get("gpus", [])}
    for p in pods:
        node.admit(p)
        idx = inv.get(p.gpu, {}).get("index", "?")
        say(f"  {p.namespace + '/' + p.name:22} {p.resource.split('/')[1]}={p.count:<4} -> GPU {idx}")
    seen = [0]
    until(lambda: all(node.container(p) for p in pods), "pod identity for every container")
    show_events(node, seen)

    def do(p: DemoPod, what: str, cmd: str) -> str:
        answer: str = p.workload.do(cmd, timeout=120)
        if answer.startswith("free "):  # "free N total M" in bytes: say it in GiB
            _, free, _, total = answer.split()
            answer = f"free {format_bytes(int(free))}, total {format_bytes(int(total))}"
        say(f"  {p.name:10} {what:48} -> {answer}")
        return answer

    banner("Sharing GPU 0: real CUDA processes under the memguard shim")
    # Every CUDA process takes device memory for its context before it allocates anything
    # (simgpu charges its preset's estimate, docs/simgpu.md); the shim charges it to the
    # container, so it counts against the request and limit like an allocation. The sizes
    # below leave room for it (they assume about 512Mi, the H100 estimate).
    for p in (server, embedder, notebook):
        node.start(p)
        held = format_bytes(used_bytes(node, p))
        say(f"  {p.name:10} {'starts: cuInit, its CUDA context, a module':48} -> the shim counts {held}")
    do(server, "cuMemGetInfo (total = limit; free = less context)", "info")
    do(server, "allocates 11Gi, within its 16Gi request", f"alloc {gib(11)}")
    do(notebook, "allocates 7Gi, within its 8Gi request", f"alloc {gib(7)} 7")
    do(notebook, "bursts 3Gi past its request", f"alloc {gib(3)} 7")
    do(embedder, "allocates 15Gi, within its 16Gi request", f"alloc {gib(15)}")
    do(embedder, "bursts 20Gi while the GPU has it free", f"alloc {gib(20)}")
    do(embedder, "asks 30Gi more: past its 60Gi limit", f"alloc {gib(30)}")
    show_events(node, seen)

    banner("Collision 1 - swap: llm-server bursts; the idle notebook goes to host RAM")
    time.sleep(2.5)  # the notebook's idle window (swap.idleThreshold in this demo's config)
    do(server, "allocates 4Gi (still within its request)", f"alloc {gib(4)}")
    do(server, "bursts 14Gi: more than is free", f"alloc {gib(14)}")
    show_events(node, seen)

    banner("Collision 2 - evict: llm-server bursts again; the low-priority borrower goes")
    do(server, "bursts 8Gi more (within its 40Gi limit)", f"alloc {gib(8)}")
    show_events(node, seen)

    banner("The notebook wakes up: swap-in, its bytes intact")
    do(notebook, "checks its buffer (the launch swaps it back in)", "check 1")
    show_events(node, seen)

    banner("Collision 3 - wait: equal priorities, nothing idle; the burst waits for a free")
    embedder.workload.close()
    node.start(embedder)  # the kubelet restarted the evicted container
    do(embedder, "allocates 15Gi, within its request, again", f"alloc {gib(15)}")
    do(embedder, "bursts 10Gi", f"alloc {gib(10)}")
    notebook.workload.send(f"alloc {gib(2)}")
    say(f"  {'notebook':10} {'bursts 2Gi: not enough free, waits ...':48}")
    time.sleep(1.0)
    do(embedder, "frees its 10Gi burst", "free 2")
    answer = notebook.workload.line(120)
    say(f"  {'notebook':10} {'... and its waiting allocation completes':48} -> {answer}")
    show_events(node, seen)

    compute_shares(node)
    dra_section(node)

    banner("gpufrac status")
    say(format_status(node.status()).rstrip())

    url = f"http://127.0.0.1:{node.metrics_port}/metrics"
    banner(f"Prometheus metrics at {url}")
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    for line in text.splitlines():
        name = line.split("{", 1)[0]
        llm = 'pod="llm-server"' in line and name in LLM_MEMORY_SHOWN
        counted = name in COUNTERS_SHOWN and not line.endswith(" 0.0")
        if llm or counted:
            say("  " + line)
    if args.keep:
        say(f"\nserving until Ctrl-C (or SIGTERM): metrics {url}, status socket {node.status_socket}")
        with contextlib.suppress(KeyboardInterrupt):  # Stopped too: a requested end, exit code 0
            while True:
                time.sleep(3600)
    for p in pods:
        if p.workload is not None:
            p.workload.close()
    return 0


def compute_shares(node: SimNode) -> None:
    """Two pods share an empty GPU's compute by their shares (docs/compute.md). Not GPU 0: its
    free slices' memory is lent out as bursts, and two newcomers there would have their
    guarantees reclaimed from llm-server and the notebook (admission evicts borrowers)."""
    banner("Compute shares: two pods busy on one GPU, held to their shares")
    # 60 % fits no GPU holding pods; binpack then puts the 20 % beside it, on the fuller GPU.
    big = DemoPod("batch", "renderer", FRACTION, 60, {}, 0)
    small = DemoPod("batch", "tagger", FRACTION, 20, {}, 0)
    argv = [sys.executable, "-m", "gpufrac.simgpu.computeload"]
    for p in (big, small):
        node.admit(p)
        node.start(p, argv)
    until(
        lambda: all((c := node.container(p)) and c.get("compute_share") for p in (big, small)),
        "compute shares",
    )

    def show(p: DemoPod, what: str) -> None:
        c = node.container(p) or {}
        used, share = c.get("compute_used") or 0.0, c.get("compute_share") or 0.0
        held = ", launches paced" if c.get("compute_paced") else ""
        mode = f"({c.get('compute_mode')})"
        say(f"  {p.name:10} share {share * 100:3.0f}% {mode:8} {what:28} uses {used * 100:3.0f}%{held}")

    big.workload.do("spin 2000 8 1 launch")
    time.sleep(1.5)
    show(big, "alone: the whole GPU")
    small.workload.do("spin 2000 8 1 launch")
    time.sleep(2.5)
    for p in (big, small):
        show(p, "both busy: its share")
    say("  (the driver's time slicing alone would give each of them half the GPU)")
    for p in (big, small):
        p.workload.do("stop")
        p.workload.close()


def dra_section(node: SimNode) -> None:
    """DRA mode on the second node: the scheduler sees each GPU, so a claim lands on one with
    room; the agent prepares it (the claim's CDI spec: GPU, shim, directory), and the shim
    holds its container to the claim's limit while the arbiter grants its burst."""
    import json

    from gpufrac.simgpu.kubelet.dra import ClaimPod, ClaimUse
    from gpufrac.simgpu.workload import WorkloadProcess

    banner(f"DRA mode ({DRA_NODE}, {DRA_PRESET}): the scheduler sees each GPU")
    until(lambda: node.dra_kubelet.registered(DRIVER), "the DRA driver's registration")

    def published() -> list[dict[str, Any]]:
        raw: Any = node.resource.list_resource_slice(_preload_content=False)  # the response, not a model
        slices = json.loads(raw.data)["items"]
        return [d for s in slices if s["spec"]["nodeName"] == DRA_NODE for d in s["spec"]["devices"]]

    until(lambda: bool(published()), "the ResourceSlice")
    for d in published():
        mem = d["capacity"]["memory"]
        step = format_bytes(int(mem["requestPolicy"]["validRange"]["step"]))
        say(f"  device {d['name']}: memory {format_bytes(int(mem['value']))}, shared in {step} steps")

    def claim(name: str, memory: str, **params: Any) -> None:
        devices: dict[str, Any] = {
            "requests": [
                {
                    "name": "gpu",
                    "exactly": {
                        "deviceClassName": f"gpu-memory.{DRIVER}",
                        "capacity": {"requests": {"memory": memory}},
                    },
                }
            ]
        }
        if params:
            parameters = {"apiVersion": "gpufrac.dev/v1alpha1", "kind": "GpuClaimParameters", **params}
            devices["config"] = [{"opaque": {"driver": DRIVER, "parameters": parameters}}]
        body = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name},
            "spec": {"devices": devices},
        }
        node.resource.create_namespaced_resource_claim("inference", body, _preload_content=False)  # type: ignore[arg-type]

    def run(name: str) -> ClaimPod:
        """The scheduler allocates the pod's claim on any node, the kubelet prepares it."""
        status = node.allocator.allocate("inference", name, node=None)
        (r,) = status["allocation"]["devices"]["results"]
        say(f"  claim {name}: {r['consumedCapacity']['memory']} of {r['pool']}/{r['device']}")
        pod = ClaimPod(
            "inference",
            name,
            f"00000000-0000-4000-8000-{len(name):012d}",
            [ClaimUse("gpu", name)],
            {"main": ["gpu"]},
        )
        node.allocator.reserve("inference", name, (pod.name, pod.uid))
        spec = {
            "nodeName": DRA_NODE,
            "resourceClaims": [{"name": "gpu", "resourceClaimName": name}],
            "containers": [{"name": "main", "image": "app", "resources": {"claims": [{"name": "gpu"}]}}],
        }
        manifest = {"metadata": {"name": name, "namespace": "inference", "uid": pod.uid}, "spec": spec}
        node.v1.create_namespaced_pod("inference", manifest)  # type: ignore[arg-type]  # a dict body
        node.dra_kubelet.run_pod(pod)
        return pod

    claim("batch-job", "32Gi")
    run("batch-job")
    claim("llm-server-dra", "8Gi", memoryLimit="24Gi", workloadClass="inference")
    pod = run("llm-server-dra")  # gpu-0 has 7Gi unconsumed: it goes where 8Gi fits
    env, mounts = node.dra_kubelet.container_edits(pod.uid, "main")
    say(f"  its CDI devices give the container LD_PRELOAD={env['LD_PRELOAD']} and {len(mounts)} mounts")
    base = dict(node.env, SIMGPU_STATE=str(node.dra_state))
    c = node.runtime.start(
        pod.uid, "main", WorkloadProcess.argv(), env=base, envs=env, mounts=mounts,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
    )  # fmt: skip
    cs = {"name": "main", "containerID": c.runtime_id, "image": "app", "imageID": "app", "ready": True}
    node.v1.patch_namespaced_pod(
        pod.name,
        "inference",
        {"status": {"phase": "Running", "containerStatuses": [{**cs, "restartCount": 0}]}},
    )
    app = WorkloadProcess(c.proc, pod.name)
    try:
        for what, cmd in (
            ("cuMemGetInfo (total = the claim's 24Gi limit)", "info"),
            ("allocates 6Gi, within its 8Gi request", f"alloc {gib(6)}"),
            ("bursts 10Gi past its request (the arbiter grants)", f"alloc {gib(10)}"),
            ("asks 8Gi more: past its 24Gi limit", f"alloc {gib(8)}"),
        ):
            answer = app.do(cmd, timeout=120)
            if answer.startswith("free "):
                _, free, _, total = answer.split()
                answer = f"free {format_bytes(int(free))}, total {format_bytes(int(total))}"
            say(f"  {pod.name:14} {what:50} -> {answer}")
        from gpufrac.agent.status.client import fetch

        (held,) = [
            c for c in fetch(str(node.root / "dra" / "status.sock"))["containers"] if c["claim"] == pod.name
        ]
        request, limit = format_bytes(held["request_bytes"]), format_bytes(held["limit_bytes"])
        granted = format_bytes(held["burst_granted_bytes"])
        who = f"{held['namespace']}/{held['claim']}"
        say(f"  the agent: claim {who} request {request}, limit {limit}, burst granted {granted}")
    finally:
        app.close(timeout=2)


def cmd_run(args: argparse.Namespace) -> int:
    # gRPC's C core logs connection churn (kubelet restarts, GOAWAY) to stderr by default.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    if real_node_present() and not args.sim:
        from gpufrac.agent.main import cmd_agent

        return cmd_agent(args)
    return run_demo(args)
