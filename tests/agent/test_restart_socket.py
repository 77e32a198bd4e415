"""A container admitted before an agent restart still reaches the restarted agent.

The restarted agent unlinks its old socket and binds a new one (a new inode). A container
runtime's bind mount of a file pins the inode it was made with, so the arbiter's socket
reaches containers through a mount of the directory holding it (the device plugin's Allocate
answer), which shows the new socket. Real processes under the real shim on simgpu, whose
runtime mounts files as hard links (pinning their inodes, as a bind mount does).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from gpufrac.core.config import arbiter_socket, load
from tests.fixtures.e2e import E2ENode, MiB
from tests.fixtures.polling import listening, until

MakeNode = Callable[..., E2ENode]


def test_a_container_admitted_before_an_agent_restart_bursts_after_it(e2e_node: MakeNode) -> None:
    node = e2e_node()
    b = node.run_pod("b", 4, "768Mi")  # request 256 MiB
    view_dir = Path(b.container.env["GPUFRAC_CONTAINER_DIR"])
    # The runtime mounts a file as a bind mount does (its inode, not its path): else this test
    # could not tell a mount that survives a restart from one that does not.
    assert not (view_dir / "config").is_symlink()
    assert os.stat(view_dir / "config").st_ino == os.stat(b.host_dir / "config").st_ino
    assert b.alloc(300 * MiB, 1) == "ok 1"  # a burst, granted by the first agent
    first_grant = b.grant()
    assert first_grant > 0

    node.sim.agent.kill()  # kill -9: its socket file stays behind, dead
    node.sim.restart_agent()
    host_socket = arbiter_socket(load(str(node.sim.agent.config_path)))
    until(lambda: listening(host_socket), what="the restarted agent listening")
    # b, started before the restart and never restarted, bursts again: the shim reaches the
    # new socket through b's mount.
    until(
        lambda: b.alloc(200 * MiB, 2) == "ok 2", timeout=60, what="b's burst granted by the restarted agent"
    )
    assert b.grant() > 0
    assert b.used() <= b.config().request_bytes + b.grant()
    assert b.app.do("check 1") == "ok" and b.app.do("check 2") == "ok"
