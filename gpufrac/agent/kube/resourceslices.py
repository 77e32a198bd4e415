"""SlicePublisher: the node's ResourceSlice kept as the DRA driver last described it.

update() is called on the agent's loop with the wanted slice (gpufrac.agent.gpu.dra_devices
builds it) and returns at once; one task makes the apiserver hold it, in worker threads: it
creates the slice, replaces it when its devices differ (the pool's generation moves with
every change, so the scheduler takes the newest), and reads it back every `check_interval`:
the kubelet deletes its node's ResourceSlices when it starts (and a driver's some time after
the driver's last plugin went away), and a slice found gone is published again. The first
pass deletes other slices of this driver on this node (left by an older agent under
another name). A failed call is logged, counted and retried with backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from gpufrac.agent.kube.podcache import decode

log = logging.getLogger(__name__)


class SlicePublisher:
    """Keeps one ResourceSlice of `driver` on `node` as last asked (update())."""

    def __init__(
        self,
        api: client.ApiClient,
        node: str,
        driver: str,
        *,
        check_interval: float = 10.0,
        request_timeout: float = 10.0,
        backoff: tuple[float, float] = (0.5, 30.0),
    ) -> None:
        self._api = client.ResourceV1Api(api)
        self.node = node
        self.driver = driver
        self.check_interval = check_interval
        self._request_timeout = request_timeout
        self._backoff = backoff
        self._wanted: dict[str, Any] | None = None
        self._applied: dict[str, Any] | None = None  # the devices the apiserver holds, as we wrote them
        self._generation = 0
        self._strays_checked = False
        self._kick = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._in_sync = asyncio.Event()
        # Counters (metrics, tests).
        self.writes = 0
        self.republished = 0
        self.errors = 0

    @property
    def published(self) -> dict[str, Any] | None:
        """The slice as last written (None before the first write)."""
        return None if self._applied is None else copy.deepcopy(self._applied)

    def update(self, body: dict[str, Any]) -> None:
        """Publish `body` (a ResourceSlice; its pool generation is the publisher's); never blocks."""
        if self._wanted is not None and body["spec"]["devices"] == self._wanted["spec"]["devices"]:
            return
        self._wanted = copy.deepcopy(body)
        self._in_sync.clear()
        self._kick.set()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="resourceslice")

    async def settled(self, timeout: float | None = None) -> bool:
        """True once the apiserver holds the last wish (tests, the bench)."""
        try:
            await asyncio.wait_for(self._in_sync.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    async def close(self) -> None:
        """Stop keeping the slice (it stays published: claims prepared on it live on)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        failures = 0
        while True:
            self._kick.clear()
            wanted = self._wanted
            assert wanted is not None
            try:
                await asyncio.to_thread(self._sync, wanted)
                failures = 0
                if self._wanted is wanted:
                    self._in_sync.set()
                delay = self.check_interval
            except Exception as e:
                failures += 1
                self.errors += 1
                status = getattr(e, "status", None)
                log.warning(
                    "publishing ResourceSlice %s failed: %s",
                    wanted["metadata"]["name"],
                    f"{status} {getattr(e, 'reason', '')}".strip() if status else e,
                )
                delay = min(self._backoff[1], self._backoff[0] * 2 ** (failures - 1))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._kick.wait(), delay)

    # -- in a worker thread ------------------------------------------------------------------------

    def _sync(self, wanted: dict[str, Any]) -> None:
        name = wanted["metadata"]["name"]
        if not self._strays_checked:
            self._remove_strays(name)
            self._strays_checked = True
        try:
            have = decode(
                self._api.read_resource_slice(
                    name, _preload_content=False, _request_timeout=self._request_timeout
                )
            )
        except ApiException as e:
            if e.status != 404:
                raise
            have = None
        body = copy.deepcopy(wanted)
        if have is None:
            self._generation += 1
            body["spec"]["pool"]["generation"] = self._generation
            # A plain dict is sent as it is (the client's model classes are for reading).
            self._api.create_resource_slice(body, _request_timeout=self._request_timeout)  # type: ignore[arg-type]
            if self._applied is not None:
                self.republished += 1
                log.warning(
                    "ResourceSlice %s was deleted (a starting kubelet deletes its node's): published again",
                    name,
                )
            else:
                log.info("published ResourceSlice %s: %d devices", name, len(body["spec"]["devices"]))
        else:
            spec = have.get("spec") or {}
            held = (spec.get("pool") or {}).get("generation")
            if isinstance(held, int) and held > self._generation:
                self._generation = held  # an earlier agent's: keep counting up from it
            if spec.get("devices") == body["spec"]["devices"] and spec.get("driver") == self.driver:
                body["spec"]["pool"]["generation"] = self._generation
                self._applied = body
                return
            self._generation += 1
            body["spec"]["pool"]["generation"] = self._generation
            # A replace (PUT) of the version read: another writer in between gets a 409 and the
            # next pass reads again. (Not a patch: clients before 37 send a dict as a JSON Patch.)
            put = copy.deepcopy(body)
            put["metadata"]["resourceVersion"] = (have.get("metadata") or {}).get("resourceVersion", "")
            self._api.replace_resource_slice(name, put, _request_timeout=self._request_timeout)  # type: ignore[arg-type]
            log.info("ResourceSlice %s updated (pool generation %d)", name, self._generation)
        self.writes += 1
        self._applied = body

    def _remove_strays(self, name: str) -> None:
        """Delete slices of this driver on this node other than `name`."""
        selector = f"spec.nodeName={self.node},spec.driver={self.driver}"
        listed = decode(
            self._api.list_resource_slice(
                field_selector=selector, _preload_content=False, _request_timeout=self._request_timeout
            )
        )
        for item in listed.get("items") or []:
            other = (item.get("metadata") or {}).get("name")
            if other and other != name:
                log.info(
                    "deleting ResourceSlice %s of %s on %s (not this agent's)", other, self.driver, self.node
                )
                with contextlib.suppress(ApiException):
                    self._api.delete_resource_slice(other, _request_timeout=self._request_timeout)
