"""The `kube_server` fixture: a fresh apiserver emulator (gpufrac/simgpu/apiserver.py) per test.

from kube_fixtures import KubeServer, pod_manifest

def test_x(kube_server: KubeServer) -> None:
    v1 = kube_server.core_v1()
    v1.create_namespaced_pod("default", pod_manifest("p", node="node-a"))
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gpufrac.simgpu.apiserver import EVENTS, PODS, ApiServerEmulator, KubeServer, pod_manifest

__all__ = ["EVENTS", "PODS", "ApiServerEmulator", "KubeServer", "kube_server", "pod_manifest"]


@pytest.fixture
def kube_server() -> Iterator[KubeServer]:
    """A fresh apiserver emulator per test, on 127.0.0.1 with a random port."""
    server = KubeServer()
    try:
        yield server
    finally:
        server.close()
