"""Grants across an agent restart.

A grant is published to the container's config file before the shim is told; the state file
is saved later, so after a crash the config files are the truth: the agent's start puts the
grants they carry back into the restored ledger (published_grants, adopt_grants), and the
arbiter's start then takes back what the containers no longer use (reconcile): the waiters
that asked for them died with the old agent, and their shims have already given up.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from gpufrac.agent.arbiter.grants import kept_on_release
from gpufrac.agent.booking.ledger import ContainerAlloc, Ledger
from gpufrac.core.units import format_bytes
from gpufrac.memguard import abi
from gpufrac.memguard.abi import FormatError

log = logging.getLogger(__name__)


def published_grants(containers: list[tuple[str, str, str, int]]) -> dict[str, int]:
    """Grants the config files carry, for (key, directory, GPU, request) of booked containers
    (blocking reads: recovery runs it in a thread)."""
    out = {}
    for key, directory, gpu, request in containers:
        try:
            cfg = abi.read_config(directory)
        except FormatError:
            continue
        if cfg.gpu_uuid == gpu and cfg.request_bytes == request:
            out[key] = cfg.grant_bytes
    return out


def adopt_grants(ledger: Ledger, grants: dict[str, int]) -> None:
    """Put published grants (published_grants) back into the restored ledger; the arbiter's
    reconcile() then takes back what the containers no longer use."""
    for key, grant in grants.items():
        alloc = ledger.get(key)
        if alloc is not None and alloc.config.grant_bytes != grant:
            ledger.update_config(key, grant_bytes=grant)


def reconcile(ledger: Ledger, used: Callable[[ContainerAlloc], int | None]) -> None:
    """Grants above what a container now uses (`used`, None: unknown, kept) are taken back."""
    for alloc in ledger.containers():
        g = alloc.config.grant_bytes
        if g <= 0:
            continue
        u = used(alloc)
        keep = g if u is None else kept_on_release(u, alloc.request_bytes, g)
        if keep < g:
            log.info("reconcile: %s grant %s -> %s", alloc.who(), format_bytes(g), format_bytes(keep))
            ledger.update_config(alloc.key, grant_bytes=keep)
