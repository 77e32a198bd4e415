"""The device plugins through the kubelet emulator, over real gRPC unix sockets."""

from __future__ import annotations

import os
import stat
from collections import Counter
from collections.abc import Callable

import grpc
import pytest

from gpufrac.core.slices import FRACTION, MEMORY, SOCKETS, device_id
from gpufrac.memguard import abi
from gpufrac.proto import deviceplugin_pb2 as pb
from gpufrac.proto import deviceplugin_pb2_grpc as pb_grpc
from gpufrac.simgpu import faults
from gpufrac.simgpu.kubelet import AdmissionError, Container, Pod
from tests.fixtures.agentsim import Sim

MiB, GiB = 1 << 20, 1 << 30
ALLOCATABLE = 81559 * MiB - GiB  # dgx-h100 H100 80GB minus the default 1Gi reserve
MEMORY_SLICES = ALLOCATABLE // GiB  # 78


def stub(sim: Sim, resource: str) -> tuple[grpc.Channel, pb_grpc.DevicePluginStub]:
    ch = grpc.insecure_channel(f"unix://{sim.kubelet.device_plugin_dir / SOCKETS[resource]}")
    return ch, pb_grpc.DevicePluginStub(ch)


def allocate_error(sim: Sim, resource: str, ids: list[str]) -> grpc.RpcError:
    ch, s = stub(sim, resource)
    with ch, pytest.raises(grpc.RpcError) as exc:
        s.Allocate(
            pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)]), timeout=30
        )
    return exc.value


def test_registers_both_resources_with_numa_topology(sim: Sim) -> None:
    k = sim.kubelet
    assert k.allocatable(FRACTION) == 8 * 100
    assert k.allocatable(MEMORY) == 8 * MEMORY_SLICES
    ch, s = stub(sim, FRACTION)
    with ch:
        opts = s.GetDevicePluginOptions(pb.Empty(), timeout=10)
        first = next(s.ListAndWatch(pb.Empty(), timeout=10))
    assert opts.pre_start_required and opts.get_preferred_allocation_available
    numa = {d.ID.split("::")[0]: [n.ID for n in d.topology.nodes] for d in first.devices}
    # dgx-h100: GPUs 0-3 on NUMA node 0, 4-7 on node 1
    assert [numa[u] for u in sim.gpus] == [[0]] * 4 + [[1]] * 4


@pytest.mark.parametrize("policy", ["binpack", "spread"])
def test_many_pods_of_both_resources_packed_by_policy(make_sim: Callable[..., Sim], policy: str) -> None:
    sim = make_sim(config={"allocationPolicy": policy})
    frac = [sim.admit(f"frac-{i}", FRACTION, 25) for i in range(8)]
    mem = [sim.admit(f"mem-{i}", MEMORY, 39) for i in range(4)]
    per_gpu_f = Counter(g for p in frac for g in sim.gpus_of(p))
    per_gpu_m = Counter(g for p in mem for g in sim.gpus_of(p))
    assert all(len(sim.gpus_of(p)) == 1 for p in frac + mem)  # a share never spans GPUs
    if policy == "binpack":
        assert sorted(per_gpu_f.values()) == [4, 4]  # two GPUs filled, six untouched
        assert sorted(per_gpu_m.values()) == [2, 2] and not set(per_gpu_m) & set(per_gpu_f)
    else:
        assert sorted(per_gpu_f.values()) == [1] * 8  # one per GPU
        assert sorted(per_gpu_m.values()) == [1] * 4
    # Either way the kubelet sees what is left: 8 x 25 % and 4 x 39 GiB are booked.
    k = sim.kubelet
    # binpack: two GPUs full of fractions (no memory left there), 4 x 39 on two others -> 8*78 - 2*78 - 156.
    # spread: 25 % on each GPU leaves 58 memory slices that fit per GPU -> 8*58 - 156.
    expected = 312 if policy == "binpack" else 308
    k.wait_for(lambda: k.available(MEMORY) == expected)


