"""Pods with identical requests never get each other's policy (docs/design.md section 6: "Matching
an Allocate call to a pod by request size mixed pods up").

Allocate carries only device IDs, and here every pod asks for the same number of them; only
its annotations (gpufrac.dev/gpu-memory-limit) and spec.priority tell the pods apart. The
kubelet emulator admits them through the real agent (a subprocess), which learns each
container's pod from pod-resources and the apiserver emulator. Pods are deleted and
admitted again (a new pod under an old name too) on a GPU they fill, so each new pod gets
exactly the slices, and so the container directory, of a pod just deleted.

Whenever a container's config is read it carries its own pod (or no pod yet, with the safe
limit = request), never another's; once known, exactly its own pod's limit and priority.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from test_identity_kubelet import config_of

from gpufrac.core import annotations as ann
from gpufrac.core.slices import MEMORY, container_key
from gpufrac.memguard.abi import FLAG_POD_KNOWN, ContainerConfig
from gpufrac.simgpu.kubelet import Container, Pod
from gpufrac.simgpu.spec import spec_from_dict
from tests.fixtures.agentsim import Sim, short_tmpdir, start_sim, stop_sim
from tests.fixtures.e2e import NODE, SMALL_NODE, UNIT, MiB, agent_config
from tests.fixtures.kube import KubeServer, pod_manifest
from tests.fixtures.polling import until

UNITS = 5  # every pod: 5 x 64 MiB; three of them fill the GPU's 15 allocatable units
REQUEST = UNITS * UNIT


@dataclass(frozen=True)
class Admitted:
    pod: Pod
    limit: int  # the limit its annotations ask for (the request when they ask for none)
    earlier: tuple[int, ...] = ()  # limits this same pod asked for before (annotate)


class SameSizeNode:
    """The kubelet, the agent and the apiserver of one small node; `live` are its pods."""

    def __init__(self, sim: Sim, kube: KubeServer) -> None:
        self.sim, self.kube = sim, kube
        self.v1 = kube.core_v1()
        self.live: dict[str, Admitted] = {}  # pod uid -> pod

    def create(self, name: str, limit_mib: int | None, priority: int) -> Admitted:
        """Create the pod in the apiserver, as the scheduler bound it (not admitted yet)."""
        annotations = {} if limit_mib is None else {ann.MEMORY_LIMIT: f"{limit_mib}Mi"}
        pod = Pod(
            "default", name, [Container("main", {MEMORY: UNITS})], annotations=annotations, priority=priority
        )
        manifest = pod_manifest(name, node=NODE, uid=pod.uid, annotations=annotations, priority=priority)
        self.v1.create_namespaced_pod("default", manifest)
        return Admitted(pod, REQUEST if limit_mib is None else limit_mib * MiB)

    def start(self, a: Admitted) -> Admitted:
        """The kubelet admits the pod: Allocate through the agent's device plugin."""
        self.sim.kubelet.admit(a.pod)
        self.live[a.pod.uid] = a
        return a

    def admit(self, name: str, limit_mib: int | None, priority: int) -> Admitted:
        return self.start(self.create(name, limit_mib, priority))

    def delete(self, a: Admitted, *, from_apiserver: bool = True) -> None:
        """The kubelet forgets the pod (the agent is not told), and the apiserver drops it
        (unless it went from there already: a force delete)."""
        self.sim.kubelet.delete(a.pod)
        if from_apiserver:
            self.v1.delete_namespaced_pod(a.pod.name, "default")
        del self.live[a.pod.uid]

    def annotate(self, a: Admitted, limit_mib: int) -> Admitted:
        """Change a running pod's limit annotation; the agent re-applies its policy."""
        self.v1.patch_namespaced_pod(
            a.pod.name, "default", {"metadata": {"annotations": {ann.MEMORY_LIMIT: f"{limit_mib}Mi"}}}
        )
        changed = Admitted(a.pod, limit_mib * MiB, (*a.earlier, a.limit))
        self.live[a.pod.uid] = changed
        return changed

    def key(self, a: Admitted) -> str:
        return container_key(MEMORY, self.sim.kubelet.pod_devices(a.pod.uid)["main"][MEMORY])

    def config(self, key: str) -> ContainerConfig | None:
        return config_of(self.sim.agent.state_dir / "containers" / key)

    def settled(self) -> bool:
        """True once every live pod's config carries its own pod's policy. Fails at once when one
        carries another pod's identity, or a limit other than the safe one before its pod is known."""
        done = 0
        for a in self.live.values():
            cfg = self.config(self.key(a))
            if cfg is None:
                continue  # being written
            who = f"{a.pod.name} ({a.pod.uid}): {cfg}"
            assert cfg.request_bytes == REQUEST, who
            assert cfg.pod_uid in ("", a.pod.uid), f"another pod's uid in the config of {who}"
            assert cfg.pod in ("", a.pod.name), f"another pod's name in the config of {who}"
            if not cfg.flags & FLAG_POD_KNOWN:
                assert cfg.limit_bytes == REQUEST, f"a limit before its pod was known in the config of {who}"
                continue
            assert (cfg.namespace, cfg.pod, cfg.container, cfg.pod_uid) == (
                "default",
                a.pod.name,
                "main",
                a.pod.uid,
            ), who
            assert cfg.priority == a.pod.priority, who
            # Its own limit; while a change of its annotation is on its way, its own earlier one.
            assert cfg.limit_bytes in (a.limit, *a.earlier), who
            done += cfg.limit_bytes == a.limit
        return done == len(self.live)

    def wait_reconciled(self) -> None:
        """Until the agent has answered from at least one whole reconcile pass (a pod-resources
        List and the identity pass after it) begun after now: the third List from now is asked
        only after the second's pass is over (the loop's passes follow one another)."""
        lists = self.sim.kubelet.pod_resources_lists
        start = lists()
        until(lambda: lists() >= start + 3, what="the agent's next reconciles with pod-resources")

    def wait_settled(self) -> None:
        try:
            until(self.settled, what="every pod's own policy in its container's config")
        except AssertionError as e:
            raise AssertionError(f"{e}; agent log:\n{self.sim.agent.log()[-4000:]}") from None


