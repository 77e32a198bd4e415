"""A DRA driver that does nothing: the floor under the agent's prepare latency.

`python -m bench._floor_dra KUBELET_DIR` serves gpufrac's own DRA front end (gpufrac.dra.server:
registration on the kubelet's plugins_registry, DRAPlugin v1, on the agent's event loop) for
the driver FLOOR_DRIVER over a Backend that answers every claim at once with one device and one
CDI ID, reading nothing and booking nothing. bench/dra.py prepares claims against it with the same
kubelet stand-in, so what the agent adds to gRPC, the front end and the stand-in reads as the
difference within one run.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gpufrac.core import eventloop
from gpufrac.core.claims import ClaimRef
from gpufrac.core.errors import AllocationError
from gpufrac.dra.server import DraPluginServer

FLOOR_DRIVER = "floor.bench.gpufrac.dev"


@dataclass(frozen=True)
class Device:
    requests: tuple[str, ...]
    pool: str
    device: str
    cdi_ids: tuple[str, ...]


@dataclass(frozen=True)
class Health:
    pool: str
    device: str
    healthy: bool
    message: str


class Nothing:
    """Answers every claim with the least a kubelet accepts."""

    async def prepare_claims(
        self, refs: Sequence[ClaimRef]
    ) -> Mapping[str, Sequence[Device] | AllocationError]:
        return {r.uid: [Device((), "floor", "d0", (f"{FLOOR_DRIVER}/claim={r.uid}",))] for r in refs}

    async def unprepare_claims(self, refs: Sequence[ClaimRef]) -> Mapping[str, AllocationError | None]:
        return {r.uid: None for r in refs}

    def device_health(self) -> Sequence[Health]:
        return [Health("floor", "d0", True, "")]


async def serve(kubelet_dir: str) -> None:
    server = DraPluginServer(
        Nothing(),
        driver_name=FLOOR_DRIVER,
        plugin_socket=os.path.join(kubelet_dir, "plugins", FLOOR_DRIVER, "dra.sock"),
        registration_socket=os.path.join(kubelet_dir, "plugins_registry", f"{FLOOR_DRIVER}-reg.sock"),
    )
    await server.start()
    await asyncio.Event().wait()


if __name__ == "__main__":
    eventloop.run(serve(sys.argv[1]))
