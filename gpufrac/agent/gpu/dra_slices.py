"""The node's ResourceSlice following its GPUs' health (a node in mode dra).

A listener of the ledger: when a GPU's health changes, the slice is built again
(gpufrac.agent.gpu.dra_devices: the unhealthy GPU tainted, a recovered one untainted) and handed
to the publisher (gpufrac.agent.kube.SlicePublisher), which also publishes it again whenever
the kubelet deletes it. Bookings do not change the slice: its capacity is each GPU's fixed
total, from which the scheduler subtracts what claims consume.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from gpufrac.agent.gpu import dra_devices
from gpufrac.core.gpus import Inventory
from gpufrac.core.slices import GpuGeometry


class HealthView(Protocol):
    """GPU health as the ledger holds it (gpufrac.agent.booking.ledger.Ledger)."""

    def unhealthy(self) -> Mapping[str, str]: ...


class Publishing(Protocol):
    """gpufrac.agent.kube.SlicePublisher."""

    def update(self, body: dict[str, Any]) -> None: ...


class SliceKeeper:
    """Builds the node's slice again when GPU health changes, and hands it to `publisher`."""

    def __init__(
        self,
        inventory: Inventory,
        geometry: Mapping[str, GpuGeometry],
        health: HealthView,
        publisher: Publishing,
        *,
        node: str,
        driver: str,
    ) -> None:
        self.inventory = inventory
        self.geometry = geometry
        self.health = health
        self.publisher = publisher
        self.node = node
        self.driver = driver
        # The PCIe root of each GPU (sysfs), read once: it does not move.
        self.roots = {g.uuid: dra_devices.pcie_root(g.pci_bus_id) for g in inventory.gpus}
        self._published: dict[str, str] | None = None

    def device_names(self) -> dict[str, str]:
        """Device name -> GPU UUID, of every device the slice publishes."""
        body = self.build({})
        names = {d["name"] for d in body["spec"]["devices"]}
        return {
            dra_devices.device_name(g): g.uuid
            for g in self.inventory.gpus
            if dra_devices.device_name(g) in names
        }

    def build(self, unhealthy: Mapping[str, str]) -> dict[str, Any]:
        return dra_devices.resource_slice(
            self.inventory,
            self.geometry,
            unhealthy,
            node=self.node,
            driver=self.driver,
            generation=0,  # the publisher's to count
            roots=self.roots,
        )

    def refresh(self) -> None:
        """Publish the slice if GPU health changed since the last time (a ledger listener)."""
        bad = dict(self.health.unhealthy())
        if bad == self._published:
            return
        self._published = bad
        self.publisher.update(self.build(bad))
