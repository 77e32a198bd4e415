"""DRA driver benchmark on a simulated dgx-h100: how long the kubelet waits for a claim's prepare.

Writes bench/results/dra.json (quick mode: tiny counts, a smoke run; see bench/__init__.py):
  prepare_p50_ms / prepare_p99_ms     NodePrepareResources of one claim, as the kubelet's DRA side
                                      (gpufrac.simgpu.kubelet.dra) waits for it over the unix socket:
                                      the agent reads the claim from the apiserver emulator, books its
                                      consumedCapacity, applies its parameters, writes its directory
                                      (the booking's record in it) and CDI spec and runs admission's
                                      reclaim before it answers; CLAIMS claims
                                      of 1 to 4 GiB, each allocated by the scheduler stand-in against
                                      the published slice, one prepare after another (the first
                                      WARMUP left out: imports, first connections)
  agent_handler_p50_ms / _p99_ms      the same calls, time inside the agent's handler (its own summary,
                                      logged when it stops; warm-up included): the rest is gRPC and the
                                      Python kubelet stand-in
  claim_read_p50_ms / _p99_ms         of that, reading the claim from the apiserver (kmock's emulator, a
                                      Python HTTP server on this box; a real apiserver serves it from
                                      its cache)
  agent_own_p50_ms / _p99_ms          of that, the rest: booking, parameters, directory and record,
                                      CDI spec, admission's reclaim (an NVML reading)
  unprepare_p50_ms / unprepare_p99_ms NodeUnprepareResources of each claim (release, state written)
  floor_p50_ms / floor_p99_ms         the same prepares against a driver that does nothing (bench/
                                      _floor_dra.py: gpufrac's DRA front end over a Backend that answers
                                      at once), through the same kubelet stand-in: gRPC, the front end,
                                      the Python stand-in and the box, without the agent; the difference
                                      to prepare_* is the agent's
  agent_cpu_per_prepare_ms            the agent process's CPU time (user + system, all its threads)
                                      from the first prepare to the last, over the number of claims:
                                      what a prepare costs the agent, whatever else the box runs
                                      (its background work in that time, the grant sweep and health
                                      polls, included)
  cdi_on_tmpfs                        whether the CDI directory was on a memory filesystem (/dev/shm),
                                      as a node's /var/run/cdi is; the state file is on the disk
  load_average                        the box's 1-minute load average when the run ended (several
                                      agents and test suites may share it: read the figures with it)
Target: prepare p99 < 10 ms on this machine.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from kubernetes import client

from bench import quick
from bench._floor_dra import FLOOR_DRIVER
from gpufrac.simgpu.apiserver import KubeServer
from gpufrac.simgpu.dra_scheduler import Allocator
from gpufrac.simgpu.kubelet import AgentProcess
from gpufrac.simgpu.kubelet.dra import ClaimPod, ClaimUse, DraKubelet
from gpufrac.simgpu.spec import create_node, load_preset

NODE = "bench-node"
DRIVER = "gpufrac.dev"
CLAIMS = 200
WARMUP = 10
TARGET_P99_MS = 10.0
if quick():
    CLAIMS, WARMUP = 4, 1
_SUMMARY = re.compile(
    r"prepare_calls=(\d+) prepare_handler_p50_ms=([0-9.]+) prepare_handler_p99_ms=([0-9.]+)"
)
_CLAIMS = re.compile(
    r"claim_read_p50_ms=([0-9.]+) claim_read_p99_ms=([0-9.]+) "
    r"claim_own_p50_ms=([0-9.]+) claim_own_p99_ms=([0-9.]+)"
)


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def _cpu_seconds(pid: int) -> float:
    """A process's user + system CPU time so far (/proc/<pid>/stat, fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _claim(name: str, gib: int) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": "gpu",
                        "exactly": {
                            "deviceClassName": f"gpu-memory.{DRIVER}",
                            "capacity": {"requests": {"memory": f"{gib}Gi"}},
                        },
                    }
                ],
                "config": [
                    {
                        "opaque": {
                            "driver": DRIVER,
                            "parameters": {
                                "apiVersion": "gpufrac.dev/v1alpha1",
                                "kind": "GpuClaimParameters",
                                "memoryLimit": f"{2 * gib}Gi",
                            },
                        }
                    }
                ],
            }
        },
    }


