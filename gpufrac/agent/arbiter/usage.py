"""The arbiter's reads of each container's files: its usage (what its shim counts) and its
config's generation (what a reply names).

A usage file belongs to the container, which can write, truncate or replace it: it is read
by pread on a kept fd, never mapped (a truncated mapping is SIGBUS), validated, and a file
that cannot be used is counted as unknown and logged once per container and kind of fault
every USAGE_WARN_EVERY (a tenant flipping its header between good and bad must not write
the agent's log for it). The config file is the agent's
own: its generation is read from a kept read-only mapping (per request).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import re
import sys
import time
from collections.abc import Callable
from typing import Protocol

from gpufrac.agent.booking.ledger import ContainerAlloc
from gpufrac.memguard import abi
from gpufrac.memguard.abi import FormatError

log = logging.getLogger(__name__)

_GEN_OFFSET = abi.ConfigStruct.generation.offset
USAGE_WARN_EVERY = 3600.0  # seconds between two warnings of one container's same fault
_NUMBERS = re.compile(r"0x[0-9a-fA-F]+|\d+")


class Booked(Protocol):
    """Which containers are booked, and whether their files are written
    (gpufrac.agent.booking.ledger.Ledger)."""

    def get(self, key: str) -> ContainerAlloc | None: ...
    def attached(self, key: str) -> bool: ...


class ContainerFiles:
    """Kept handles on the usage and config files of booked containers."""

    def __init__(self, ledger: Booked) -> None:
        self._ledger = ledger
        self._usage: dict[str, int] = {}  # container key -> an fd on its usage file (read by pread)
        self._config_maps: dict[str, mmap.mmap] = {}
        # key -> kind of fault of its usage file (the message, numbers left out: the tenant
        # writes them) -> time.monotonic() of its last warning
        self._warned: dict[str, dict[str, float]] = {}

    def _usage_fd(self, alloc: ContainerAlloc) -> int | None:
        fd = self._usage.get(alloc.key)
        if fd is None:
            if not self._ledger.attached(alloc.key):
                return None  # not written yet: the path may hold a released container's file
            try:
                fd = os.open(
                    os.path.join(alloc.directory, abi.USAGE_FILE),
                    os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK,
                )
            except OSError as e:
                self._usage_bad(alloc, f"cannot open it: {e.strerror}")
                return None
            self._usage[alloc.key] = fd
        return fd

    def _usage_bad(self, alloc: ContainerAlloc, why: str) -> None:
        """A usage file the agent cannot use: logged once per container and kind of fault per
        USAGE_WARN_EVERY, whether or not it read well in between."""
        kind = _NUMBERS.sub("N", why)
        warned = self._warned.setdefault(alloc.key, {})
        now = time.monotonic()
        last = warned.get(kind)
        if last is not None and now - last < USAGE_WARN_EVERY:
            return
        warned[kind] = now
        log.warning("usage file of %s is unusable (%s): its own bursts are refused until the shim "
                    "rewrites it; others are not affected (said once an hour)", alloc.who(), why)  # fmt: skip

    def usage_of(self, alloc: ContainerAlloc) -> abi.UsageStruct | None:
        """A validated copy of the container's usage file; None when unusable."""
        fd = self._usage_fd(alloc)
        if fd is None:
            return None
        try:
            out = abi.parse_usage(os.pread(fd, abi.USAGE_SIZE, 0), "usage file")
        except (OSError, FormatError) as e:
            self._usage_bad(alloc, str(e.strerror if isinstance(e, OSError) else e))
            return None
        return out

    def file_used(self, alloc: ContainerAlloc) -> int | None:
        """The usage file's total_used, validated and clamped (header only: per request)."""
        fd = self._usage_fd(alloc)
        if fd is None:
            return None
        try:
            # One pread per request: a file cut short reads short (no SIGBUS, unlike a mapping).
            return abi.parse_usage_total(os.pread(fd, abi.USAGE_HEADER.size, 0))
        except (OSError, FormatError) as e:
            self._usage_bad(alloc, str(e.strerror if isinstance(e, OSError) else e))
            return None

    def generation(self, alloc: ContainerAlloc) -> int:
        """The config generation a reply names (read from a kept mapping: per request)."""
        mm = self._config_maps.get(alloc.key)
        if mm is None:
            if not self._ledger.attached(alloc.key):
                return 0  # as for usage_of: no file of this booking to read yet
            try:
                with open(os.path.join(alloc.directory, abi.CONFIG_FILE), "rb") as f:
                    mm = self._config_maps[alloc.key] = mmap.mmap(
                        f.fileno(), ctypes.sizeof(abi.ConfigStruct), access=mmap.ACCESS_READ
                    )
            except (OSError, ValueError):
                return 0
        return int.from_bytes(mm[_GEN_OFFSET : _GEN_OFFSET + 8], sys.byteorder)

    def reap_all(self, alloc: ContainerAlloc) -> None:
        """Free the slots of a container with no process left (written by pwrite, never mapped)."""
        u = self.usage_of(alloc)
        if u is None:
            return
        total = int(u.total_used)
        writes: list[tuple[str, int, int]] = []
        for i, s in enumerate(u.slots):
            if s.pid > 0:
                total = max(0, total - int(s.used_bytes))
                # -1 first: being reaped (the shim's own convention), then the counters, then free.
                writes += [("pid", i, -1), ("total_used", -1, total), ("used_bytes", i, 0), ("pid", i, 0)]
        if writes:
            with contextlib.suppress(FormatError):
                abi.write_usage_fields(alloc.directory, writes)

    def forget_released(self, gone: Callable[[str], None]) -> None:
        """Close the handles of containers no longer booked; `gone(key)` for each usage handle
        closed (so that other per-container state goes with it). Only the handles kept here
        are looked up (a release loop must not cost O(n²))."""
        booked = self._ledger.get
        for key in [k for k in self._config_maps if booked(k) is None]:
            self._config_maps.pop(key).close()
        for key in [k for k in self._usage if booked(k) is None]:
            os.close(self._usage.pop(key))
            gone(key)
        for key in [k for k in self._warned if booked(k) is None]:
            del self._warned[key]

    def close(self) -> None:
        for fd in self._usage.values():
            os.close(fd)
        self._usage.clear()
        for mm in self._config_maps.values():
            mm.close()
        self._config_maps.clear()
