"""CDI specs of prepared claims: what the container runtime adds to a claim's containers.

The DRA driver answers NodePrepareResources with CDI device names; the container runtime
(containerd, CRI-O) finds each in the spec files of its CDI directory (/var/run/cdi) and
applies its container edits. The agent writes one spec file per prepared claim, kind
`<driver>/claim`, one device named after the claim's UID, whose edits are:

* the GPU: NVIDIA_VISIBLE_DEVICES=<uuid,...> for the NVIDIA container runtime's hook
  (deviceListStrategy envvar); with deviceListStrategy cdi the answer names NVIDIA's own CDI
  device as well (nvidia.com/gpu=<uuid>, from the spec the NVIDIA container toolkit writes),
  which brings the device nodes and the driver's libraries, as the device plugin does;
* the shim: LD_PRELOAD and GPUFRAC_CONTAINER_DIR, and the mounts of the shim, the claim's
  config (read-only), usage file and arbiter socket directory (gpufrac.memguard.inject).

Every container of every pod that uses the claim gets the same directory: one usage file,
one limit, one group. Files are written atomically (temporary file + rename), a claim's on
the agent's loop as it prepares it (a small file in a memory filesystem), the sweep's in a worker
thread; no fsync: after a crash the agent writes every booked claim's spec again (sweep).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from gpufrac.memguard import inject

log = logging.getLogger(__name__)

CDI_VERSION = "0.6.0"
NVIDIA_KIND = "nvidia.com/gpu"


@dataclass(frozen=True)
class ClaimDevice:
    """What a prepared claim's containers get: its GPUs and its booking's host directory."""

    uid: str
    gpus: tuple[str, ...]
    directory: str


class CdiSpecs:
    """The spec files of prepared claims in the runtime's CDI directory."""

    def __init__(
        self, spec_dir: str, driver: str, *, shim_host_path: str, container_dir: str, nvidia_cdi: bool
    ) -> None:
        self.spec_dir = spec_dir
        self.kind = f"{driver}/claim"
        self.shim_host_path = shim_host_path
        self.container_dir = container_dir
        self.nvidia_cdi = nvidia_cdi
        self._prefix = f"{driver}-claim_"

    def path(self, uid: str) -> str:
        return os.path.join(self.spec_dir, f"{self._prefix}{uid}.json")

    def device_ids(self, claim: ClaimDevice) -> list[str]:
        """The CDI device names a claim's answer carries."""
        ids = [f"{self.kind}={claim.uid}"]
        if self.nvidia_cdi:
            ids += [f"{NVIDIA_KIND}={u}" for u in claim.gpus]
        return ids

    def spec(self, claim: ClaimDevice) -> dict[str, object]:
        env = dict(inject.shim_env(self.container_dir))
        if not self.nvidia_cdi:
            env["NVIDIA_VISIBLE_DEVICES"] = ",".join(claim.gpus)
        mounts = [
            {
                "hostPath": m.host_path,
                "containerPath": m.container_path,
                "options": ["ro" if m.read_only else "rw", "nosuid", "nodev", "rbind"],
            }
            for m in inject.shim_mounts(claim.directory, self.shim_host_path, self.container_dir)
        ]
        return {
            "cdiVersion": CDI_VERSION,
            "kind": self.kind,
            "devices": [
                {
                    "name": claim.uid,
                    "containerEdits": {"env": [f"{k}={v}" for k, v in sorted(env.items())], "mounts": mounts},
                }
            ],
        }

    def write_now(self, claim: ClaimDevice) -> None:
        """Write a claim's spec: a small file in a memory filesystem (a node's /var/run/cdi)."""
        path = self.path(claim.uid)
        tmp = f"{path}.tmp"
        # json.dumps without indent: the C encoder (indent takes the pure-Python one, ~10x slower).
        text = json.dumps(self.spec(claim), separators=(",", ":"))
        try:
            f = open(tmp, "w")  # noqa: SIM115 - closed below; the directory is made on a miss only
        except FileNotFoundError:
            os.makedirs(self.spec_dir, exist_ok=True)
            f = open(tmp, "w")  # noqa: SIM115
        with f:
            f.write(text)
        os.replace(tmp, path)  # the runtime never reads half a file

    async def write(self, claim: ClaimDevice) -> list[str]:
        """Write a claim's spec; the CDI device names of its answer. On the loop, as the claim's
        record is: a few hundred bytes into the CDI directory, a memory filesystem on a node, cost
        less than the hop to a worker thread and back, which a loaded node makes milliseconds."""
        self.write_now(claim)
        return self.device_ids(claim)

    async def remove(self, uid: str) -> None:
        def rm() -> None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path(uid))

        await asyncio.to_thread(rm)

    def claims_on_disk(self) -> set[str]:
        """UIDs of the claims whose specs are in the directory (blocking)."""
        try:
            names = os.listdir(self.spec_dir)
        except FileNotFoundError:
            return set()
        return {
            n[len(self._prefix) : -5] for n in names if n.startswith(self._prefix) and n.endswith(".json")
        }

    async def sync(self, booked: Sequence[ClaimDevice]) -> None:
        """Make the directory hold exactly the booked claims' specs: each written again (a lost
        or stale one repaired) and those of claims no longer booked removed (an agent that died
        between a release and the removal)."""

        def run(claims: Iterable[ClaimDevice]) -> None:
            keep = set()
            for c in claims:
                self.write_now(c)
                keep.add(c.uid)
            for uid in self.claims_on_disk() - keep:
                log.info("removing the CDI spec of claim uid %s, which is not booked", uid)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path(uid))

        await asyncio.to_thread(run, list(booked))
