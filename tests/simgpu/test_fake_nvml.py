"""The real nvidia-ml-py against simgpu's fake libnvidia-ml.so.1.

Everything here goes through pynvml exactly as the agent does; the node-state
file is written the way the fake libcuda writes it (process slots, activity
counters) or through the fault-injection API.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pynvml
import pytest

from gpufrac.core import native
from gpufrac.simgpu import faults
from gpufrac.simgpu import nodestate as ns
from gpufrac.simgpu.spec import NVLINK_NVSWITCH, NodeSpec, create_node, load_preset

PRESETS = ["dgx-h100", "pcie-l4x4", "a100x2-nvlink"]
SEC = 1_000_000_000
Procs = list[subprocess.Popen[bytes]]


@dataclass
class Sim:
    spec: NodeSpec
    path: Path


@pytest.fixture
def sim(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Sim]:
    """pynvml in this process, initialised on a fresh node of the requested preset."""
    spec = load_preset(getattr(request, "param", "dgx-h100"))
    path = create_node(spec, tmp_path / "node.state")
    # glibc reads LD_LIBRARY_PATH only at start-up: load the fake by path; pynvml's
    # CDLL("libnvidia-ml.so.1") then resolves to it by soname.
    ctypes.CDLL(str(native.library(native.FAKE_NVML)), mode=ctypes.RTLD_GLOBAL)
    monkeypatch.setenv("SIMGPU_STATE", str(path))
    monkeypatch.delenv("NVIDIA_VISIBLE_DEVICES", raising=False)
    pynvml.nvmlInit()
    try:
        yield Sim(spec, path)
    finally:
        pynvml.nvmlShutdown()


per_preset = pytest.mark.parametrize("sim", PRESETS, indirect=True)


@pytest.fixture
def sleepers() -> Iterator[Procs]:
    """Real processes to stand for GPU workloads (their pids go into proc slots)."""
    procs: Procs = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=60)


def spawn(procs: Procs) -> int:
    p = subprocess.Popen(["sleep", "600"])
    procs.append(p)
    return p.pid


def start_time(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2 :].split()[19])


def claim(path: Path, pid: int, gpu: int, used: int, **counters: int) -> int:
    """Record a process on a GPU the way the fake libcuda does: a slot claimed for
    the pid, its memory added to the GPU's total. Returns the slot index."""
    with ns.NodeState(path) as st:
        i = next(i for i in range(ns.MAX_PROCS) if st.node.procs[i].pid == ns.PID_FREE)
        st.node.procs[i].gpu = gpu
        st.node.procs[i].start_time = start_time(pid)
        st.node.procs[i].used_bytes = used
        for k, v in counters.items():
            setattr(st.node.procs[i], k, v)
        st.node.gpus[gpu].used_bytes += used
        st.node.procs[i].pid = pid  # last: the slot is published complete
        return i


def handle(i: int) -> pynvml.c_nvmlDevice_t:
    return pynvml.nvmlDeviceGetHandleByIndex(i)


def raw(name: str) -> ctypes._CFuncPtr:
    """The C function itself, for calls pynvml always makes with big enough buffers."""
    return pynvml._nvmlGetFunctionPointer(name)


# ---------------------------------------------------------------- inventory


