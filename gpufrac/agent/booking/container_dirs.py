"""Container directories on the host: the files of one container's memguard config and usage.

The ledger (gpufrac.agent.booking.ledger) decides what is booked; this module writes and deletes
what that means on disk. ContainerDirs is the agent's one I/O thread for it (docs/architecture.md):
off the event loop, in the order the loop asks.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

from gpufrac.memguard import abi
from gpufrac.memguard.abi import ConfigFile, ContainerConfig

log = logging.getLogger(__name__)

# Container directories kept ready for Allocate (ContainerDirs); enough for a burst of
# admissions while the I/O thread makes more.
SPARE_DIRS = 8
# After spares could not be made, Allocate creates directories itself for this long.
SPARE_RETRY = 30.0
_T = TypeVar("_T")


def write_container_dir(directory: str, cfg: ContainerConfig) -> ConfigFile:
    """Create (or repair) a container's host directory: config (0644) and usage files, and
    the directory of its arbiter socket (gpufrac.agent.arbiter.listeners binds it there).

    Blocking file I/O: the agent runs it in a worker thread. No fsync: after a crash
    the agent rewrites every booked container's files from its state and the
    kubelet's record, so durability here would only add latency to Allocate."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o755)
    _socket_dir(directory)
    # Headers only: a config an agent killed mid-write left with an odd seq is repaired in
    # place by ConfigFile.write. A new file would be a new inode, and a running container
    # keeps the old one mounted: the shim would never see a config again.
    for name, check in ((abi.CONFIG_FILE, abi.generation), (abi.USAGE_FILE, abi.read_usage)):
        if os.path.exists(os.path.join(directory, name)):
            try:
                check(directory)
            except abi.FormatError as e:  # truncated or foreign: start it afresh
                log.warning("recreating %s: %s", os.path.join(directory, name), e)
                os.unlink(os.path.join(directory, name))
    handle = ConfigFile(directory, durable=False)
    handle.write(cfg)
    abi.create_usage(directory, durable=False)
    abi.create_compute(directory, durable=False)
    return handle


def _socket_dir(directory: str) -> None:
    """The directory the device plugin mounts for the container's arbiter socket: it must be
    there before the runtime mounts it. 0755: container processes run as any uid."""
    path = os.path.join(directory, abi.SOCKET_DIR)
    os.makedirs(path, exist_ok=True)
    os.chmod(path, 0o755)


def retire_container_dir(directory: str, handle: ConfigFile | None) -> None:
    """A released container's files: its config unmapped, its directory deleted."""
    if handle is not None:
        handle.close()
    shutil.rmtree(directory, ignore_errors=True)


def _retire_all(batch: list[tuple[str, ConfigFile | None]]) -> None:
    for directory, handle in batch:
        try:
            retire_container_dir(directory, handle)
        except Exception as e:  # the rest of the batch still goes
            log.warning("cannot remove the files of released container %s: %s", directory, e)


def prepare_spare(directory: str) -> ConfigFile:
    """An empty container directory, made ahead of time: config and usage files with their
    headers and nothing booked, the config already mapped. Creating directories and files is
    most of Allocate's cost on a busy node (journalled metadata, ~2 ms); Allocate then only
    renames a spare into place (a mapping follows its file through a rename)."""
    os.mkdir(directory)  # a fresh name: never an existing directory
    os.chmod(directory, 0o755)
    _socket_dir(directory)
    abi.create_unpublished(directory)
    return ConfigFile(directory, durable=False)


def claim_spare(spare: str, handle: ConfigFile, directory: str, cfg: ContainerConfig) -> None:
    """Move a prepared spare to `directory` and publish the container's config in it.
    OSError when `directory` exists with files in it: a container's files are never replaced."""
    os.rename(spare, directory)
    handle.moved(directory)
    handle.write(cfg)


