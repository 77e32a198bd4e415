"""Reconciles overlap (the loop, identity passes, Allocate, PreStartContainer): the answer
of a pod-resources List asked earlier must never undo one asked later."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from test_allocations import ids, make_inventory

from gpufrac.agent.booking.container_dirs import ContainerDirs
from gpufrac.agent.booking.ledger import Ledger
from gpufrac.agent.booking.reconcile import Reconciler
from gpufrac.agent.metrics.registry import Metrics
from gpufrac.core.config import Config, PathsConfig
from gpufrac.core.slices import MEMORY, ContainerDevices

pytestmark = pytest.mark.unit


class HeldLister:
    """pod-resources whose answers the test hands out, in the order it chooses."""

    def __init__(self) -> None:
        self.calls: list[asyncio.Future[list[ContainerDevices]]] = []

    async def list(self, resources: tuple[str, ...] | None = None) -> list[ContainerDevices]:
        fut: asyncio.Future[list[ContainerDevices]] = asyncio.get_running_loop().create_future()
        self.calls.append(fut)
        return await fut


def test_an_older_list_answer_arriving_last_does_not_rebook_a_gone_pod(tmp_path: Path) -> None:
    """The older answer still lists a pod the newer one no longer does: applied last, it
    would book that pod's slices again (and bind the key to the old listing), holding
    capacity for a pod that is gone."""
    cfg = Config(paths=PathsConfig(state_dir=str(tmp_path / "state"), kubelet_dir=str(tmp_path / "kubelet")))

    async def scenario() -> list[str]:
        ledger = Ledger(cfg, make_inventory())
        lister = HeldLister()
        dirs = ContainerDirs(cfg.paths.containers_dir, cfg.paths.state_dir)
        reconciler = Reconciler(ledger, lister, dirs, Metrics())
        first = asyncio.create_task(reconciler.reconcile())  # asked while the pod was there
        await asyncio.sleep(0)
        second = asyncio.create_task(reconciler.reconcile())  # asked after it was deleted
        await asyncio.sleep(0)
        gone = ContainerDevices("ns", "gone", "main", MEMORY, tuple(ids(ledger, 0, MEMORY, range(2))))
        lister.calls[1].set_result([])
        await second
        lister.calls[0].set_result([gone])
        await first
        await dirs.close()
        return [a.pod or "" for a in ledger.containers()]

    assert asyncio.run(scenario()) == []


def test_allocate_grace_zero_release_uses_the_newer_answer(tmp_path: Path) -> None:
    """Allocate asks with grace 0 to free the slices of a deleted pod the kubelet hands out
    again; when its answer is superseded, the release still happens over the newer one."""
    cfg = Config(paths=PathsConfig(state_dir=str(tmp_path / "state"), kubelet_dir=str(tmp_path / "kubelet")))

    async def scenario() -> list[str]:
        ledger = Ledger(cfg, make_inventory())
        ledger.allocate(MEMORY, ids(ledger, 0, MEMORY, range(2)))  # its pod was just deleted
        lister = HeldLister()
        dirs = ContainerDirs(cfg.paths.containers_dir, cfg.paths.state_dir)
        reconciler = Reconciler(ledger, lister, dirs, Metrics())
        mine = asyncio.create_task(reconciler.reconcile(grace=0.0))
        await asyncio.sleep(0)
        loop_pass = asyncio.create_task(reconciler.reconcile())  # the loop's, with its usual grace
        await asyncio.sleep(0)
        lister.calls[1].set_result([])
        await loop_pass
        lister.calls[0].set_result([])
        assert await mine
        await dirs.close()
        return [a.key for a in ledger.containers()]

    assert asyncio.run(scenario()) == []


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
        ledger = Ledger(cfg, make_inventory())
        devs = ids(ledger, 0, MEMORY, range(2))
        lister = FixedLister([ContainerDevices("ns", "p", "main", MEMORY, tuple(devs))])
        dirs = ContainerDirs(cfg.paths.containers_dir, cfg.paths.state_dir)
        reconciler = Reconciler(ledger, lister, dirs, Metrics())
        assert await reconciler.reconcile()
        booked_while_broken = len(ledger.containers())
        blocker.unlink()
        assert await reconciler.reconcile()
        (alloc,) = ledger.containers()
        await dirs.close()
        return booked_while_broken, ledger.attached(alloc.key), Path(alloc.directory).is_dir()

    assert asyncio.run(scenario()) == (0, True, True)