@per_preset
def test_identity_memory_pci_and_locality_match_spec(sim: Sim) -> None:
    spec = sim.spec
    assert pynvml.nvmlDeviceGetCount() == len(spec.gpus)
    assert pynvml.nvmlSystemGetDriverVersion() == spec.driver_version
    assert pynvml.nvmlSystemGetNVMLVersion() == spec.nvml_version
    assert pynvml.nvmlSystemGetCudaDriverVersion() == spec.cuda_driver_version
    assert pynvml.nvmlSystemGetCudaDriverVersion_v2() == spec.cuda_driver_version
    for i, want in enumerate(spec.gpus):
        h = handle(i)
        assert pynvml.nvmlDeviceGetIndex(h) == i
        assert pynvml.nvmlDeviceGetName(h) == want.model
        uuid = pynvml.nvmlDeviceGetUUID(h)
        assert uuid == spec.gpu_uuid(i)
        assert pynvml.nvmlDeviceGetMinorNumber(h) == i
        assert pynvml.nvmlDeviceGetCudaComputeCapability(h) == want.compute_capability
        # Handles found by UUID and by PCI bus id (either format) are the same GPU.
        assert pynvml.nvmlDeviceGetIndex(pynvml.nvmlDeviceGetHandleByUUID(uuid)) == i
        assert pynvml.nvmlDeviceGetIndex(pynvml.nvmlDeviceGetHandleByPciBusId(want.pci_bus_id)) == i
        assert (
            pynvml.nvmlDeviceGetIndex(pynvml.nvmlDeviceGetHandleByPciBusId(want.pci_bus_id[4:].lower())) == i
        )

        m1 = pynvml.nvmlDeviceGetMemoryInfo(h)
        assert (m1.total, m1.used, m1.free) == (want.memory, want.reserved, want.memory - want.reserved)
        m2 = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
        assert (m2.total, m2.reserved, m2.used, m2.free) == (
            want.memory,
            want.reserved,
            0,
            want.memory - want.reserved,
        )

        pci = pynvml.nvmlDeviceGetPciInfo(h)
        dom, bus, rest = want.pci_bus_id.split(":")
        assert pci.busId == want.pci_bus_id
        assert pci.busIdLegacy == f"{int(dom, 16):04X}:{bus}:{rest}"
        assert (pci.domain, pci.bus, pci.device) == (int(dom, 16), int(bus, 16), int(rest[:2], 16))
        assert (pci.pciDeviceId, pci.pciSubSystemId) == (want.pci_device_id, want.pci_subsystem_id)

        assert pynvml.nvmlDeviceGetNumaNodeId(h) == want.numa_node
        mask = pynvml.nvmlDeviceGetCpuAffinity(h, ns.CPU_WORDS)
        cpus = tuple(c for c in range(ns.CPU_WORDS * 64) if mask[c // 64] >> (c % 64) & 1)
        assert cpus == want.cpu_affinity
        scoped = pynvml.nvmlDeviceGetCpuAffinityWithinScope(
            h, ns.CPU_WORDS, pynvml.NVML_AFFINITY_SCOPE_SOCKET
        )
        assert list(scoped) == list(mask)
        nodes = pynvml.nvmlDeviceGetMemoryAffinity(h, 1, pynvml.NVML_AFFINITY_SCOPE_NODE)
        assert nodes[0] == 1 << want.numa_node


@per_preset
def test_topology_common_ancestor_and_p2p(sim: Sim) -> None:
    spec, n = sim.spec, len(sim.spec.gpus)
    for a in range(n):
        for b in range(n):
            assert pynvml.nvmlDeviceGetTopologyCommonAncestor(handle(a), handle(b)) == spec.topology[a][b]
            if a == b:
                continue
            nvl = pynvml.nvmlDeviceGetP2PStatus(handle(a), handle(b), pynvml.NVML_P2P_CAPS_INDEX_NVLINK)
            assert (nvl == pynvml.NVML_P2P_STATUS_OK) == (spec.nvlinks(a, b) > 0)
        near = pynvml.nvmlDeviceGetTopologyNearestGpus(handle(a), pynvml.NVML_TOPOLOGY_NODE)
        want = {b for b in range(n) if b != a and spec.topology[a][b] <= pynvml.NVML_TOPOLOGY_NODE}
        assert {pynvml.nvmlDeviceGetIndex(h) for h in near} == want


@per_preset
def test_nvlink_links_and_remote_ends(sim: Sim) -> None:
    spec = sim.spec
    bus_ids = [g.pci_bus_id for g in spec.gpus]
    for i, want in enumerate(spec.gpus):
        h = handle(i)
        if not want.nvlink_peers:
            with pytest.raises(pynvml.NVMLError_NotSupported):
                pynvml.nvmlDeviceGetNvLinkState(h, 0)
            continue
        peers = []
        for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
            if link >= len(want.nvlink_peers):
                with pytest.raises(pynvml.NVMLError_InvalidArgument):
                    pynvml.nvmlDeviceGetNvLinkState(h, link)
                continue
            assert pynvml.nvmlDeviceGetNvLinkState(h, link) == pynvml.NVML_FEATURE_ENABLED
            cap = pynvml.nvmlDeviceGetNvLinkCapability(h, link, pynvml.NVML_NVLINK_CAP_P2P_SUPPORTED)
            assert cap == 1
            kind = pynvml.nvmlDeviceGetNvLinkRemoteDeviceType(h, link)
            remote = pynvml.nvmlDeviceGetNvLinkRemotePciInfo(h, link).busId
            if kind == pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH:
                assert remote not in bus_ids
                peers.append(NVLINK_NVSWITCH)
            else:
                assert kind == pynvml.NVML_NVLINK_DEVICE_TYPE_GPU
                peers.append(bus_ids.index(remote))
        assert tuple(peers) == want.nvlink_peers


# ---------------------------------------------------------------- processes and utilisation


def test_running_processes_with_per_pid_memory(sim: Sim, sleepers: Procs) -> None:
    a, b = spawn(sleepers), spawn(sleepers)
    claim(sim.path, a, 0, 3 << 30)
    claim(sim.path, b, 0, 1 << 30)
    claim(sim.path, a, 1, 512 << 20)  # one process on two GPUs
    got = {p.pid: p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle(0))}
    assert got == {a: 3 << 30, b: 1 << 30}
    assert {p.pid: p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses_v2(handle(1))} == {
        a: 512 << 20
    }
    assert pynvml.nvmlDeviceGetComputeRunningProcesses(handle(2)) == []
    m2 = pynvml.nvmlDeviceGetMemoryInfo(handle(0), version=pynvml.nvmlMemory_v2)
    assert m2.used == 4 << 30 and m2.free == m2.total - m2.reserved - (4 << 30)

    # The unversioned C entry point fills the 16-byte v1 records.
    class V1(ctypes.Structure):
        _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong)]

    count, arr = ctypes.c_uint(4), (V1 * 4)()
    assert raw("nvmlDeviceGetComputeRunningProcesses")(handle(0), ctypes.byref(count), arr) == 0
    assert {arr[i].pid: arr[i].usedGpuMemory for i in range(count.value)} == {a: 3 << 30, b: 1 << 30}


