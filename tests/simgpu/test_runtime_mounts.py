"""The container-runtime emulator's mounts behave as a real runtime's bind mounts do.

A bind mount of a file pins the inode it was made with: a host file replaced later (a
rename onto it, a unix socket unlinked and bound again by a restarted agent) is not what
the container sees. A bind mount of a directory shows later changes to its entries. The
tests below hold simgpu's view (gpufrac.simgpu.runtime.link_mounts) to both.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpufrac.simgpu.runtime import MountSpec, link_mounts


@contextlib.contextmanager
def _listening(path: Path) -> Iterator[socket.socket]:
    """A unix socket bound at `path` the way the agent binds its own: a stale one unlinked."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.listen()
    try:
        yield s
    finally:
        s.close()


def _connects(path: Path) -> bool:
    c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        c.connect(str(path))
    except ConnectionRefusedError:
        return False
    finally:
        c.close()
    return True


@pytest.fixture
def dirs(tmp_path: Path) -> tuple[Path, Path]:
    host, view = tmp_path / "host", tmp_path / "view"
    host.mkdir()
    view.mkdir()
    return host, view


def test_a_file_mount_keeps_the_file_it_was_made_with(dirs: tuple[Path, Path]) -> None:
    host, view = dirs
    (host / "config").write_text("first")
    link_mounts(view, [MountSpec("/gpufrac/config", str(host / "config"), read_only=True)])
    spare = host / "config.new"
    spare.write_text("second")
    spare.rename(host / "config")  # the host path now names another inode
    assert (view / "gpufrac/config").read_text() == "first"


def test_a_file_mount_of_a_socket_bound_again_is_refused(dirs: tuple[Path, Path]) -> None:
    """What a container that mounted the arbiter socket as a file sees when the agent restarts."""
    host, view = dirs
    with _listening(host / "arbiter.sock"):
        link_mounts(view, [MountSpec("/gpufrac/arbiter.sock", str(host / "arbiter.sock"))])
        assert _connects(view / "gpufrac/arbiter.sock")
    with _listening(host / "arbiter.sock"):  # the restarted agent: unlink, bind, listen
        assert _connects(host / "arbiter.sock")
        assert not _connects(view / "gpufrac/arbiter.sock")


def test_a_directory_mount_shows_what_its_directory_holds_now(dirs: tuple[Path, Path]) -> None:
    host, view = dirs
    (host / "arbiter").mkdir()
    with _listening(host / "arbiter/arbiter.sock"):
        link_mounts(view, [MountSpec("/gpufrac/arbiter", str(host / "arbiter"), read_only=True)])
        assert _connects(view / "gpufrac/arbiter/arbiter.sock")
    with _listening(host / "arbiter/arbiter.sock"):
        assert _connects(view / "gpufrac/arbiter/arbiter.sock")
    (host / "arbiter/later").write_text("x")
    assert (view / "gpufrac/arbiter/later").read_text() == "x"


def test_a_view_rebuilt_mounts_the_files_there_now(dirs: tuple[Path, Path]) -> None:
    """Starting the container again makes its mounts again: the new file is seen."""
    host, view = dirs
    (host / "usage").write_text("first")
    mounts = [MountSpec("/gpufrac/usage", str(host / "usage"))]
    link_mounts(view, mounts)
    (host / "usage.new").write_text("second")
    os.replace(host / "usage.new", host / "usage")
    link_mounts(view, mounts)
    assert (view / "gpufrac/usage").read_text() == "second"
