"""What a container is given to run under the shim: its environment and its mounts.

One layout for both front ends: the device plugin puts it in its Allocate response
(gpufrac.deviceplugin.server), the DRA driver in the CDI spec of a claim (gpufrac.agent.booking.cdi).
The container sees its directory at `container_dir`: the config read-only (its limits are
the agent's to write), the usage and compute files writable (the shim's bookkeeping and
launch clock), the arbiter socket's
directory read-only (a directory mount: a file mount would pin the socket's inode, dead once
the agent restarts and binds a new one; read-only: connect() needs no write access, and the
tenant cannot unlink or replace its socket), and the shim library read-only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from gpufrac.memguard import abi
from gpufrac.memguard.build import CONTAINER_DIR_ENV

SHIM_NAME = "libmemguard.so"


@dataclass(frozen=True)
class Mount:
    container_path: str
    host_path: str
    read_only: bool


def shim_env(container_dir: str) -> dict[str, str]:
    """The container's environment: the shim preloaded, its directory named."""
    return {"LD_PRELOAD": os.path.join(container_dir, SHIM_NAME), CONTAINER_DIR_ENV: container_dir}


def shim_mounts(host_dir: str, shim_host_path: str, container_dir: str) -> list[Mount]:
    """The shim and the files of the booking's host directory, at their container paths."""
    return [
        Mount(os.path.join(container_dir, SHIM_NAME), shim_host_path, True),
        Mount(os.path.join(container_dir, abi.CONFIG_FILE), os.path.join(host_dir, abi.CONFIG_FILE), True),
        Mount(os.path.join(container_dir, abi.USAGE_FILE), os.path.join(host_dir, abi.USAGE_FILE), False),
        # the shim's launch clock, shared by the container's processes
        Mount(os.path.join(container_dir, abi.COMPUTE_FILE), os.path.join(host_dir, abi.COMPUTE_FILE), False),
        Mount(os.path.join(container_dir, abi.SOCKET_DIR), os.path.join(host_dir, abi.SOCKET_DIR), True),
    ]
