"""Persistence of the allocation ledger: <state_dir>/state.json.

Written after bookings, releases, identity and limit changes (batched over
PERSIST_BATCH; grants alone are not saved: recovery reads them back from the config
files), by atomic replace (tmp + fsync + rename + fsync of the directory), so a
kill -9 at any moment leaves either the old or the new file.
A file that cannot be read or parsed is reported, moved aside
(state.json.corrupt-<timestamp>) and the ledger is rebuilt from pod-resources.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from gpufrac.agent.booking.ledger import ContainerAlloc, Ledger
from gpufrac.core.claims import ClaimRef
from gpufrac.core.errors import AllocationError
from gpufrac.memguard.abi import ContainerConfig

log = logging.getLogger(__name__)

STATE_VERSION = 1
STATE_FILE = "state.json"


class StateError(Exception):
    """The state file exists but cannot be used."""


# ContainerConfig is flat (str and int fields): reading them directly is ~20x cheaper than
# dataclasses.asdict's recursive copy, and encode runs on the loop after every change.
_CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(ContainerConfig))


def encode(ledger: Ledger, cache: EntryCache | None = None) -> dict[str, Any]:
    entry = _entry if cache is None else cache.entry
    allocations = [entry(a) for a in ledger.containers()]
    if cache is not None:
        cache.keep({a["key"] for a in allocations})
    return {"version": STATE_VERSION, "written": time.time(), "allocations": allocations}


class EntryCache:
    """Each booking's encoded entry, made again only when the booking changed. A save encodes
    every booking on the loop; under a stream of prepares (one save per batch) and unprepares
    (one save each) that is O(bookings) per claim, most of it entries that did not change.
    The ledger replaces a booking's config on every change (update_config), never edits it,
    so the config object's identity tells whether it changed."""

    def __init__(self) -> None:
        self._entries: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {}

    def entry(self, a: ContainerAlloc) -> dict[str, Any]:
        # Everything _entry reads; the config compared by identity first (tuple equality does).
        signature = (
            a.config,
            a.resource,
            a.device_ids,
            a.created,
            a.namespace,
            a.pod,
            a.container,
            a.pod_uid,
            a.claim,
            a.consumers,
        )
        kept = self._entries.get(a.key)
        if kept is not None and kept[0] == signature:
            return kept[1]
        entry = _entry(a)  # never changed once made: a save's thread may be encoding it
        self._entries[a.key] = (signature, entry)
        return entry

    def keep(self, keys: set[str]) -> None:
        """Forget the entries of bookings no longer in the ledger."""
        if len(self._entries) > len(keys):
            self._entries = {k: v for k, v in self._entries.items() if k in keys}


def _entry(a: ContainerAlloc) -> dict[str, Any]:
    entry = {
        "key": a.key,
        "resource": a.resource,
        "device_ids": list(a.device_ids),
        "created": a.created,
        "namespace": a.namespace,
        "pod": a.pod,
        "container": a.container,
        "pod_uid": a.pod_uid,
        "config": {name: getattr(a.config, name) for name in _CONFIG_FIELDS},
    }
    if a.claim is not None:  # a DRA claim's booking (an older agent skips these fields)
        entry["claim"] = {"namespace": a.claim.namespace, "name": a.claim.name, "uid": a.claim.uid}
        entry["consumers"] = sorted([uid, name] for uid, name in a.consumers)
    return entry


def write_atomic(path: Path, data: dict[str, Any], *, sync: bool = True, tmp: Path | None = None) -> None:
    """Replace `path` with `data` as JSON (through `tmp`, by default <path>.tmp). `sync`: the file
    and the rename reach the disk before it returns (a node crash keeps them); without it they
    survive the agent's own death (kill -9: the kernel has them), not a crash of the node."""
    tmp = _write_tmp(path, data, sync=sync, tmp=tmp)
    os.replace(tmp, path)
    if sync:
        _sync_dir(path)


def _write_tmp(path: Path, data: dict[str, Any], *, sync: bool, tmp: Path | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp or path.with_name(path.name + ".tmp")
    # json.dumps, not json.dump: dump streams through the pure-Python encoder, dumps uses the
    # C one (~10x faster), and this thread holds the GIL the agent's loop needs meanwhile.
    text = json.dumps(data, separators=(",", ":"))
    with open(tmp, "w") as f:
        f.write(text)
        if sync:
            f.flush()
            os.fsync(f.fileno())
    return tmp


def _sync_dir(path: Path) -> None:
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)  # the rename itself survives a crash
    finally:
        os.close(dfd)


