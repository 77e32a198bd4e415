"""An agent that cannot reach any apiserver (no apiServer, not in a cluster, no kubeconfig)
still serves its node: both resources registered, pods admitted with limit = request, and
each part that needs the apiserver left out with one error line saying so."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from kubernetes.config import kube_config

from tests.fixtures.kube import KubeServer
from tests.fixtures.metrics import admits_at_request_without_apiserver, start_node

if TYPE_CHECKING:
    from tests.fixtures.simnode import SimNode


def test_an_agent_without_an_apiserver_serves_and_says_what_it_leaves_out(
    in_process_nvml: SimNode,
    kube_server: KubeServer,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    # Where the client looks for a kubeconfig when none is named ($KUBECONFIG, read at import).
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(tmp_path / "no-kubeconfig"))
    caplog.set_level(logging.ERROR)
    node, stop = start_node(
        in_process_nvml, kube_server, config={"apiServer": "", "idle": {"enabled": True, "action": "evict"}}
    )
    try:
        admits_at_request_without_apiserver(node)
    finally:
        stop()
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    for part in (
        "pod annotations unavailable, every container keeps limit = request",
        "node labels unavailable",
        "idle reaper cannot evict (it will only notify)",
    ):
        assert [m for m in said if m.startswith(part) and "no usable kubeconfig" in m], (part, said)