def test_dead_process_is_reaped_and_its_memory_returned(sim: Sim, sleepers: Procs) -> None:
    live, dead = spawn(sleepers), spawn(sleepers)
    claim(sim.path, live, 3, 1 << 30)
    slot = claim(sim.path, dead, 3, 6 << 30)
    sleepers[-1].send_signal(signal.SIGKILL)
    sleepers[-1].wait(timeout=60)
    procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle(3))
    assert [p.pid for p in procs] == [live]
    assert pynvml.nvmlDeviceGetMemoryInfo(handle(3), version=pynvml.nvmlMemory_v2).used == 1 << 30
    with ns.NodeState(sim.path) as st:
        assert st.node.procs[slot].pid == ns.PID_FREE


def test_checkpointed_process_has_no_gpu_context(sim: Sim, sleepers: Procs) -> None:
    pid = spawn(sleepers)
    claim(sim.path, pid, 0, 0, swapped_bytes=2 << 30, ckpt_state=ns.CKPT_CHECKPOINTED)
    assert pynvml.nvmlDeviceGetComputeRunningProcesses(handle(0)) == []


def test_utilisation_derived_from_activity_and_pinned(sim: Sim, sleepers: Procs) -> None:
    busy, idle = spawn(sleepers), spawn(sleepers)
    now = time.time_ns()
    # Ten minutes of kernels queued on GPU 0: the compute model runs them from now on.
    claim(sim.path, busy, 0, 1 << 30, launches=5, last_launch_ns=now, work_end_ns=600 * SEC)
    # A process that last ran 5 s ago on GPU 1.
    claim(sim.path, idle, 1, 1 << 30, launches=1, last_launch_ns=now - 5 * SEC, busy_until_ns=now - 4 * SEC,
          busy_ns_total=SEC)  # fmt: skip
    for _ in range(2):  # first sample and a delta sample
        u0, u1 = (
            pynvml.nvmlDeviceGetUtilizationRates(handle(0)),
            pynvml.nvmlDeviceGetUtilizationRates(handle(1)),
        )
        assert (u0.gpu, u0.memory) == (100, 50)
        assert (u1.gpu, u1.memory) == (0, 0)
        assert pynvml.nvmlDeviceGetUtilizationRates(handle(2)).gpu == 0

    samples = {s.pid: s for s in pynvml.nvmlDeviceGetProcessUtilization(handle(0), 0)}
    assert set(samples) == {busy} and samples[busy].smUtil == 100
    samples = {s.pid: s for s in pynvml.nvmlDeviceGetProcessUtilization(handle(1), 0)}
    assert set(samples) == {idle} and samples[idle].smUtil == 0
    assert samples[idle].timeStamp == (now - 4 * SEC) // 1000
    # Only samples newer than lastSeenTimeStamp: the idle process has none since.
    with pytest.raises(pynvml.NVMLError_NotFound):
        pynvml.nvmlDeviceGetProcessUtilization(handle(1), (now - 2 * SEC) // 1000)
    info = pynvml.nvmlDeviceGetProcessesUtilizationInfo(handle(0), 0)
    assert [(s.pid, s.smUtil) for s in info] == [(busy, 100)]

    faults.set_utilisation(sim.path, 1, gpu=73, memory=12)
    u1 = pynvml.nvmlDeviceGetUtilizationRates(handle(1))
    assert (u1.gpu, u1.memory) == (73, 12)
    faults.set_utilisation(sim.path, 1)
    assert pynvml.nvmlDeviceGetUtilizationRates(handle(1)).gpu == 0


# ---------------------------------------------------------------- error codes


def test_bad_handles_indices_and_ids(sim: Sim) -> None:
    bogus = [pynvml.c_nvmlDevice_t(), ctypes.cast(ctypes.c_void_p(0x1234), pynvml.c_nvmlDevice_t)]
    for h in bogus:
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            pynvml.nvmlDeviceGetName(h)
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            pynvml.nvmlDeviceGetMemoryInfo(h)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceGetHandleByIndex(len(sim.spec.gpus))
    with pytest.raises(pynvml.NVMLError_NotFound):
        pynvml.nvmlDeviceGetHandleByUUID("GPU-00000000-0000-0000-0000-000000000000")
    with pytest.raises(pynvml.NVMLError_NotFound):
        pynvml.nvmlDeviceGetHandleByPciBusId("00000000:01:00.0")
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceGetHandleByPciBusId("not-a-bus-id")
    with pytest.raises(pynvml.NVMLError_ArgumentVersionMismatch):
        pynvml.nvmlDeviceGetMemoryInfo(handle(0), version=0x01000028)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceRegisterEvents(handle(0), 1 << 40, pynvml.nvmlEventSetCreate())


def test_too_small_buffers(sim: Sim, sleepers: Procs) -> None:
    h = handle(0)
    name, uuid = sim.spec.gpus[0].model, sim.spec.gpu_uuid(0)
    for fn, args, text in [
        ("nvmlDeviceGetName", (h,), name),
        ("nvmlDeviceGetUUID", (h,), uuid),
        ("nvmlSystemGetDriverVersion", (), sim.spec.driver_version),
        ("nvmlSystemGetNVMLVersion", (), sim.spec.nvml_version),
    ]:
        buf = ctypes.create_string_buffer(len(text) + 1)
        # Room for the text but not its terminating NUL is too small, exactly enough is fine.
        assert raw(fn)(*args, buf, ctypes.c_uint(len(text))) == pynvml.NVML_ERROR_INSUFFICIENT_SIZE
        assert raw(fn)(*args, buf, ctypes.c_uint(len(text) + 1)) == pynvml.NVML_SUCCESS
        assert buf.value.decode() == text

    pids = [spawn(sleepers) for _ in range(3)]
    for p in pids:
        claim(sim.path, p, 0, 1 << 20)
    count = ctypes.c_uint(0)
    fn = raw("nvmlDeviceGetComputeRunningProcesses_v3")
    assert fn(h, ctypes.byref(count), None) == pynvml.NVML_ERROR_INSUFFICIENT_SIZE
    assert count.value == 3
    count.value = 2
    arr = (pynvml.c_nvmlProcessInfo_v3_t * 3)()
    assert fn(h, ctypes.byref(count), arr) == pynvml.NVML_ERROR_INSUFFICIENT_SIZE
    assert count.value == 3
    assert fn(h, ctypes.byref(count), arr) == pynvml.NVML_SUCCESS
    assert sorted(arr[i].pid for i in range(3)) == sorted(pids)
    # No processes: success with zero entries, even without an array.
    count.value = 0
    assert fn(handle(1), ctypes.byref(count), None) == pynvml.NVML_SUCCESS and count.value == 0


# ---------------------------------------------------------------- events and faults


def test_xid_events_after_registration(sim: Sim) -> None:
    faults.inject_xid(sim.path, 2, xid=31)  # before registration: never delivered
    es = pynvml.nvmlEventSetCreate()
    try:
        assert pynvml.nvmlDeviceGetSupportedEventTypes(handle(2)) & pynvml.nvmlEventTypeXidCriticalError
        pynvml.nvmlDeviceRegisterEvents(handle(2), pynvml.nvmlEventTypeXidCriticalError, es)
        pynvml.nvmlDeviceRegisterEvents(handle(3), pynvml.nvmlEventTypeXidCriticalError, es)
        with pytest.raises(pynvml.NVMLError_Timeout):
            pynvml.nvmlEventSetWait_v2(es, 50)
        faults.inject_xid(sim.path, 5, xid=48)  # a GPU not registered in this set
        # Posted by another process, as the real driver would from the kernel.
        cmd = [
            sys.executable,
            "-m",
            "gpufrac.agent.cli.commands",
            "sim",
            "xid",
            "--state",
            str(sim.path),
            "--gpu",
            "2",
        ]
        subprocess.run([*cmd, "--xid", "79"], check=True, capture_output=True, timeout=120)
        faults.inject_xid(sim.path, 3, xid=94)
        got = []
        for _ in range(2):
            e = pynvml.nvmlEventSetWait_v2(es, 10_000)
            assert e.eventType == pynvml.nvmlEventTypeXidCriticalError
            got.append((pynvml.nvmlDeviceGetIndex(e.device), e.eventData))
        assert got == [(2, 79), (3, 94)]
        with pytest.raises(pynvml.NVMLError_Timeout):
            pynvml.nvmlEventSetWait(es, 50)
    finally:
        pynvml.nvmlEventSetFree(es)


def test_event_mask_filters(sim: Sim) -> None:
    es = pynvml.nvmlEventSetCreate()
    try:
        pynvml.nvmlDeviceRegisterEvents(handle(0), pynvml.nvmlEventTypeClock, es)
        faults.inject_xid(sim.path, 0, xid=79)
        with pytest.raises(pynvml.NVMLError_Timeout):
            pynvml.nvmlEventSetWait_v2(es, 50)
    finally:
        pynvml.nvmlEventSetFree(es)


def test_gpu_falls_off_the_bus_and_comes_back(sim: Sim) -> None:
    h = handle(4)
    es = pynvml.nvmlEventSetCreate()
    try:
        pynvml.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypeXidCriticalError, es)
        faults.fall_off_bus(sim.path, 4)
        for call in (pynvml.nvmlDeviceGetName, pynvml.nvmlDeviceGetMemoryInfo, pynvml.nvmlDeviceGetUUID):
            with pytest.raises(pynvml.NVMLError_GpuIsLost):
                call(h)
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            pynvml.nvmlDeviceGetHandleByIndex(4)
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            pynvml.nvmlDeviceGetHandleByUUID(sim.spec.gpu_uuid(4))
        assert pynvml.nvmlDeviceGetCount() == len(sim.spec.gpus)
        assert pynvml.nvmlDeviceGetName(handle(5)) == sim.spec.gpus[5].model  # the others carry on
        e = pynvml.nvmlEventSetWait_v2(es, 10_000)
        assert e.eventData == faults.XID_FELL_OFF_BUS
        with pytest.raises(pynvml.NVMLError_GpuIsLost):  # said once per loss ...
            pynvml.nvmlEventSetWait_v2(es, 10_000)
        with pytest.raises(pynvml.NVMLError_Timeout):  # ... not in a busy loop
            pynvml.nvmlEventSetWait_v2(es, 50)
        faults.restore_gpu(sim.path, 4)
        assert pynvml.nvmlDeviceGetName(h) == sim.spec.gpus[4].model
        assert pynvml.nvmlDeviceGetIndex(pynvml.nvmlDeviceGetHandleByIndex(4)) == 4
    finally:
        pynvml.nvmlEventSetFree(es)