def test_capacity_sync_between_the_two_resources(sim: Sim) -> None:
    k = sim.kubelet
    mem = sim.admit("mem", MEMORY, 39)
    (g,) = sim.gpus_of(mem)
    # 39 GiB taken: the fraction slices still backed by memory are 50 (plus none allocated)
    free = ALLOCATABLE - 39 * GiB
    k.wait_for(lambda: sim.healthy_on(FRACTION, g) == free * 100 // ALLOCATABLE)
    assert sim.healthy_on(FRACTION, g) == 50
    assert sim.healthy_on(MEMORY, g) == MEMORY_SLICES  # 39 allocated + 39 that still fit
    frac = sim.admit("frac", FRACTION, 50)
    assert sim.gpus_of(frac) == {g}  # binpack: the GPU it fills exactly
    # now memory on that GPU: only its own 39 allocated slices stay Healthy
    k.wait_for(lambda: sim.healthy_on(MEMORY, g) == 39)
    assert sim.healthy_on(FRACTION, g) == 50
    assert k.allocatable(MEMORY) == 7 * MEMORY_SLICES + 39
    with pytest.raises(AdmissionError):  # nothing left on any GPU for a 79th... whole GPU of memory
        sim.admit("too-big", MEMORY, MEMORY_SLICES + 1)


def test_allocate_response_injects_gpu_and_shim(sim: Sim) -> None:
    pod = sim.admit("inj", MEMORY, 4)
    resp = sim.kubelet.allocate_response(pod.uid, "main", MEMORY)
    (g,) = sim.gpus_of(pod)
    assert resp.envs["NVIDIA_VISIBLE_DEVICES"] == sim.gpus[g]
    assert resp.envs["LD_PRELOAD"].endswith("libmemguard.so")
    cdir = resp.envs["GPUFRAC_CONTAINER_DIR"]
    mounts = {m.container_path: m for m in resp.mounts}
    assert mounts[resp.envs["LD_PRELOAD"]].read_only
    assert mounts[f"{cdir}/config"].read_only and not mounts[f"{cdir}/usage"].read_only
    # the shim's launch clock (compute shares) is the container's to write, like its usage
    assert not mounts[f"{cdir}/compute"].read_only and os.path.isfile(mounts[f"{cdir}/compute"].host_path)
    # the arbiter's socket comes in a read-only mount of its directory (a restarted agent's
    # new socket shows through it; no tenant can replace it)
    assert mounts[f"{cdir}/arbiter"].read_only
    assert stat.S_ISSOCK(os.stat(os.path.join(mounts[f"{cdir}/arbiter"].host_path, "arbiter.sock")).st_mode)
    host_dir = mounts[f"{cdir}/config"].host_path.rsplit("/", 1)[0]
    cfg = abi.read_config(host_dir)
    assert cfg.gpu_uuid == sim.gpus[g] and cfg.request_bytes == cfg.limit_bytes == 4 * GiB
    # the emulator's view of the container maps those paths to the host files
    env = sim.kubelet.container_env(pod.uid, "main")
    assert abi.read_config(env["GPUFRAC_CONTAINER_DIR"]).request_bytes == 4 * GiB


def test_whole_gpus_land_nvlinked_in_one_numa_node(sim: Sim) -> None:
    sim.admit("small", FRACTION, 10)  # GPU 0 is partly used now
    pod = sim.admit("whole", FRACTION, 300)
    gpus = sim.gpus_of(pod)
    assert len(gpus) == 3 and 0 not in gpus and gpus <= {1, 2, 3}  # NUMA node 0, fully free
    resp = sim.kubelet.allocate_response(pod.uid, "main", FRACTION)
    assert resp.envs["NVIDIA_VISIBLE_DEVICES"] == ",".join(sim.gpus[g] for g in sorted(gpus))
    host_dir = next(m.host_path for m in resp.mounts if m.container_path.endswith("/config")).rsplit("/", 1)[
        0
    ]
    assert abi.read_config(host_dir).flags & abi.FLAG_WHOLE_GPU


def test_cdi_strategy_returns_cdi_devices(make_sim: Callable[..., Sim]) -> None:
    sim = make_sim(config={"deviceListStrategy": "cdi"})
    pod = sim.admit("cdi", FRACTION, 20)
    resp = sim.kubelet.allocate_response(pod.uid, "main", FRACTION)
    (g,) = sim.gpus_of(pod)
    assert [d.name for d in resp.cdi_devices] == [f"nvidia.com/gpu={sim.gpus[g]}"]
    assert "NVIDIA_VISIBLE_DEVICES" not in resp.envs


def test_every_refusal_is_explained(sim: Sim) -> None:
    u0, u1 = sim.gpus[0], sim.gpus[1]
    f = lambda u, r: [device_id(u, FRACTION, n) for n in r]  # noqa: E731
    cases = [
        (
            FRACTION,
            f(u0, range(5)) + f(u1, range(5)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "must come from one GPU",
        ),
        (FRACTION, f(u0, range(100)) + f(u1, range(50)), grpc.StatusCode.INVALID_ARGUMENT, "neither <= 100"),
        (
            FRACTION,
            f(u0, range(100)) + f(u1, range(99)) + [device_id(sim.gpus[2], FRACTION, 0)],
            grpc.StatusCode.INVALID_ARGUMENT,
            "must take all 100 slices",
        ),
        (
            MEMORY,
            [device_id(u0, MEMORY, 0), device_id(u1, MEMORY, 0)],
            grpc.StatusCode.INVALID_ARGUMENT,
            "must come from one GPU",
        ),
        (
            FRACTION,
            ["GPU-bogus::f01", device_id(u0, MEMORY, 1)],
            grpc.StatusCode.INVALID_ARGUMENT,
            "unknown device IDs",
        ),
    ]
    for resource, ids, code, words in cases:
        err = allocate_error(sim, resource, ids)
        assert err.code() == code and words in err.details(), (words, err.details())
    # already allocated to a live container
    pod = sim.admit("owner", FRACTION, 10)
    (g,) = sim.gpus_of(pod)
    err = allocate_error(sim, FRACTION, [device_id(sim.gpus[g], FRACTION, 0)])
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "already allocated to pod default/owner" in err.details()
    # PreStartContainer for devices nobody allocated
    ch, s = stub(sim, MEMORY)
    with ch, pytest.raises(grpc.RpcError) as exc:
        s.PreStartContainer(pb.PreStartContainerRequest(devices_ids=[device_id(u1, MEMORY, 3)]), timeout=30)
    assert (
        exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "never allocated" in exc.value.details()
    )
    # through admission it reads like the kubelet's own error
    with pytest.raises(AdmissionError) as adm:
        sim.kubelet.admit(Pod("default", "odd", [Container("main", {FRACTION: 150})]))
    assert adm.value.reason == "UnexpectedAdmissionError"
    assert adm.value.message.startswith("Allocate failed due to rpc error: code = InvalidArgument desc = ")
    assert "150 is neither <= 100" in adm.value.message and adm.value.message.endswith(
        ", which is unexpected"
    )


def test_xid_makes_gpu_unhealthy_then_recovers(make_sim: Callable[..., Sim]) -> None:
    sim = make_sim(config={"health": {"pollInterval": "50ms", "xidRecovery": "3s"}})
    k = sim.kubelet
    pod = sim.admit("victim", MEMORY, 4)
    (g,) = sim.gpus_of(pod)
    faults.inject_xid(sim.node_state, g, 79)
    k.wait_for(lambda: sim.healthy_on(MEMORY, g) == 0 and sim.healthy_on(FRACTION, g) == 0, 30)
    assert all(sim.healthy_on(FRACTION, o) == 100 for o in range(8) if o != g)
    err = allocate_error(sim, MEMORY, [device_id(sim.gpus[g], MEMORY, 50)])
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "Unhealthy (XID 79" in err.details()
    # no new XID for xidRecovery: Healthy again without restarting anything
    k.wait_for(lambda: sim.healthy_on(MEMORY, g) == MEMORY_SLICES, 60)
    assert (
        sim.healthy_on(FRACTION, g) == 100 - 4 * 100 * GiB // ALLOCATABLE - 1
        or sim.healthy_on(FRACTION, g) > 90
    )
