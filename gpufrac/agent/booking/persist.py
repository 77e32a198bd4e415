"""The ledger's state file, following the ledger in batches.

Every booking, release, identity or limit change moves the ledger's state_generation;
the Persister, one of its listeners, marks the state dirty and its loop
saves once per batch. Runs on the agent's event loop.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Generic, Protocol, TypeVar

log = logging.getLogger("gpufrac.agent")

# Changes within this long of the first are saved to the state file together. Under pod
# churn every admission and release changes the ledger; a save per change (encode, write,
# fsync) cost the agent about as much CPU as the admissions themselves. What a kill -9
# loses from this window, recovery rebuilds from pod-resources and the config files.
PERSIST_BATCH = 0.1


class Versioned(Protocol):
    """The ledger as far as saving goes (gpufrac.agent.booking.ledger.Ledger): a counter that
    moves whenever what the state file holds changes."""

    @property
    def state_generation(self) -> int: ...


L = TypeVar("L", bound=Versioned)
L_contra = TypeVar("L_contra", bound=Versioned, contravariant=True)


class StateFile(Protocol[L_contra]):
    """Where the ledger is saved (gpufrac.agent.booking.ledger_store.StateStore)."""

    @property
    def path(self) -> Path: ...

    async def save(self, ledger: L_contra, *, sync: bool = True) -> None: ...


class Persister(Generic[L]):
    """Saves `ledger` to `store` at most once per PERSIST_BATCH after it changed; a failed
    save is logged and tried again a second later."""

    def __init__(self, ledger: L, store: StateFile[L]) -> None:
        self.ledger = ledger
        self.store = store
        self._saved_generation = -1  # the ledger's state_generation the last save request saw
        self._written = -1  # the state_generation the file is known to hold at least
        self._saving: asyncio.Future[None] | None = None
        self._dirty = asyncio.Event()

    def changed(self) -> None:
        """The ledger's listener: only a change of what the state file holds marks it dirty
        (a grant alone does not)."""
        if self.ledger.state_generation != self._saved_generation:
            self._saved_generation = self.ledger.state_generation
            self._dirty.set()

    async def flush(self) -> None:
        """Save now, not at the end of the batch, and return once the file holds what the
        ledger held when called (the DRA driver's releases: an unprepare, a claim check).
        Callers meanwhile share one save. Not synced to disk (the batched saves are): the file
        survives the agent's death, kill -9 included. Raises OSError."""
        want = self.ledger.state_generation
        while self._written < want:
            if self._saving is None or self._saving.done():
                self._saving = asyncio.ensure_future(self._save(sync=False))
            await asyncio.shield(self._saving)

    async def _save(self, *, sync: bool = True) -> None:
        generation = self.ledger.state_generation
        await self.store.save(self.ledger, sync=sync)
        self._written = max(self._written, generation)

    async def run(self) -> None:
        while True:
            await self._dirty.wait()
            await asyncio.sleep(PERSIST_BATCH)
            self._dirty.clear()
            try:
                await self._save()
            except OSError as e:
                log.error("cannot write state file %s: %s", self.store.path, e)
                await asyncio.sleep(1.0)
                self._dirty.set()