def _floor(root: Path, kubelet: DraKubelet, resource: client.ResourceV1Api) -> list[float]:
    """The same prepares against bench/_floor_dra.py: its claims allocated to the floor driver
    (written as the scheduler would), each prepared by the stand-in as a pod starts."""
    log = open(root / "floor.log", "wb")  # noqa: SIM115 - the child keeps it
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench._floor_dra", str(root / "kubelet")],
        cwd=Path(__file__).resolve().parent.parent,
        stdout=log,
        stderr=log,
    )
    log.close()
    try:
        deadline = time.monotonic() + 60
        while not kubelet.registered(FLOOR_DRIVER):
            if time.monotonic() > deadline:
                raise RuntimeError(
                    "the floor driver did not register: " + (root / "floor.log").read_text()[-2000:]
                )
            time.sleep(0.05)
        before = len(kubelet.call_times("NodePrepareResources"))
        for i in range(CLAIMS):
            name = f"floor-{i}"
            resource.create_namespaced_resource_claim("bench", _claim(name, 1), _preload_content=False)
            pod = ClaimPod(
                "bench", f"floor-{i}", str(uuid.uuid4()), [ClaimUse("gpu", name)], {"main": ["gpu"]}
            )
            result = {"request": "gpu", "driver": FLOOR_DRIVER, "pool": "floor", "device": "d0"}
            status = {
                "allocation": {"devices": {"results": [result]}},
                "reservedFor": [{"resource": "pods", "name": pod.name, "uid": pod.uid}],
            }
            resource.patch_namespaced_resource_claim_status(
                name,
                "bench",
                {"status": status},
                _content_type="application/merge-patch+json",
                _preload_content=False,
            )
            kubelet.run_pod(pod)
        return [t * 1000 for t in kubelet.call_times("NodePrepareResources")[before:]][WARMUP:]
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="gfbd", dir="/tmp"))  # unix socket paths stay short
    # The CDI directory on a memory filesystem where there is one, as /var/run/cdi is on a node
    # (the state file stays on the disk, as /var/lib/gpufrac does).
    cdi = Path(tempfile.mkdtemp(prefix="gfbd-cdi", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    kube = KubeServer()
    kubelet: DraKubelet | None = None
    agent: AgentProcess | None = None
    try:
        api = kube.api_client()
        resource = client.ResourceV1Api(api)
        device_class = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "DeviceClass",
            "metadata": {"name": f"gpu-memory.{DRIVER}"},
            "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{DRIVER}"'}}]},
        }
        resource.create_device_class(device_class, _preload_content=False)  # type: ignore[arg-type]
        state = root / "node.state"
        create_node(load_preset("dgx-h100", node_name=NODE), state)
        kubelet = DraKubelet(root / "kubelet", api, NODE, cdi_dir=cdi).start()
        agent = AgentProcess(
            root / "agent",
            state,
            root / "kubelet",
            {
                "mode": "dra",
                "nodeName": NODE,
                "apiServer": kube.url,
                "metrics": {"port": 1},
                "dra": {"cdiSpecDir": str(cdi)},
                # The default (AgentProcess's 50 ms poll for tests put back): the agent as it runs.
                "health": {"pollInterval": "1s"},
            },
        ).start()
        deadline = time.monotonic() + 120
        while not kubelet.registered(DRIVER) or not resource.list_resource_slice(_preload_content=False).data:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the DRA driver did not register:\n{agent.log()[-3000:]}")
            time.sleep(0.05)
        while b'"devices"' not in resource.list_resource_slice(_preload_content=False).data:
            time.sleep(0.05)
        allocator = Allocator(api)
        pods = []
        cpu_start = _cpu_seconds(agent.pid)
        for i in range(CLAIMS):
            name = f"claim-{i}"
            resource.create_namespaced_resource_claim(
                "bench", _claim(name, 1 + i % 4), _preload_content=False
            )
            pod = ClaimPod("bench", f"pod-{i}", str(uuid.uuid4()), [ClaimUse("gpu", name)], {"main": ["gpu"]})
            allocator.allocate("bench", name, node=NODE, pod=(pod.name, pod.uid))
            kubelet.run_pod(pod)  # one NodePrepareResources of one claim, timed by the kubelet
            pods.append(pod)
        cpu = _cpu_seconds(agent.pid) - cpu_start
        prepare = [t * 1000 for t in kubelet.call_times("NodePrepareResources")][WARMUP:]
        for pod in pods:
            kubelet.delete_pod(pod.uid)
        unprepare = [t * 1000 for t in kubelet.call_times("NodeUnprepareResources")][WARMUP:]
        booked = json.loads((root / "agent" / "state" / "state.json").read_text())["allocations"]
        floor = _floor(root, kubelet, resource)
    finally:
        if agent is not None:
            agent.stop()
        if kubelet is not None:
            kubelet.stop()
        kube.close()
    log = agent.log() if agent is not None else ""
    shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(cdi, ignore_errors=True)
    m, c = _SUMMARY.search(log), _CLAIMS.search(log)
    result: dict[str, Any] = {
        "claims": CLAIMS,
        "warmup": WARMUP,
        "prepare_p50_ms": round(statistics.median(prepare), 3),
        "prepare_p99_ms": round(_pct(prepare, 0.99), 3),
        "prepare_max_ms": round(max(prepare), 3),
        "agent_handler_p50_ms": float(m.group(2)) if m else None,
        "agent_handler_p99_ms": float(m.group(3)) if m else None,
        "claim_read_p50_ms": float(c.group(1)) if c else None,
        "claim_read_p99_ms": float(c.group(2)) if c else None,
        "agent_own_p50_ms": float(c.group(3)) if c else None,
        "agent_own_p99_ms": float(c.group(4)) if c else None,
        "floor_p50_ms": round(statistics.median(floor), 3),
        "floor_p99_ms": round(_pct(floor, 0.99), 3),
        "unprepare_p50_ms": round(statistics.median(unprepare), 3),
        "unprepare_p99_ms": round(_pct(unprepare, 0.99), 3),
        "booked_after_unprepare": len(booked),
        "agent_cpu_per_prepare_ms": round(cpu * 1000 / CLAIMS, 3),
        "cdi_on_tmpfs": str(cdi).startswith("/dev/shm"),
        "load_average": round(os.getloadavg()[0], 2),
        "target_prepare_p99_ms": TARGET_P99_MS,
        "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} CPUs",
        "quick": quick(),
    }
    result["prepare_p99_within_target"] = result["prepare_p99_ms"] < TARGET_P99_MS
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
