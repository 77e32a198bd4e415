"""kill -9 of the agent mid-admission, restart, and a corrupt state file."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable

from gpufrac.core.slices import FRACTION, MEMORY, container_key
from gpufrac.memguard import abi
from gpufrac.simgpu.kubelet import AdmissionError, Pod
from tests.fixtures.agentsim import Sim


def kubelet_keys(sim: Sim) -> set[str]:
    """Container keys of every allocation the kubelet holds."""
    keys = set()
    for pod in sim.kubelet.pods():
        for per in sim.kubelet.pod_devices(pod.uid).values():
            keys |= {container_key(r, ids) for r, ids in per.items()}
    return keys


def agent_agrees(sim: Sim) -> bool:
    try:
        state = sim.agent.state()
    except (OSError, ValueError):
        return False
    want = kubelet_keys(sim)
    return {a["key"] for a in state["allocations"]} == want and sim.agent.container_dirs() == want


def assert_no_double_booking(sim: Sim) -> None:
    owners = Counter(d for a in sim.agent.state()["allocations"] for d in a["device_ids"])
    assert not [d for d, n in owners.items() if n > 1]


class Admissions(threading.Thread):
    """A steady stream of pod admissions, as a busy node sees them."""

    def __init__(self, sim: Sim) -> None:
        super().__init__(daemon=True)
        self.sim = sim
        self.admitted: list[Pod] = []
        self.failed = 0
        self.halt = threading.Event()

    def run(self) -> None:
        i = 0
        while not self.halt.is_set():
            i += 1
            resource, count = (FRACTION, 1 + i % 7) if i % 2 else (MEMORY, 1 + i % 3)
            try:
                self.admitted.append(self.sim.admit(f"p{i}", resource, count))
            except AdmissionError:
                self.failed += 1  # the agent is down: the kubelet rejects the pod
            if len(self.admitted) > 120:
                self.halt.set()


def test_kill_9_mid_admission_then_restart(sim: Sim) -> None:
    k = sim.kubelet
    stream = Admissions(sim)
    stream.start()
    k.wait_for(lambda: len(stream.admitted) >= 15, 120)
    sim.agent.kill()  # at whatever point of an admission it happens to be
    k.wait_for(lambda: stream.failed > 0, 60)  # admissions fail while it is down
    stream.halt.set()
    stream.join(60)
    gone_keys = set()
    for pod in stream.admitted[:5]:
        per_container = k.pod_devices(pod.uid).values()
        gone_keys |= {container_key(r, ids) for per in per_container for r, ids in per.items()}
        k.delete(pod)  # deleted while the agent was dead: their directories must go
    sim.restart_agent()
    k.wait_for(lambda: agent_agrees(sim), 60)
    assert len(gone_keys) == 5 and not gone_keys & sim.agent.container_dirs()
    assert_no_double_booking(sim)
    # and the node admits again, still without double booking
    more = Admissions(sim)
    more.start()
    k.wait_for(lambda: len(more.admitted) >= 10, 120)
    more.halt.set()
    more.join(60)
    k.wait_for(lambda: agent_agrees(sim), 60)
    assert_no_double_booking(sim)
    for a in sim.agent.state()["allocations"]:
        cfg = abi.read_config(sim.agent.state_dir / "containers" / a["key"])
        assert cfg.limit_bytes >= cfg.request_bytes > 0


def test_corrupt_state_is_reported_and_rebuilt(make_sim: Callable[..., Sim]) -> None:
    sim = make_sim()
    k = sim.kubelet
    for i in range(4):
        sim.admit(f"f{i}", FRACTION, 20)
        sim.admit(f"m{i}", MEMORY, 5)
    k.wait_for(lambda: agent_agrees(sim))
    before = {r: k.available(r) for r in (FRACTION, MEMORY)}
    sim.agent.stop()
    state_file = sim.agent.state_dir / "state.json"
    state_file.write_text('{"version": 1, "allocations": [{"key": "trunc')
    sim.restart_agent()
    k.wait_for(lambda: agent_agrees(sim), 60)
    log = sim.agent.log()
    assert "state file corrupt" in log and "rebuilding allocations from pod-resources" in log
    assert list(sim.agent.state_dir.glob("state.json.corrupt-*"))
    assert_no_double_booking(sim)
    # capacity sync follows the rebuilt ledger: exactly what was free before
    k.wait_for(lambda: {r: k.available(r) for r in (FRACTION, MEMORY)} == before)


def test_a_rebuilt_allocation_goes_with_its_pod(make_sim: Callable[..., Sim]) -> None:
    # Rebuilt from pod-resources (the state file lost): the kubelet listed it, so when its pod
    # is deleted the next List releases it, without the grace a fresh Allocate gets (300 s).
    sim = make_sim(reconcile_interval=0.2, release_grace=300)
    k = sim.kubelet
    pod = sim.admit("kept", MEMORY, 6)
    k.wait_for(lambda: agent_agrees(sim))
    sim.agent.kill()
    (sim.agent.state_dir / "state.json").unlink()
    sim.restart_agent()
    k.wait_for(lambda: [a["pod"] for a in sim.agent.state()["allocations"]] == ["kept"], 60)
    assert "rebuilt allocation" in sim.agent.log()
    k.delete(pod)
    k.wait_for(lambda: sim.agent.state()["allocations"] == [], 20)
