"""Reconciles overlap (the loop, identity passes, Allocate, PreStartContainer): the answer
of a pod-resources List asked earlier must never undo one asked later."""

from __future__ import annotations

import asyncio
from pathlib import Path

from test_allocations import ids, make_inventory

from gpufrac.agent.allocations import Ledger
from gpufrac.agent.config import Config, PathsConfig
from gpufrac.agent.main import Agent
from gpufrac.deviceplugin.podresources import ContainerDevices
from gpufrac.deviceplugin.slices import MEMORY


class HeldLister:
    """pod-resources whose answers the test hands out, in the order it chooses."""

    def __init__(self) -> None:
        self.calls: list[asyncio.Future[list[ContainerDevices]]] = []

    async def list(self, resources: tuple[str, ...] | None = None) -> list[ContainerDevices]:
        fut: asyncio.Future[list[ContainerDevices]] = asyncio.get_running_loop().create_future()
        self.calls.append(fut)
        return await fut


def test_an_older_list_answer_arriving_last_is_not_applied(tmp_path: Path) -> None:
    cfg = Config(paths=PathsConfig(state_dir=str(tmp_path / "state"), kubelet_dir=str(tmp_path / "kubelet")))

    async def scenario() -> tuple[str | None, str | None]:
        agent = Agent(cfg)
        agent.ledger = ledger = Ledger(cfg, make_inventory())
        devs = ids(ledger, 0, MEMORY, range(2))
        alloc = ledger.allocate(MEMORY, devs)
        lister = HeldLister()
        agent.pod_resources = lister  # type: ignore[assignment]
        first = asyncio.create_task(agent.reconcile())  # asked while the old pod held the slices
        await asyncio.sleep(0)
        second = asyncio.create_task(agent.reconcile())  # asked after the new pod got them
        await asyncio.sleep(0)
        old, new = (ContainerDevices("ns", pod, "main", MEMORY, tuple(devs)) for pod in ("old", "new"))
        lister.calls[1].set_result([new])
        await second
        lister.calls[0].set_result([old])
        await first
        await agent.dirs.close()
        return ledger.get(alloc.key).pod, agent.listing[alloc.key].pod  # type: ignore[union-attr]

    assert asyncio.run(scenario()) == ("new", "new")


class FixedLister:
    def __init__(self, listed: list[ContainerDevices]) -> None:
        self.listed = listed

    async def list(self, resources: tuple[str, ...] | None = None) -> list[ContainerDevices]:
        return self.listed


def test_a_rebuilt_allocation_whose_files_cannot_be_written_is_rebuilt_next_time(tmp_path: Path) -> None:
    cfg = Config(paths=PathsConfig(state_dir=str(tmp_path / "state"), kubelet_dir=str(tmp_path / "kubelet")))
    blocker = Path(cfg.paths.containers_dir)
    blocker.parent.mkdir(parents=True)
    blocker.write_text("")  # a file where the containers directory goes: every write fails

    async def scenario() -> tuple[int, bool, bool]:
        agent = Agent(cfg)
        agent.ledger = ledger = Ledger(cfg, make_inventory())
        devs = ids(ledger, 0, MEMORY, range(2))
        agent.pod_resources = FixedLister([ContainerDevices("ns", "p", "main", MEMORY, tuple(devs))])  # type: ignore[assignment]
        assert await agent.reconcile()
        booked_while_broken = len(ledger.containers())
        blocker.unlink()
        assert await agent.reconcile()
        (alloc,) = ledger.containers()
        await agent.dirs.close()
        return booked_while_broken, ledger.attached(alloc.key), Path(alloc.directory).is_dir()

    assert asyncio.run(scenario()) == (0, True, True)
