"""Which arbiter socket a container's client picks (as the shim's mg_sock does)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from gpufrac.memguard import abi, wire

pytestmark = pytest.mark.unit


def _bind(path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    return s


def test_the_socket_in_the_directory_mount_comes_first(tmp_path: Path) -> None:
    (tmp_path / abi.SOCKET_DIR).mkdir()
    with _bind(tmp_path / abi.SOCKET_DIR / abi.SOCKET_FILE), _bind(tmp_path / abi.SOCKET_FILE):
        assert wire.socket_path(str(tmp_path)) == str(tmp_path / abi.SOCKET_DIR / abi.SOCKET_FILE)


def test_an_older_agents_socket_file_is_used_when_the_directory_has_none(tmp_path: Path) -> None:
    (tmp_path / abi.SOCKET_DIR).mkdir()
    (tmp_path / abi.SOCKET_DIR / abi.SOCKET_FILE).write_text("not a socket")
    with _bind(tmp_path / abi.SOCKET_FILE):
        assert wire.socket_path(str(tmp_path)) == str(tmp_path / abi.SOCKET_FILE)


def test_without_any_socket_the_directory_mount_is_named(tmp_path: Path) -> None:
    assert wire.socket_path(str(tmp_path)) == str(tmp_path / abi.SOCKET_DIR / abi.SOCKET_FILE)
