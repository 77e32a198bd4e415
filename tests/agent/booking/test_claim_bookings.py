"""A DRA claim's booking in the ledger: keyed by its UID, one per claim, kept across a state
save and restore (consumers too), released only by unprepare, never by pod-resources."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from test_allocations import ids, make_inventory

from gpufrac.agent.booking.container_dirs import ContainerDirs
from gpufrac.agent.booking.ledger import Ledger
from gpufrac.agent.booking.ledger_store import (
    StateStore,
    read_claim_records,
    restore,
    restore_claim_records,
    write_claim_record,
)
from gpufrac.agent.booking.persist import Persister
from gpufrac.agent.booking.reconcile import Reconciler
from gpufrac.agent.metrics.registry import Metrics
from gpufrac.core.claims import ClaimRef, claim_key
from gpufrac.core.config import Config, GiB, PathsConfig
from gpufrac.core.errors import AllocationError
from gpufrac.core.slices import MEMORY, ContainerDevices

pytestmark = pytest.mark.unit

CLAIM = ClaimRef("ns", "c", "uid-1")


def config(tmp_path: Path) -> Config:
    return Config(paths=PathsConfig(state_dir=str(tmp_path / "state"), kubelet_dir=str(tmp_path / "kubelet")))


def test_a_claim_is_booked_once_under_its_uid(tmp_path: Path) -> None:
    ledger = Ledger(config(tmp_path), make_inventory())
    alloc = ledger.reserve(MEMORY, ids(ledger, 0, MEMORY, range(4)), claim=CLAIM)
    assert alloc.key == claim_key("uid-1") and ledger.by_claim("uid-1") is alloc
    assert alloc.request_bytes == 4 * GiB and alloc.who() == "claim ns/c"
    with pytest.raises(AllocationError, match="already booked"):
        ledger.reserve(MEMORY, ids(ledger, 0, MEMORY, range(4, 6)), claim=CLAIM)
    # Its containers are the consumers the claim has, in any pod.
    ledger.set_consumers(alloc.key, frozenset({("pod-1", "main"), ("pod-2", "side")}))
    assert alloc.held_by("pod-2", "side") and not alloc.held_by("pod-2", "main")
    ledger.release(alloc.key)
    assert ledger.by_claim("uid-1") is None and ledger.requested(ledger.inventory.gpus[0].uuid) == 0


def test_state_save_and_restore_keep_the_claim_and_its_consumers(tmp_path: Path) -> None:
    cfg = config(tmp_path)

    async def save() -> None:
        ledger = Ledger(cfg, make_inventory())
        alloc = ledger.reserve(MEMORY, ids(ledger, 1, MEMORY, range(3)), claim=CLAIM)
        ledger.set_consumers(alloc.key, frozenset({("pod-1", "main")}))
        persister = Persister(ledger, StateStore(cfg.paths.state_dir))
        await persister.flush()  # on disk when it returns

    asyncio.run(save())
    again = Ledger(cfg, make_inventory())
    entries = StateStore(cfg.paths.state_dir).load()
    assert entries is not None
    (alloc,) = restore(again, entries)
    assert (alloc.claim, alloc.key, alloc.consumers) == (
        CLAIM,
        claim_key("uid-1"),
        frozenset({("pod-1", "main")}),
    )
    assert again.by_claim("uid-1") is alloc and alloc.request_bytes == 3 * GiB


def test_pod_resources_never_releases_a_claims_booking(tmp_path: Path) -> None:
    cfg = config(tmp_path)

    class Lister:  # the kubelet's pod-resources of a node in DRA mode: no device-plugin devices
        async def list(self, resources: tuple[str, ...] | None = None) -> list[ContainerDevices]:
            return []

    async def scenario() -> tuple[bool, bool]:
        ledger = Ledger(cfg, make_inventory())
        claim = ledger.reserve(MEMORY, ids(ledger, 0, MEMORY, range(2)), claim=CLAIM)
        plain = ledger.reserve(MEMORY, ids(ledger, 1, MEMORY, range(2)))
        dirs = ContainerDirs(cfg.paths.containers_dir, cfg.paths.state_dir)
        await Reconciler(ledger, Lister(), dirs, Metrics()).reconcile(grace=0.0)
        await dirs.close()
        return ledger.get(claim.key) is not None, ledger.get(plain.key) is not None

    # The device-plugin booking pod-resources does not list goes; the claim's stays.
    assert asyncio.run(scenario()) == (True, False)


def test_flush_shares_one_save_and_raises_when_it_fails(tmp_path: Path) -> None:
    cfg = config(tmp_path)

    class Store:
        path = tmp_path / "state.json"

        def __init__(self) -> None:
            self.saves = 0
            self.fail = False

        async def save(self, ledger: Ledger, *, sync: bool = True) -> None:
            self.saves += 1
            await asyncio.sleep(0.01)
            if self.fail:
                raise OSError(28, "No space left on device")

    async def scenario() -> int:
        ledger = Ledger(cfg, make_inventory())
        store = Store()
        persister = Persister(ledger, store)
        ledger.reserve(MEMORY, ids(ledger, 0, MEMORY, range(1)), claim=CLAIM)
        await asyncio.gather(*(persister.flush() for _ in range(5)))  # one save for all five
        saves = store.saves
        await persister.flush()  # nothing changed since: no save
        assert store.saves == saves
        store.fail = True
        ledger.reserve(MEMORY, ids(ledger, 0, MEMORY, range(1, 2)), claim=ClaimRef("ns", "d", "uid-2"))
        with pytest.raises(OSError, match="No space"):
            await persister.flush()
        return saves

    assert asyncio.run(scenario()) == 1


def test_a_slower_older_save_never_replaces_a_newer_one(tmp_path: Path) -> None:
    # The DRA driver's unsynced save and the batched synced one are written side by side: the
    # one encoded later wins, whichever reaches the rename first.
    store = StateStore(str(tmp_path))
    store._write(2, {"version": 1, "allocations": [{"n": 2}]}, False)
    store._write(1, {"version": 1, "allocations": [{"n": 1}]}, True)  # the older one, finishing last
    assert store.load() == [{"n": 2}]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]  # no temporary file left


def test_a_claim_prepared_after_the_last_state_save_comes_back_from_its_record(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    ledger = Ledger(cfg, make_inventory())
    alloc = ledger.reserve(MEMORY, ids(ledger, 0, MEMORY, range(3)), claim=CLAIM)
    ledger.set_consumers(alloc.key, frozenset({("pod-1", "main")}))
    os.makedirs(alloc.directory)
    write_claim_record(alloc)  # what prepare writes before its answer; no state save since
    again = Ledger(cfg, make_inventory())
    (back,) = restore_claim_records(again, read_claim_records(cfg.paths.containers_dir))
    assert (back.key, back.claim, back.consumers, back.request_bytes) == (
        alloc.key,
        CLAIM,
        alloc.consumers,
        3 * GiB,
    )
    # A claim the state file has already is not booked twice from its record.
    assert restore_claim_records(again, read_claim_records(cfg.paths.containers_dir)) == []
