"""NodeLabeler: the agent's gpufrac.dev/ labels on its own Node (gpufrac.agent.gpu.nodelabels
decides them), patched from a worker thread; no other label is ever touched."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping

from kubernetes import client

from gpufrac.agent.kube.podcache import decode

log = logging.getLogger(__name__)


class NodeLabeler:
    """Keeps a set of labels on this agent's Node as the agent last asked (update()).

    update() is called on the agent's loop and returns at once; one task applies the
    newest wish in a worker thread, so a burst of changes costs one PATCH. The first sync
    reads the Node and removes labels of `owned` that are no longer wished for (left by an
    earlier run of the agent); later syncs send only what changed. Labels outside `owned` are never
    touched. A failed call is logged, counted and retried with backoff until it lands.
    """

    def __init__(
        self,
        api: client.ApiClient,
        node_name: str,
        owned: frozenset[str],
        *,
        request_timeout: float = 10.0,
        backoff: tuple[float, float] = (1.0, 60.0),
    ) -> None:
        self._v1 = client.CoreV1Api(api)
        self.node_name = node_name
        self.owned = owned
        self._request_timeout = request_timeout
        self._backoff = backoff
        self._wanted: dict[str, str] | None = None
        self._applied: dict[str, str] | None = None  # None: the Node has not been read yet
        self._task: asyncio.Task[None] | None = None
        self._kick = asyncio.Event()
        # Counters (read by tests).
        self.patches = 0
        self.errors = 0

    @property
    def applied(self) -> dict[str, str] | None:
        return None if self._applied is None else dict(self._applied)

    def update(self, labels: Mapping[str, str]) -> None:
        """Wish for exactly these owned labels (others of `owned` are removed); never blocks."""
        unknown = set(labels) - self.owned
        if unknown:
            raise ValueError(f"labels {sorted(unknown)} are not owned by this labeler")
        self._wanted = dict(labels)
        self._kick.set()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="node-labels")

    async def settled(self, timeout: float | None = None) -> bool:
        """True once the Node carries the last wish (tests, shutdown)."""

        async def wait() -> None:
            while self._wanted is not None and self._applied != self._wanted:
                await asyncio.sleep(0.05)

        try:
            await asyncio.wait_for(wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        failures = 0
        while True:
            self._kick.clear()
            wanted = self._wanted
            if wanted is None or wanted == self._applied:
                await self._kick.wait()
                continue
            try:
                if self._applied is None:
                    self._applied = await asyncio.to_thread(self._read)
                if wanted != self._applied:
                    await asyncio.to_thread(self._patch, self._changes(wanted, self._applied))
                    self._applied = dict(wanted)
                failures = 0
            except Exception as e:
                failures += 1
                self.errors += 1
                status = getattr(e, "status", None)
                log.warning(
                    "labelling node %s failed: %s",
                    self.node_name,
                    f"{status} {getattr(e, 'reason', '')}".strip() if status else e,
                )
                delay = min(self._backoff[1], self._backoff[0] * 2 ** (failures - 1))
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._kick.wait(), delay)

    def _read(self) -> dict[str, str]:
        """The owned labels the Node carries now."""
        node = decode(
            self._v1.read_node(self.node_name, _preload_content=False, _request_timeout=self._request_timeout)
        )
        labels = (node.get("metadata") or {}).get("labels") or {}
        return {k: v for k, v in labels.items() if k in self.owned}

    def _changes(self, wanted: Mapping[str, str], have: Mapping[str, str]) -> dict[str, str | None]:
        changes: dict[str, str | None] = {k: v for k, v in wanted.items() if have.get(k) != v}
        changes.update({k: None for k in have if k not in wanted})  # None removes a label
        return changes

    def _patch(self, changes: Mapping[str, str | None]) -> None:
        # A merge patch of metadata.labels: the Node's other labels stay as they are.
        self._v1.patch_node(
            self.node_name,
            {"metadata": {"labels": dict(changes)}},
            _request_timeout=self._request_timeout,
            _content_type="application/merge-patch+json",
        )
        self.patches += 1
        log.info(
            "node %s labels: %s",
            self.node_name,
            ", ".join(f"{k}={v}" if v is not None else f"-{k}" for k, v in sorted(changes.items())),
        )
