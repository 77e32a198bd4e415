"""The shim asks the agent on the socket in its directory mount, not on an older agent's file.

$GPUFRAC_CONTAINER_DIR/arbiter/arbiter.sock is where the device plugin mounts the arbiter's
directory; $GPUFRAC_CONTAINER_DIR/arbiter.sock is where an older agent mounted the socket
file, which an agent restart leaves dead (bound, nobody listening). The shim must use the
first when it is there (mg_arbiter.c mg_sock).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable

from gpufrac.memguard import abi
from tests.fixtures.memguard import REQUEST, Container, MiB, Shim, grant_burst


def test_a_burst_goes_to_the_socket_in_the_directory_mount(
    shim: Shim, container: Callable[..., Container]
) -> None:
    c = container(arbiter_timeout_ms=5000)
    (c.dir / abi.SOCKET_DIR).mkdir()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(c.dir / abi.SOCKET_DIR / abi.SOCKET_FILE))
    server.listen(8)
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(c.dir / abi.SOCKET_FILE))  # a socket, but nobody listens: connect is refused

    def agent() -> None:
        conn, _ = server.accept()
        with conn:
            grant_burst(c, conn)

    t = threading.Thread(target=agent)
    t.start()
    try:
        lines = shim.ctest(c, "alloc", REQUEST, "alloc", 8 * MiB, "used")
    finally:
        t.join(timeout=60)
        server.close()
        dead.close()
    assert [ln.rc for ln in lines[:3]] == [0, 0, 0]
    assert lines[3].int("total") == REQUEST + 8 * MiB
