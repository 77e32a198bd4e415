"""The allocation ledger: booking rules, capacity sync, container files, persistence."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import threading
import time
from pathlib import Path

import grpc
import pytest

from gpufrac.agent.booking.container_dirs import retire_container_dir, write_container_dir
from gpufrac.agent.booking.ledger import Ledger
from gpufrac.agent.booking.ledger_store import StateStore, encode, restore
from gpufrac.core import slices
from gpufrac.core.config import Config, GiB, PathsConfig
from gpufrac.core.errors import AllocationError
from gpufrac.core.gpus import Gpu, Inventory, Link, PcieLink
from gpufrac.core.slices import FRACTION, MEMORY, container_key, device_id
from gpufrac.deviceplugin.server import status_code
from gpufrac.memguard import abi

pytestmark = pytest.mark.unit

TOTAL = 17 * GiB  # allocatable 16 GiB with the default 1 GiB reserve


def make_inventory(n: int = 2, numa: tuple[int, ...] | None = None) -> Inventory:
    numa = numa or tuple(0 for _ in range(n))
    gpus = [
        Gpu(i, f"GPU-{i:08d}-0000-0000-0000-000000000000", "Sim", TOTAL, f"0000:{i:02x}:00.0", numa[i], (), i)
        for i in range(n)
    ]
    links = {(a, b): Link(0, PcieLink.SYSTEM) for a in range(n) for b in range(n) if a != b}
    return Inventory(gpus=gpus, links=links)


def make_config(tmp_path: Path) -> Config:
    return Config(paths=PathsConfig(state_dir=str(tmp_path / "state"), kubelet_dir=str(tmp_path / "kubelet")))


@pytest.fixture
def ledger(tmp_path: Path) -> Ledger:
    return Ledger(make_config(tmp_path), make_inventory())


def ids(ledger: Ledger, gpu: int, resource: str, numbers: range | list[int]) -> list[str]:
    return [device_id(ledger.inventory.gpus[gpu].uuid, resource, n) for n in numbers]


def slices_gpu(device: str) -> str:
    return slices.parse(device).gpu_uuid


def healthy(ledger: Ledger, resource: str, gpu: int) -> set[str]:
    uuid = ledger.inventory.gpus[gpu].uuid
    return {d for d, ok, _ in ledger.devices(resource) if ok and d.startswith(uuid)}


def refused(ledger: Ledger, resource: str, devices: list[str]) -> AllocationError:
    with pytest.raises(AllocationError) as exc:
        ledger.allocate(resource, devices)
    return exc.value


def test_fresh_node_reports_every_slice_healthy(ledger: Ledger) -> None:
    assert len(healthy(ledger, FRACTION, 0)) == 100
    assert len(healthy(ledger, MEMORY, 0)) == 16  # 16 GiB allocatable / 1 GiB unit
    numa = {n for _, _, n in ledger.devices(MEMORY)}
    assert numa == {0}


def test_memory_taken_shrinks_fractions_on_that_gpu_only(ledger: Ledger) -> None:
    ledger.allocate(MEMORY, ids(ledger, 0, MEMORY, range(8)))  # half of GPU 0
    assert len(healthy(ledger, FRACTION, 0)) == 50
    assert healthy(ledger, FRACTION, 0) == set(ids(ledger, 0, FRACTION, range(50)))  # lowest numbers first
    assert len(healthy(ledger, FRACTION, 1)) == 100
    # allocated memory slices stay Healthy; the other 8 still fit
    assert len(healthy(ledger, MEMORY, 0)) == 16


def test_fractions_taken_shrink_memory_and_allocated_stay_healthy(ledger: Ledger) -> None:
    ledger.allocate(FRACTION, ids(ledger, 0, FRACTION, range(60, 85)))  # 25 % = 4 GiB
    assert len(healthy(ledger, MEMORY, 0)) == 12
    h = healthy(ledger, FRACTION, 0)
    assert set(ids(ledger, 0, FRACTION, range(60, 85))) <= h and len(h) == 100
    ledger.allocate(MEMORY, ids(ledger, 0, MEMORY, range(12)))  # the rest of GPU 0
    h = healthy(ledger, FRACTION, 0)
    assert h == set(ids(ledger, 0, FRACTION, range(60, 85)))  # nothing unallocated fits any more
    assert healthy(ledger, MEMORY, 0) == set(ids(ledger, 0, MEMORY, range(12)))


def test_allocate_writes_safe_config_and_usage(ledger: Ledger) -> None:
    a = ledger.allocate(MEMORY, ids(ledger, 1, MEMORY, range(3)))
    cfg = abi.read_config(a.directory)
    assert cfg.gpu_uuid == ledger.inventory.gpus[1].uuid
    assert cfg.request_bytes == cfg.limit_bytes == 3 * GiB  # limit = request until the pod is known
    assert not cfg.flags & abi.FLAG_WHOLE_GPU
    assert os.stat(Path(a.directory) / abi.CONFIG_FILE).st_mode & 0o777 == 0o644
    assert (Path(a.directory) / abi.USAGE_FILE).exists()
    assert a.key == container_key(MEMORY, reversed(a.device_ids))  # order-independent


def test_whole_gpus_take_every_slice_and_flag(ledger: Ledger) -> None:
    a = ledger.allocate(FRACTION, ids(ledger, 0, FRACTION, range(100)) + ids(ledger, 1, FRACTION, range(100)))
    assert a.whole_gpu and a.gpus == tuple(g.uuid for g in ledger.inventory.gpus)
    cfg = abi.read_config(a.directory)
    assert cfg.flags & abi.FLAG_WHOLE_GPU and cfg.request_bytes == 16 * GiB
    assert not healthy(ledger, MEMORY, 0) and not healthy(ledger, MEMORY, 1)


@pytest.mark.parametrize(
    ("resource", "make", "code", "words"),
    [
        (
            FRACTION,
            lambda L: ids(L, 0, FRACTION, range(5)) + ids(L, 1, FRACTION, range(5)),
            "INVALID_ARGUMENT",
            "must come from one GPU",
        ),
        (MEMORY, lambda L: ids(L, 0, MEMORY, [0]) + ids(L, 1, MEMORY, [0]), "INVALID_ARGUMENT", "span GPUs"),
        (
            FRACTION,
            lambda L: ids(L, 0, FRACTION, range(100)) + ids(L, 1, FRACTION, range(50)),
            "INVALID_ARGUMENT",
            "150 is neither <= 100",
        ),
        (FRACTION, lambda L: ids(L, 0, FRACTION, [*range(10), 5]), "INVALID_ARGUMENT", "more than once"),
        (FRACTION, lambda L: ["GPU-nope::f01"], "INVALID_ARGUMENT", "unknown device IDs [GPU-nope::f01]"),
        (
            FRACTION,
            lambda L: ids(L, 0, MEMORY, [1]),
            "INVALID_ARGUMENT",
            "not gpufrac.dev/gpu-fraction devices",
        ),
        (MEMORY, lambda L: ids(L, 0, MEMORY, [16]), "INVALID_ARGUMENT", "unknown device IDs"),
        (MEMORY, lambda L: [], "INVALID_ARGUMENT", "names no devices"),
        # Another spelling of slice f01 (never advertised): it must not book f01 a second time.
        (FRACTION, lambda L: [L.inventory.gpus[0].uuid + "::f1"], "INVALID_ARGUMENT", "unknown device IDs"),
    ],
)
def test_refusals_name_ids_and_rule(ledger: Ledger, resource: str, make, code: str, words: str) -> None:
    devices = make(ledger)
    err = refused(ledger, resource, devices)
    assert status_code(err) == getattr(grpc.StatusCode, code)
    assert words in err.message
    assert not ledger.containers()
    assert not os.path.exists(ledger.config.paths.containers_dir) or not os.listdir(
        ledger.config.paths.containers_dir
    )


def test_whole_gpu_request_must_cover_each_gpu(ledger: Ledger) -> None:
    devs = ids(ledger, 0, FRACTION, range(100)) + ids(ledger, 1, FRACTION, range(100))
    ledger.allocate(FRACTION, ids(ledger, 1, FRACTION, [99]))
    err = refused(ledger, FRACTION, devs)
    assert status_code(err) == grpc.StatusCode.FAILED_PRECONDITION and "already allocated" in err.message


def test_double_booking_refused_names_owner(ledger: Ledger) -> None:
    a = ledger.allocate(FRACTION, ids(ledger, 0, FRACTION, range(10)))
    ledger.bind(a.key, "ns", "first", "main", "uid-1")
    err = refused(ledger, FRACTION, ids(ledger, 0, FRACTION, range(5, 15)))
    assert status_code(err) == grpc.StatusCode.FAILED_PRECONDITION
    assert "ns/first" in err.message and "::f05" in err.message


def test_unhealthy_gpu_refused_and_all_slices_unhealthy(ledger: Ledger) -> None:
    a = ledger.allocate(MEMORY, ids(ledger, 0, MEMORY, [0]))
    assert ledger.set_health(ledger.inventory.gpus[0].uuid, False, "XID 79")
    assert not healthy(ledger, MEMORY, 0) and not healthy(ledger, FRACTION, 0)
    err = refused(ledger, MEMORY, ids(ledger, 0, MEMORY, [1]))
    assert status_code(err) == grpc.StatusCode.FAILED_PRECONDITION and "Unhealthy (XID 79)" in err.message
    ledger.set_health(ledger.inventory.gpus[0].uuid, True)
    assert a.device_ids[0] in healthy(ledger, MEMORY, 0) and len(healthy(ledger, MEMORY, 0)) == 16


def test_request_beyond_unrequested_memory_refused(ledger: Ledger) -> None:
    # The kubelet may act on a stale snapshot: Allocate itself never overbooks a GPU.
    ledger.allocate(MEMORY, ids(ledger, 0, MEMORY, range(12)))
    err = refused(ledger, FRACTION, ids(ledger, 0, FRACTION, range(30)))
    assert status_code(err) == grpc.StatusCode.FAILED_PRECONDITION and "unrequested" in err.message


def test_release_frees_slices_and_directory(ledger: Ledger) -> None:
    changes = []
    ledger.add_listener(lambda: changes.append(1))
    a = ledger.allocate(MEMORY, ids(ledger, 0, MEMORY, range(16)))
    assert not healthy(ledger, FRACTION, 0)
    ledger.release(a.key)
    assert len(healthy(ledger, FRACTION, 0)) == 100 and not os.path.exists(a.directory)
    assert len(changes) == 2
    ledger.allocate(MEMORY, ids(ledger, 0, MEMORY, range(16)))  # free again: no double-booking error


def test_update_config_never_below_request_nor_rebooks(ledger: Ledger) -> None:
    a = ledger.allocate(MEMORY, ids(ledger, 0, MEMORY, range(2)))
    ledger.update_config(a.key, limit_bytes=6 * GiB, priority=7)
    assert abi.read_config(a.directory).limit_bytes == 6 * GiB
    ledger.update_config(a.key, limit_bytes=1)
    assert abi.read_config(a.directory).limit_bytes == 2 * GiB
    with pytest.raises(ValueError, match="request_bytes"):
        ledger.update_config(a.key, request_bytes=10 * GiB)
    ledger.bind(a.key, "ns", "p", "c", "u")
    cfg = abi.read_config(a.directory)
    assert (cfg.namespace, cfg.pod, cfg.container, cfg.pod_uid, cfg.priority) == ("ns", "p", "c", "u", 7)


def test_grants_alone_do_not_ask_for_a_state_save(ledger: Ledger) -> None:
    """Every burst changes a grant: the state file need not follow (recovery reads grants
    from the config files), but bookings, identity and limits must reach it."""
    a = ledger.allocate(MEMORY, ids(ledger, 0, MEMORY, range(2)))
    ledger.update_config(a.key, limit_bytes=4 * GiB)
    seen: list[int] = []
    ledger.add_listener(lambda: seen.append(ledger.state_generation))
    gen = ledger.state_generation
    ledger.update_config(a.key, grant_bytes=GiB)
    assert abi.read_config(a.directory).grant_bytes == GiB  # published all the same
    assert seen == [gen]  # listeners told, no state change
    ledger.update_config(a.key, grant_bytes=0, priority=3)
    ledger.bind(a.key, "ns", "p", "c", "u")
    ledger.release(a.key)
    assert seen == [gen, gen + 1, gen + 2, gen + 3]


def test_state_roundtrip_rebooks_the_same(ledger: Ledger, tmp_path: Path) -> None:
    a = ledger.allocate(MEMORY, ids(ledger, 0, MEMORY, range(4)))
    ledger.bind(a.key, "ns", "p", "c", None)
    ledger.update_config(a.key, limit_bytes=9 * GiB)
    data = json.loads(json.dumps(encode(ledger)))
    fresh = Ledger(ledger.config, ledger.inventory)
    (b,) = restore(fresh, data["allocations"])
    assert (b.key, b.device_ids, b.pod, b.config.limit_bytes) == (a.key, a.device_ids, "p", 9 * GiB)
    assert len(healthy(fresh, FRACTION, 0)) == 75


def test_each_save_holds_every_change_since_the_last(ledger: Ledger, tmp_path: Path) -> None:
    """The store encodes again only bookings that changed since its last save: a limit, an
    identity, consumers, a release must each reach the next file all the same."""
    store = StateStore(str(tmp_path / "store"))

    def saved() -> dict[str, dict[str, object]]:
        asyncio.run(store.save(ledger))
        return {e["key"]: e for e in json.loads(store.path.read_text())["allocations"]}

    a = ledger.allocate(MEMORY, ids(ledger, 0, MEMORY, range(4)))
    b = ledger.allocate(MEMORY, ids(ledger, 1, MEMORY, range(2)))
    assert saved()[a.key]["config"]["limit_bytes"] == 4 * GiB  # type: ignore[index]
    ledger.update_config(a.key, limit_bytes=9 * GiB)
    ledger.bind(b.key, "ns", "p", "c", "u")
    state = saved()
    assert state[a.key]["config"]["limit_bytes"] == 9 * GiB  # type: ignore[index]
    assert (state[b.key]["namespace"], state[b.key]["pod"], state[b.key]["pod_uid"]) == ("ns", "p", "u")
    assert state[b.key]["config"]["pod"] == "p"  # type: ignore[index]
    ledger.release(a.key)
    state = saved()
    assert list(state) == [b.key]
    assert state[b.key]["config"]["pod"] == "p"  # type: ignore[index]


def test_a_malformed_state_entry_is_dropped_and_the_others_rebooked(
    ledger: Ledger, caplog: pytest.LogCaptureFixture
) -> None:
    a = ledger.allocate(MEMORY, ids(ledger, 0, MEMORY, range(4)))
    b = ledger.allocate(MEMORY, ids(ledger, 1, MEMORY, range(2)))
    entries = json.loads(json.dumps(encode(ledger)))["allocations"]
    (bad,) = [e for e in entries if e["key"] == a.key]
    bad["config"] = "limit=9Gi"  # an object once, a string now
    fresh = Ledger(ledger.config, ledger.inventory)
    assert [x.key for x in restore(fresh, entries)] == [b.key]
    assert f"dropping allocation {a.key}: malformed entry" in caplog.text


def test_corrupt_state_is_reported_and_moved_aside(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = StateStore(str(tmp_path))
    store.path.write_text('{"version": 1, "allocations": [')
    assert store.load() is None
    assert "state file corrupt" in caplog.text and "rebuilding allocations from pod-resources" in caplog.text
    assert not store.path.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("state.json.corrupt-")]


def test_device_sections_are_the_device_list_and_follow_only_touched_gpus(ledger: Ledger) -> None:
    def joined(resource: str) -> list[tuple[str, bool, int | None]]:
        return [d for _, build in ledger.device_sections(resource) for d in build()]

    def keys(resource: str) -> list[object]:
        return [k for k, _ in ledger.device_sections(resource)]

    before = {r: keys(r) for r in (FRACTION, MEMORY)}
    a = ledger.allocate(MEMORY, ids(ledger, 0, MEMORY, range(8)))
    for r in (FRACTION, MEMORY):
        assert joined(r) == ledger.devices(r)
        after = keys(r)
        # GPU 0's part of both lists changed (the other resource's room too); GPU 1's did not.
        assert after[0] != before[r][0] and after[1] == before[r][1]
    before = {r: keys(r) for r in (FRACTION, MEMORY)}
    ledger.set_health(ledger.inventory.gpus[1].uuid, False, "XID 79")
    assert joined(FRACTION) == ledger.devices(FRACTION)
    assert keys(FRACTION)[1] != before[FRACTION][1] and keys(FRACTION)[0] == before[FRACTION][0]
    generation = ledger.capacity_generation
    ledger.update_config(a.key, limit_bytes=12 * GiB)  # a config change: the lists stay as they are
    assert ledger.capacity_generation == generation


def test_container_dirs_spares_discard_and_sweep(tmp_path: Path) -> None:
    from gpufrac.agent.booking.container_dirs import ContainerDirs

    state = tmp_path / "state"
    containers = state / "containers"
    cfg = abi.ContainerConfig(gpu_uuid="GPU-a", request_bytes=2 * GiB, limit_bytes=2 * GiB)
    a = str(containers / "m-a")

    async def scenario() -> None:
        dirs = ContainerDirs(str(containers), str(state), spares=2)
        await dirs.start()
        try:
            # Queued behind the spares: the next create renames a spare into place.
            (await dirs.write(str(containers / "m-orphan"), cfg)).close()
            b = str(containers / "m-b")
            spare = await dirs.create(b, cfg)
            # The modes containers rely on, whatever the agent's umask.
            modes = {p.name: p.stat().st_mode & 0o777 for p in (Path(b), *Path(b).iterdir())}
            assert modes == {
                "m-b": 0o755,
                abi.CONFIG_FILE: 0o644,
                abi.USAGE_FILE: 0o666,
                abi.COMPUTE_FILE: 0o666,  # the shim's launch clock (compute shares)
                abi.SOCKET_DIR: 0o755,  # the arbiter socket's, mounted into the container
            }
            assert abi.read_config(b) == cfg
            # The spare's config was mapped before the rename: later writes land at the new path.
            later = dataclasses.replace(cfg, limit_bytes=5 * GiB)
            spare.write(later)
            assert abi.read_config(b) == later and spare.read() == later
            spare.close()
            for n in range(3):  # the same key booked, released and booked again at once
                mine = dataclasses.replace(cfg, limit_bytes=(3 + n) * GiB)
                handle = await dirs.create(a, mine)
                # A fresh directory each time: the last one's deletion ran first.
                assert abi.read_config(a) == mine
                assert abi.read_usage(a).magic == abi.USAGE_MAGIC
                assert not os.path.exists(os.path.join(a, "left-by-the-last"))
                Path(a, "left-by-the-last").touch()
                dirs.discard(a, handle)  # unmapped and deleted in the thread
            (await dirs.create(a, cfg)).close()
            await dirs.sweep(lambda: ["m-a"])
        finally:
            await dirs.close()

    umask = os.umask(0o077)
    try:
        asyncio.run(scenario())
    finally:
        os.umask(umask)
    assert os.listdir(containers) == ["m-a"]  # deletions queued before close are done


def test_the_slices_a_release_frees_are_preferred_last(ledger: Ledger) -> None:
    from gpufrac.agent.booking.placement import preferred

    def prefer(size: int) -> list[str]:
        free = [d for d, ok, _ in ledger.devices(MEMORY) if ok and ledger.owner(d) is None]
        return preferred(
            MEMORY,
            free,
            [],
            size,
            ledger.geometry,
            ledger.inventory,
            "binpack",
            ledger.booked(),
            ledger.released(),
        )

    first = ledger.allocate(MEMORY, prefer(2))
    second = ledger.allocate(MEMORY, prefer(2))
    ledger.release(first.key)
    again = prefer(2)
    # Same GPU (binpack), other slices: the new container does not get the key (and directory
    # name) of the one just released, whose deletion may still be queued.
    assert {slices_gpu(d) for d in again} == set(first.gpus)
    assert not set(again) & set(first.device_ids)
    assert container_key(MEMORY, again) != first.key
    ledger.release(second.key)
    assert set(prefer(2)).isdisjoint(second.device_ids)  # the most recent release comes last


def test_a_rebooked_key_is_read_from_its_own_files_only(tmp_path: Path) -> None:
    """Released and booked again under the same key: until the new directory is written, the
    old one may still be on disk (its deletion queued); the arbiter must not read it as the
    newcomer's usage, nor keep it mapped after."""
    from gpufrac.agent.arbiter.service import Arbiter
    from gpufrac.agent.metrics.registry import Metrics
    from gpufrac.agent.processes.callers import PeerLookup

    queued: list[tuple[str, object]] = []
    # The agent's release queues the deletion (ContainerDirs.discard): here it is not run yet.
    ledger = Ledger(make_config(tmp_path), make_inventory(), retire=lambda d, h: queued.append((d, h)))
    arb = Arbiter(
        ledger.config,
        ledger,
        PeerLookup(ledger, lambda uid, cid: None),
        str(tmp_path / "a.sock"),
        metrics=Metrics(),
    )
    devs = ids(ledger, 0, MEMORY, range(2))
    old = ledger.allocate(MEMORY, devs)
    abi.UsageFile(old.directory).usage.total_used = 3 * GiB  # what the old container held
    ledger.release(old.key)
    new = ledger.reserve(MEMORY, devs)
    assert new.key == old.key and abi.read_usage(new.directory).total_used == 3 * GiB  # still there
    assert arb.resolution.used(new) is None  # unknown (counted as all it may use), not the old 3 GiB
    retire_container_dir(*queued.pop())  # type: ignore[arg-type]
    ledger.attach(new.key, write_container_dir(new.directory, new.config))
    assert arb.resolution.used(new) == 0


