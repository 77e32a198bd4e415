"""The labels the agent keeps on its Node, so users select GPU nodes by what gpufrac
serves there (nodeSelector, node affinity), as they do with gpu-feature-discovery's.

| label | value |
|---|---|
| `gpufrac.dev/gpu.product` | model of the shared GPUs as a label value (`NVIDIA-H100-80GB-HBM3`) or `mixed` |
| `gpufrac.dev/gpu.memory` | memory of one shared GPU in MiB (the smallest, if they differ) |
| `gpufrac.dev/gpu.count` | GPUs gpufrac shares (not those in MIG mode, not those off the bus) |
| `gpufrac.dev/gpu.healthy` | of those, how many are Healthy now |
| `gpufrac.dev/sharing` | `guaranteed` (requests never lent) or `lending` (lendUnusedRequests: true) |
| `gpufrac.dev/driver.version` | the NVIDIA driver version (`570.124.06`) |

Labels without a value to give (no shared GPU: no product, no memory) are removed.
The `nvidia.com/` labels belong to gpu-feature-discovery, which describes every GPU of
the node for NVIDIA's device plugin; gpufrac describes only the GPUs it shares, in its own
prefix, so the two never fight over a label on a node where both run (MIG GPUs, say).

The labels are patched at start and whenever GPU health changes (gpufrac.agent.main), by
gpufrac.agent.kube.NodeLabeler; everything here runs on the agent's loop.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping
from typing import Protocol

from gpufrac.core.annotations import PREFIX  # the one gpufrac.dev/ domain
from gpufrac.core.config import Config
from gpufrac.core.gpus import Inventory

log = logging.getLogger(__name__)

PRODUCT = PREFIX + "gpu.product"
MEMORY_MIB = PREFIX + "gpu.memory"
COUNT = PREFIX + "gpu.count"
HEALTHY = PREFIX + "gpu.healthy"
SHARING = PREFIX + "sharing"
DRIVER = PREFIX + "driver.version"
OWNED = frozenset({PRODUCT, MEMORY_MIB, COUNT, HEALTHY, SHARING, DRIVER})
MIXED = "mixed"
MiB = 1 << 20

_BAD = re.compile(r"[^A-Za-z0-9_.-]+")


def label_value(text: str) -> str:
    """`text` as a valid label value: at most 63 of [A-Za-z0-9_.-], alphanumeric at both
    ends; runs of anything else become one '-' ("NVIDIA H100 80GB HBM3" ->
    "NVIDIA-H100-80GB-HBM3"). "" when nothing usable is left."""
    value = _BAD.sub("-", text)[:63]
    return re.sub(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$", "", value)


def node_labels(inv: Inventory, healthy: Callable[[str], bool], cfg: Config) -> dict[str, str]:
    """The labels for a node with this inventory; `healthy(uuid)` says whether a shared GPU
    is Healthy now."""
    gpus = inv.gpus
    labels = {
        COUNT: str(len(gpus)),
        HEALTHY: str(sum(1 for g in gpus if healthy(g.uuid))),
        SHARING: "lending" if cfg.lend_unused_requests else "guaranteed",
    }
    models = {g.model for g in gpus}
    product = (label_value(models.pop()) if len(models) == 1 else MIXED) if models else ""
    if product:
        labels[PRODUCT] = product
    if gpus:
        labels[MEMORY_MIB] = str(min(g.memory_total for g in gpus) // MiB)
    driver = label_value(inv.driver_version)
    if driver:
        labels[DRIVER] = driver
    return labels


class Labeler(Protocol):
    """Keeps labels on the Node (gpufrac.agent.kube.NodeLabeler): update() returns at once."""

    def update(self, labels: Mapping[str, str]) -> None: ...
    async def close(self) -> None: ...


class NodeLabels:
    """The agent's node labels: refresh() after anything they follow changed (on the loop).
    Without an apiserver (`labeler` None, decided by the composition root) the labels are
    only computed, and the agent runs on."""

    def __init__(
        self, cfg: Config, inventory: Inventory, healthy: Callable[[str], bool], labeler: Labeler | None
    ):
        self.cfg = cfg
        self._inventory = inventory
        self._healthy = healthy
        self.labeler = labeler
        self._wanted: dict[str, str] | None = None

    def refresh(self) -> None:
        self._wanted = node_labels(self._inventory, self._healthy, self.cfg)
        if self.labeler is not None:
            self.labeler.update(self._wanted)

    def wanted(self) -> Mapping[str, str] | None:
        return None if self._wanted is None else dict(self._wanted)

    async def close(self) -> None:
        if self.labeler is not None:
            await self.labeler.close()