@pytest.fixture
def node(kube_server: KubeServer) -> Iterator[SameSizeNode]:
    root = short_tmpdir("gfs")
    try:
        sim = start_sim(root, spec_from_dict(SMALL_NODE), agent_config(root, kube_server))
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    try:
        yield SameSizeNode(sim, kube_server)
    finally:
        print(f"--- agent log ---\n{sim.agent.log()[-6000:]}")  # shown only when the test failed
        stop_sim(sim)


def test_pods_of_one_size_each_get_their_own_limit_and_priority(node: SameSizeNode) -> None:
    a = node.admit("a", 384, priority=10)
    b = node.admit("b", 640, priority=500)
    c = node.admit("c", None, priority=1000)  # no limit annotation: limit = request
    node.wait_settled()
    assert len({node.key(p) for p in (a, b, c)}) == 3

    # b goes; d arrives at once (before the agent's own release of b): the GPU's only free
    # slices are b's, so d gets b's container directory.
    b_key = node.key(b)
    node.delete(b)
    d = node.admit("d", 896, priority=7)
    assert node.key(d) == b_key
    node.wait_settled()

    # Two go and two come back to back, before either is known to the agent.
    freed = {node.key(a), node.key(d)}
    node.delete(a)
    node.delete(d)
    e = node.admit("e", 448, priority=50)
    f = node.admit("f", None, priority=900)
    assert {node.key(e), node.key(f)} == freed
    node.wait_settled()

    # Only the live pods' directories remain, each named for its pod's devices.
    live = {node.key(p): p for p in node.live.values()}
    until(lambda: node.sim.agent.container_dirs() == set(live), what="released pods' directories gone")
    for key, p in live.items():
        cfg = node.config(key)
        assert cfg is not None and cfg.pod_uid == p.pod.uid
        assert (cfg.limit_bytes, cfg.priority) == (p.limit, p.pod.priority)


def test_a_new_pod_under_an_old_name_gets_its_own_policy_never_the_old_pods_container(
    node: SameSizeNode,
) -> None:
    """A StatefulSet pod force-deleted and created again: same name, new uid, new annotations,
    while the old pod's container still runs; then the new pod gets the old one's slices."""
    old = node.admit("web-0", 384, priority=10)
    b = node.admit("b", 640, priority=500)
    node.admit("c", None, priority=1000)
    node.wait_settled()

    # Gone from the apiserver (force delete), still running on the kubelet; its successor is created.
    node.v1.delete_namespaced_pod("web-0", "default")
    successor = node.create("web-0", 512, priority=200)
    # A change the agent shows, made after the successor appeared: once b's new limit is in its
    # config, the agent has seen the successor, and the old container must still carry its own pod.
    node.annotate(b, 704)
    node.wait_settled()
    # The agent reconciles while the kubelet still lists the old container under the name
    # web-0 (pod-resources carries no uid) and the apiserver's web-0 is the successor: two
    # whole passes (List, then identity) begun after that, and the old one still carries its own.
    node.wait_reconciled()
    node.wait_settled()

    # The old container stops; the successor is admitted on the same slices.
    old_key = node.key(old)
    node.delete(old, from_apiserver=False)
    node.start(successor)
    assert node.key(successor) == old_key and successor.pod.uid != old.pod.uid
    node.wait_settled()