def read(path: Path) -> list[dict[str, Any]] | None:
    """The persisted allocations; None when there is no state file. Raises StateError."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise StateError(f"cannot read {path}: {e.strerror}") from e
    try:
        data = json.loads(text)
    except ValueError as e:
        raise StateError(f"{path} is not valid JSON ({e})") from e
    if not isinstance(data, dict) or data.get("version") != STATE_VERSION:
        version = data.get("version") if isinstance(data, dict) else None
        raise StateError(f"{path}: state version {version!r}, this agent reads version {STATE_VERSION}")
    allocs = data.get("allocations")
    if not isinstance(allocs, list) or not all(isinstance(a, dict) for a in allocs):
        raise StateError(f"{path}: 'allocations' is not a list of objects")
    return allocs


def restore(ledger: Ledger, entries: list[dict[str, Any]]) -> list[ContainerAlloc]:
    """Book persisted allocations again (health is not re-checked: they already exist).

    An entry that no longer fits this node (GPU gone, overlapping another) is
    reported and skipped; pod-resources reconciliation decides what is real."""
    out = []
    for e in entries:
        try:
            # Fields this agent does not know (written by a newer one) are dropped.
            cfg = ContainerConfig(**{k: v for k, v in e["config"].items() if k in _CONFIG_FIELDS})
            claim = _claim(e.get("claim"))
            alloc = ledger.reserve(
                e["resource"],
                list(e["device_ids"]),
                ignore_health=True,
                config=cfg,
                created=float(e["created"]),
                claim=claim,
            )
            if claim is not None:
                alloc.consumers = frozenset((str(uid), str(name)) for uid, name in e.get("consumers") or [])
        except (AllocationError, AttributeError, KeyError, TypeError, ValueError) as err:
            reason = err.message if isinstance(err, AllocationError) else f"malformed entry ({err!r})"
            log.error("state: dropping allocation %s: %s", e.get("key", "?"), reason)
            continue
        alloc.namespace, alloc.pod = e.get("namespace"), e.get("pod")
        alloc.container, alloc.pod_uid = e.get("container"), e.get("pod_uid")
        out.append(alloc)
    return out


def _claim(raw: Any) -> ClaimRef | None:
    """A claim's identity as encode wrote it; ValueError when it is not one."""
    if raw is None:
        return None
    ref = ClaimRef(str(raw["namespace"]), str(raw["name"]), str(raw["uid"]))
    if not (ref.namespace and ref.name and ref.uid):
        raise ValueError(f"claim {raw!r} lacks its namespace, name or uid")
    return ref


# A claim's own record, in its directory: what the state file says of it, written before the
# kubelet has its answer (gpufrac.agent.booking.claims), so an agent killed before the next state save
# finds it there (restore_claim_records).
CLAIM_RECORD = "claim.json"


def write_claim_record(alloc: ContainerAlloc) -> None:
    """Write a claim booking's record into its directory (temporary file + rename: whole or
    absent). Not synced: it survives the agent's death; a node crash ends the claim's
    containers, and the restarted kubelet prepares the claim again. Small: the agent writes it
    on its loop, as it renames a spare directory into place."""
    path = Path(alloc.directory) / CLAIM_RECORD
    tmp = path.with_name(CLAIM_RECORD + ".tmp")
    tmp.write_text(json.dumps({"version": STATE_VERSION, "allocation": _entry(alloc)}, separators=(",", ":")))
    os.replace(tmp, path)


def read_claim_records(containers_dir: str) -> list[dict[str, Any]]:
    """The claim records in the containers' directories (blocking: a directory scan); a record
    that cannot be read is reported and skipped."""
    out: list[dict[str, Any]] = []
    try:
        names = os.listdir(containers_dir)
    except FileNotFoundError:
        return out
    for name in names:
        path = Path(containers_dir) / name / CLAIM_RECORD
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as e:
            log.error("claim record %s unreadable (%s): skipped", path, e)
            continue
        entry = data.get("allocation") if isinstance(data, dict) else None
        if data.get("version") != STATE_VERSION or not isinstance(entry, dict) or not entry.get("claim"):
            log.error("claim record %s is not one this agent reads: skipped", path)
            continue
        out.append(entry)
    return out


def restore_claim_records(ledger: Ledger, entries: list[dict[str, Any]]) -> list[ContainerAlloc]:
    """Book the claims whose records the state file lacks (their prepare answered after its
    last save); the state file's own entries win."""
    missing = [
        e
        for e in entries
        if isinstance(e.get("claim"), dict) and ledger.by_claim(str(e["claim"].get("uid"))) is None
    ]
    return restore(ledger, missing)


class StateStore:
    def __init__(self, state_dir: str) -> None:
        self.path = Path(state_dir) / STATE_FILE
        # Saves are numbered as they are encoded (on the loop, in order) and written side by side,
        # each to a file of its own: one that must not wait (the DRA driver's, not synced) never
        # queues behind another's fsync. Only a save newer than the file's replaces it.
        self._encoded = 0
        self._renamed = 0
        self._rename = threading.Lock()
        self._entries = EntryCache()

    def load(self) -> list[dict[str, Any]] | None:
        """Persisted entries, or None (no file, or a corrupt one moved aside and reported)."""
        try:
            return read(self.path)
        except StateError as e:
            aside = self.path.with_name(f"{self.path.name}.corrupt-{time.strftime('%Y%m%dT%H%M%S')}")
            try:
                os.replace(self.path, aside)
                where = f"moved aside to {aside}"
            except OSError as mv:
                where = f"could not move it aside ({mv.strerror})"
            log.error("state file corrupt: %s; %s; rebuilding allocations from pod-resources", e, where)
            return None

    async def save(self, ledger: Ledger, *, sync: bool = True) -> None:
        """Write what the ledger holds now (its snapshot taken at once, on the loop); the file
        never goes back to an older snapshot than one written before."""
        self._encoded += 1
        seq, data = self._encoded, encode(ledger, self._entries)
        await asyncio.to_thread(self._write, seq, data, sync)

    def _write(self, seq: int, data: dict[str, Any], sync: bool) -> None:
        tmp = _write_tmp(self.path, data, sync=sync, tmp=self.path.with_name(f"{self.path.name}.tmp{seq}"))
        with self._rename:
            newer = seq < self._renamed
            if newer:  # a newer snapshot is in place already (one not synced, maybe)
                os.unlink(tmp)
            else:
                os.replace(tmp, self.path)
                self._renamed = seq
        if sync:
            if newer:  # what was asked is that the file on disk be at least this new
                fd = os.open(self.path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            _sync_dir(self.path)
