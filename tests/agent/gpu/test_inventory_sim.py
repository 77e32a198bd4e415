"""The agent's GPU inventory, read through the real nvidia-ml-py from simgpu's fake
libnvidia-ml.so.1, matches the node spec it was created from — on every preset."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import pytest

from gpufrac.agent.gpu.inventory import parse_bus_id, read_inventory, read_memory
from gpufrac.core.gpus import Inventory, PcieLink
from gpufrac.simgpu import faults
from gpufrac.simgpu.spec import TOPO_LEVEL_NAMES, NodeSpec, load_preset, preset_names

if TYPE_CHECKING:
    from tests.fixtures.simnode import SimNode


@pytest.fixture(params=preset_names())
def preset(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def sim_node(make_sim_node: Callable[..., SimNode], preset: str) -> SimNode:
    # Overrides tests/conftest.py's sim_node, so in_process_nvml serves each preset in turn.
    return make_sim_node(preset)


@pytest.fixture
def spec(preset: str) -> NodeSpec:
    return load_preset(preset)


@pytest.fixture
def inventory(in_process_nvml: SimNode) -> Inventory:
    return read_inventory()


def test_the_issue_presets_exist() -> None:
    assert {"dgx-h100", "pcie-l4x4", "a100x2-nvlink"} <= set(preset_names())


def _shared(spec: NodeSpec) -> list[int]:
    """Indices of the GPUs gpufrac shares: all but those in MIG mode."""
    return [i for i, g in enumerate(spec.gpus) if not g.mig_enabled]


def test_each_gpu_matches_the_spec(inventory: Inventory, spec: NodeSpec) -> None:
    assert [g.index for g in inventory.gpus] == _shared(spec)
    assert [g.index for g in inventory.mig] == [i for i, g in enumerate(spec.gpus) if g.mig_enabled]
    assert inventory.unreachable == {}
    for gpu in (*inventory.gpus, *inventory.mig):
        i, want = gpu.index, spec.gpus[gpu.index]
        assert gpu.uuid == spec.gpu_uuid(i)
        assert gpu.model == want.model
        assert gpu.memory_total == want.memory
        assert parse_bus_id(gpu.pci_bus_id) == parse_bus_id(want.pci_bus_id)
        assert gpu.numa_node == want.numa_node
        assert gpu.cpu_affinity == want.cpu_affinity
    assert len({g.minor for g in (*inventory.gpus, *inventory.mig)}) == len(spec.gpus)
    assert inventory.by_uuid(spec.gpu_uuid(0)) is inventory.gpus[0]


def test_driver_versions_match_the_spec(inventory: Inventory, spec: NodeSpec) -> None:
    assert inventory.driver_version == spec.driver_version
    assert inventory.cuda_driver_version == spec.cuda_driver_version


def test_every_pair_has_the_specs_nvlinks_and_pcie_path(inventory: Inventory, spec: NodeSpec) -> None:
    shared = _shared(spec)
    assert set(inventory.links) == {(a, b) for a in shared for b in shared if a != b}
    for a in shared:
        assert inventory.link(a, a).pcie is PcieLink.SELF
        for b in shared:
            if a == b:
                continue
            link = inventory.link(a, b)
            assert link == inventory.link(b, a), "links are symmetric"
            assert link.nvlinks == spec.nvlinks(a, b), (a, b)
            assert link.pcie.value == TOPO_LEVEL_NAMES[spec.topology[a][b]], (a, b)


def test_memory_usage_is_read_per_gpu(inventory: Inventory) -> None:
    usage = read_memory()
    assert set(usage) == {g.uuid for g in (*inventory.gpus, *inventory.mig)}
    for g in (*inventory.gpus, *inventory.mig):
        m = usage[g.uuid]
        assert m.total == g.memory_total
        assert 0 <= m.used <= m.total and m.used + m.free == m.total


# The node shapes simgpu's presets promise (docs/simgpu.md), checked independently of the spec code.


def _numa_nodes(inv: Inventory) -> set[int | None]:
    return {g.numa_node for g in inv.gpus}


@pytest.mark.parametrize("preset", ["dgx-h100"])
def test_dgx_h100_is_eight_h100s_all_on_nvlink_over_two_numa_nodes(inventory: Inventory) -> None:
    assert len(inventory.gpus) == 8
    assert all("H100" in g.model and g.memory_total >= 80 * 10**9 for g in inventory.gpus)
    assert all(link.nvlinks > 0 for link in inventory.links.values())
    assert _numa_nodes(inventory) == {0, 1}
    # GPUs on different sockets cross the inter-socket link; their CPUs are disjoint.
    for (a, b), link in inventory.links.items():
        ga, gb = inventory.gpus[a], inventory.gpus[b]
        if ga.numa_node != gb.numa_node:
            assert link.pcie is PcieLink.SYSTEM
            assert not set(ga.cpu_affinity) & set(gb.cpu_affinity)


@pytest.mark.parametrize("preset", ["pcie-l4x4"])
def test_pcie_l4x4_is_four_l4s_without_nvlink_over_two_numa_nodes(inventory: Inventory) -> None:
    assert len(inventory.gpus) == 4
    assert all("L4" in g.model for g in inventory.gpus)
    assert all(link.nvlinks == 0 for link in inventory.links.values())
    assert _numa_nodes(inventory) == {0, 1}


@pytest.mark.parametrize("preset", ["a100x2-nvlink"])
def test_a100x2_is_two_a100s_joined_by_nvlink(inventory: Inventory) -> None:
    assert len(inventory.gpus) == 2
    assert all("A100" in g.model for g in inventory.gpus)
    assert inventory.link(0, 1).nvlinks > 0


@pytest.mark.parametrize("preset", ["pcie-l4x4"])
def test_a_gpu_off_the_bus_is_listed_as_unreachable_not_fatal(
    in_process_nvml: SimNode, spec: NodeSpec
) -> None:
    faults.fall_off_bus(in_process_nvml.path, 2)
    inv = read_inventory()
    assert [g.index for g in inv.gpus] == [0, 1, 3]
    assert set(inv.unreachable) == {2}
    assert "lost" in inv.unreachable[2].lower()
    assert set(inv.links) == {(a, b) for a in (0, 1, 3) for b in (0, 1, 3) if a != b}
    faults.restore_gpu(in_process_nvml.path, 2)
    inv = read_inventory()
    assert [g.uuid for g in inv.gpus] == [spec.gpu_uuid(i) for i in range(4)]
    assert inv.unreachable == {}