class ContainerDirs:
    """The agent's file I/O on container directories: off its loop, and in order.

    One worker thread does the writing and deleting, in the order the loop asks for it,
    so a directory released and booked again under the same key is deleted before it is
    written, and a sweep never deletes a directory booked after it listed them.

    Allocate's path is short: spares made ahead of time in that thread, their configs
    already mapped, are renamed into place on the loop (a rename and a config write, no
    thread round trip on the kubelet's critical path). A release costs the loop nothing but
    a queued job: the thread unmaps the config and deletes the directory. A key booked
    again before that job ran gets its directory written behind it, in order, not a spare
    renamed onto the old one; until then the old files are still at the path, so readers
    wait for Ledger.attached()."""

    def __init__(self, containers_dir: str, state_dir: str, spares: int = SPARE_DIRS) -> None:
        self.root = containers_dir
        self._spare_root = os.path.join(state_dir, "spare")
        self._target = spares
        self._io = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="gpufrac-dirs")
        self._spares: list[tuple[str, ConfigFile]] = []  # directory, its mapped config
        self._making = 0
        self._seq = 0
        self._removing: dict[str, int] = {}  # container directory -> removals queued for it
        # Released this loop turn, for the thread's next job: one wake-up of the thread for a
        # reconcile's worth of releases, not one each (each costs the loop a GIL hand-off).
        self._retiring: list[tuple[str, ConfigFile | None]] = []
        self._spare_failed_at: float | None = None
        self._closed = False

    async def _call(self, fn: Callable[..., _T], *args: object) -> _T:
        self._retire_queued()  # deletions asked for earlier run first
        return await asyncio.get_running_loop().run_in_executor(self._io, fn, *args)

    async def start(self) -> None:
        """Leftovers of an earlier run (spares, an old trash folder) go; spares are made."""
        await self._call(self._reset)
        self.refill()

    def _reset(self) -> None:
        os.makedirs(self.root, exist_ok=True)
        shutil.rmtree(self._spare_root, ignore_errors=True)
        os.makedirs(self._spare_root, exist_ok=True)
        # A node upgraded from an agent that parked released directories in state/trash
        # may still have that folder; nothing uses it now.
        shutil.rmtree(os.path.join(os.path.dirname(self._spare_root), "trash"), ignore_errors=True)

    async def close(self) -> None:
        self._retire_queued()
        self._closed = True
        await asyncio.to_thread(self._io.shutdown)  # queued deletions finish
        for _, handle in self._spares:
            handle.close()
        self._spares.clear()

    async def write(self, directory: str, cfg: ContainerConfig) -> ConfigFile:
        """Create or repair a container's directory (write_container_dir), in order."""
        return await self._call(write_container_dir, directory, cfg)

    async def create(self, directory: str, cfg: ContainerConfig) -> ConfigFile:
        """A new container's directory: a spare renamed into place when one is ready,
        otherwise write()."""
        if self._spares and directory not in self._removing:
            spare, handle = self._spares.pop()
            try:
                claim_spare(spare, handle, directory, cfg)
            except OSError as e:
                log.debug("spare %s not used for %s: %s", spare, directory, e)
                if os.path.isdir(spare):
                    self._spares.append((spare, handle))
                else:
                    handle.close()
            else:
                self.refill()
                return handle
        self.refill()
        return await self.write(directory, cfg)

    def refill(self) -> None:
        """Queue spares until `spares` are ready or being made (not for a while after a failure)."""
        if self._spare_failed_at is not None and time.monotonic() - self._spare_failed_at < SPARE_RETRY:
            return
        loop = asyncio.get_running_loop()
        while len(self._spares) + self._making < self._target:
            self._seq += 1
            path = os.path.join(self._spare_root, str(self._seq))
            self._making += 1
            loop.run_in_executor(self._io, prepare_spare, path).add_done_callback(
                functools.partial(self._spare_made, path)
            )

    def _spare_made(self, path: str, fut: asyncio.Future[ConfigFile]) -> None:
        self._making -= 1
        if fut.cancelled():
            return
        e = fut.exception()
        if e is not None:
            if self._spare_failed_at is None:
                log.warning("cannot prepare container directories in %s (%s): Allocate creates them", path, e)
            self._spare_failed_at = time.monotonic()
            return
        self._spare_failed_at = None
        if self._closed:
            fut.result().close()
        else:
            self._spares.append((path, fut.result()))

    def discard(self, directory: str, handle: ConfigFile | None = None) -> None:
        """Let go of a container's files in the thread: unmap its config, delete its directory.
        Until that is done, no spare is renamed onto the directory (create() writes it in order)."""
        self._removing[directory] = self._removing.get(directory, 0) + 1
        if not self._retiring:
            asyncio.get_running_loop().call_soon(self._retire_queued)
        self._retiring.append((directory, handle))

    def _retire_queued(self) -> None:
        if not self._retiring:
            return
        batch, self._retiring = self._retiring, []
        done = functools.partial(self._removed, [d for d, _ in batch])
        try:
            fut = asyncio.get_running_loop().run_in_executor(self._io, _retire_all, batch)
        except RuntimeError:  # released after close(): the thread is gone
            _retire_all(batch)
            done(None)
        else:
            fut.add_done_callback(done)

    def _removed(self, directories: list[str], fut: asyncio.Future[None] | None) -> None:
        for directory in directories:
            left = self._removing.pop(directory, 1) - 1
            if left > 0:
                self._removing[directory] = left

    async def sweep(self, booked: Callable[[], Iterable[str]]) -> None:
        """Delete the directories of containers not booked. `booked` is read after the
        listing, so a directory created meanwhile is never taken for an orphan."""
        try:
            names = await self._call(os.listdir, self.root)
        except FileNotFoundError:
            return
        keep = set(booked())
        for name in names:
            if name not in keep:
                log.info("removing directory of gone container %s", name)
                self.discard(os.path.join(self.root, name))