def reinit_visible(monkeypatch: pytest.MonkeyPatch, value: str | None) -> None:
    """Re-initialise NVML with NVIDIA_VISIBLE_DEVICES set to `value` (None: unset)."""
    if value is None:
        monkeypatch.delenv("NVIDIA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("NVIDIA_VISIBLE_DEVICES", value)
    pynvml.nvmlShutdown()
    pynvml.nvmlInit()


def test_nvidia_visible_devices(sim: Sim, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = sim.spec
    reinit_visible(monkeypatch, f"2,{spec.gpu_uuid(5)}")
    assert pynvml.nvmlDeviceGetCount() == 2
    assert [pynvml.nvmlDeviceGetUUID(handle(i)) for i in range(2)] == [spec.gpu_uuid(2), spec.gpu_uuid(5)]
    assert pynvml.nvmlDeviceGetMinorNumber(handle(1)) == 5  # /dev/nvidia5 stays itself
    with pytest.raises(pynvml.NVMLError_NotFound):
        pynvml.nvmlDeviceGetHandleByUUID(spec.gpu_uuid(0))
    with pytest.raises(pynvml.NVMLError_NotFound):
        pynvml.nvmlDeviceGetHandleByPciBusId(spec.gpus[0].pci_bus_id)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceGetHandleByIndex(2)
    reinit_visible(monkeypatch, "none")
    assert pynvml.nvmlDeviceGetCount() == 0
    reinit_visible(monkeypatch, "all")
    assert pynvml.nvmlDeviceGetCount() == len(spec.gpus)


def test_nvidia_visible_devices_set_but_empty_shows_no_gpu(sim: Sim, monkeypatch: pytest.MonkeyPatch) -> None:
    """Set but empty exposes no GPU, as the container runtime treats it; only
    unset (the host's view, the agent's) means every GPU."""
    reinit_visible(monkeypatch, "")
    assert pynvml.nvmlDeviceGetCount() == 0
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_NotFound):
        pynvml.nvmlDeviceGetHandleByUUID(sim.spec.gpu_uuid(0))
    reinit_visible(monkeypatch, None)
    assert pynvml.nvmlDeviceGetCount() == len(sim.spec.gpus)


# ---------------------------------------------------------------- init / shutdown, other processes

LIFECYCLE = """
import os, pynvml
pynvml.nvmlInit()
pynvml.nvmlInit()
pynvml.nvmlShutdown()
print("count", pynvml.nvmlDeviceGetCount())  # still initialised: init is reference-counted
pynvml.nvmlShutdown()
for call in (pynvml.nvmlDeviceGetCount, pynvml.nvmlShutdown):
    try:
        call()
    except pynvml.NVMLError_Uninitialized:
        print("uninitialized")
del os.environ["SIMGPU_STATE"]
try:
    pynvml.nvmlInit()
except pynvml.NVMLError_DriverNotLoaded:
    print("driver not loaded")
"""


def test_init_is_reference_counted_and_needs_a_node(sim: Sim) -> None:
    env = dict(os.environ, SIMGPU_STATE=str(sim.path), LD_LIBRARY_PATH=str(native.native_dir()))
    out = subprocess.run(
        [sys.executable, "-c", LIFECYCLE], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:4] == ["count 8", "uninitialized", "uninitialized", "driver not loaded"]


EXERCISE = """
import pynvml
pynvml.nvmlInit()
n = pynvml.nvmlDeviceGetCount()
for i in range(n):
    h = pynvml.nvmlDeviceGetHandleByIndex(i)
    pynvml.nvmlDeviceGetName(h); pynvml.nvmlDeviceGetUUID(h); pynvml.nvmlDeviceGetPciInfo(h)
    pynvml.nvmlDeviceGetMemoryInfo(h); pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
    pynvml.nvmlDeviceGetCpuAffinity(h, 4); pynvml.nvmlDeviceGetNumaNodeId(h)
    pynvml.nvmlDeviceGetComputeRunningProcesses(h); pynvml.nvmlDeviceGetUtilizationRates(h)
    for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
        try:
            pynvml.nvmlDeviceGetNvLinkState(h, link); pynvml.nvmlDeviceGetNvLinkRemotePciInfo(h, link)
        except pynvml.NVMLError:
            pass
    for j in range(n):
        pynvml.nvmlDeviceGetTopologyCommonAncestor(h, pynvml.nvmlDeviceGetHandleByIndex(j))
    try:
        pynvml.nvmlDeviceGetProcessUtilization(h, 0)
    except pynvml.NVMLError_NotFound:
        pass
es = pynvml.nvmlEventSetCreate()
h = pynvml.nvmlDeviceGetHandleByIndex(0)
pynvml.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypeXidCriticalError, es)
try:
    pynvml.nvmlEventSetWait_v2(es, 10)
except pynvml.NVMLError_Timeout:
    pass
pynvml.nvmlEventSetFree(es)
pynvml.nvmlShutdown()
maps = open("/proc/self/maps").read()
assert "libasan" in maps and "/asan/libnvidia-ml.so.1" in maps, "not the ASan build under ASan"
print("ok", n)
"""


@pytest.fixture(scope="module")
def asan_nvml() -> Path:
    path = native.native_dir("asan") / native.FAKE_NVML
    if not path.exists():
        subprocess.run(
            ["make", "-s", "-C", str(native.REPO_ROOT), f"build/asan/{native.FAKE_NVML}"], check=True
        )
    return path


@pytest.mark.parametrize("preset", PRESETS)
def test_asan_build_is_clean(preset: str, tmp_path: Path, asan_nvml: Path, sleepers: Procs) -> None:
    path = create_node(load_preset(preset), tmp_path / "node.state")
    pid = spawn(sleepers)
    claim(path, pid, 0, 1 << 30, launches=1, last_launch_ns=time.time_ns(), busy_ns_total=1000)
    env = dict(
        os.environ,
        SIMGPU_STATE=str(path),
        LD_LIBRARY_PATH=str(asan_nvml.parent),
        LD_PRELOAD=" ".join(native.asan_runtime()),
        ASAN_OPTIONS="detect_leaks=0:abort_on_error=0:halt_on_error=1",
        UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1",
    )
    out = subprocess.run(
        [sys.executable, "-c", EXERCISE], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.startswith(f"ok {len(load_preset(preset).gpus)}")
    assert "AddressSanitizer" not in out.stderr and "runtime error" not in out.stderr, out.stderr[-4000:]