def test_a_release_that_cannot_be_cleaned_up_does_not_stop_the_others(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from gpufrac.agent.booking.container_dirs import ContainerDirs

    state = tmp_path / "state"
    containers = state / "containers"
    cfg = abi.ContainerConfig(gpu_uuid="GPU-a", request_bytes=GiB, limit_bytes=GiB)

    class Stuck:  # a mapping that cannot be closed (exported buffers)
        def close(self) -> None:
            raise BufferError("cannot close exported pointers exist")

    async def scenario() -> None:
        dirs = ContainerDirs(str(containers), str(state), spares=0)
        await dirs.start()
        for name in ("m-a", "m-b", "m-c"):
            (await dirs.write(str(containers / name), cfg)).close()
        dirs.discard(str(containers / "m-a"))
        dirs.discard(str(containers / "m-b"), Stuck())  # type: ignore[arg-type]
        dirs.discard(str(containers / "m-c"))  # the same job as the two before
        await dirs.close()

    asyncio.run(scenario())
    assert os.listdir(containers) == ["m-b"]
    assert "m-b" in caplog.text and "exported" in caplog.text


def test_a_config_an_agent_left_mid_write_is_repaired_in_the_same_file(tmp_path: Path) -> None:
    """A kill -9 during a config write leaves seq odd. The running container has that inode
    bind-mounted: recovery must finish the write in it, not put a new file beside it."""
    directory = str(tmp_path / "m-1")
    handle = write_container_dir(directory, abi.ContainerConfig("GPU-a", GiB, GiB))
    path = os.path.join(directory, abi.CONFIG_FILE)
    mounted = os.open(path, os.O_RDONLY)  # what the container holds
    try:
        handle._s.seq |= 1  # the killed agent's write: begun, never ended
        handle._s.limit_bytes = 3 * GiB
        handle.close()
        with pytest.raises(abi.FormatError, match="never completed"):
            abi.read_config(directory)
        write_container_dir(directory, abi.ContainerConfig("GPU-a", GiB, 2 * GiB)).close()
        assert os.fstat(mounted).st_nlink == 1 and os.fstat(mounted).st_ino == os.stat(path).st_ino
    finally:
        os.close(mounted)
    assert abi.read_config(directory).limit_bytes == 2 * GiB


def test_a_reader_waits_out_a_write_its_writer_was_preempted_in(tmp_path: Path) -> None:
    """On a busy node the agent's writer can be descheduled between the two seq increments
    for longer than a reader's spins: the reader (the CLI, a test, recovery) must wait for
    the write to end, not report a broken file."""
    directory = str(tmp_path / "m-1")
    handle = write_container_dir(directory, abi.ContainerConfig("GPU-a", GiB, GiB))
    try:
        handle._s.seq |= 1  # a write begun ...
        handle._s.limit_bytes = 3 * GiB

        def finish() -> None:
            time.sleep(0.05)  # ... and finished 50 ms later
            handle._s.seq += 1

        writer = threading.Thread(target=finish)
        writer.start()
        assert abi.read_config(directory).limit_bytes == 3 * GiB
        writer.join()
    finally:
        handle.close()


def test_a_limit_set_while_the_directory_is_being_written_reaches_the_file(ledger: Ledger) -> None:
    """Identity may apply a pod's limit while the directory thread writes a rebuilt
    container's files with the config it was given: attach() publishes the newer one."""
    alloc = ledger.reserve(MEMORY, ids(ledger, 0, MEMORY, range(2)))
    handle = write_container_dir(alloc.directory, alloc.config)  # in the thread, meanwhile:
    ledger.update_config(alloc.key, limit_bytes=6 * GiB)
    ledger.attach(alloc.key, handle)
    assert abi.read_config(alloc.directory).limit_bytes == 6 * GiB
