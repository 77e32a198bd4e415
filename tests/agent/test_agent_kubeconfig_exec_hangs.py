"""A kubeconfig whose exec credential plugin hangs does not keep the node from being served.

Loading a kubeconfig runs its exec plugin (a cloud provider's token helper, say), and one can
hang on a network it cannot reach. The agent waits for its apiserver client at most
gpufrac.agent.main.CONNECT_TIMEOUT (made small here), then goes on without one: both device
plugin resources are registered, pods are admitted with limit = request, and an error line
says why the apiserver's parts are left out.

A real kubeconfig (pointing at kmock's apiserver) whose exec plugin is a script that sleeps;
the agent runs in this process on simgpu, as in test_agent_no_apiserver.py.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import yaml
from kubernetes.config import kube_config

from gpufrac.agent import main
from tests.fixtures.kube import KubeServer
from tests.fixtures.metrics import admits_at_request_without_apiserver, start_node

if TYPE_CHECKING:
    from tests.fixtures.simnode import SimNode


def hanging_kubeconfig(directory: Path, server: str) -> tuple[Path, Path]:
    """A kubeconfig whose user's credentials come from an exec plugin that never answers;
    returns it and the file the plugin writes its pid to."""
    pidfile = directory / "plugin.pid"
    plugin = directory / "token-helper"
    plugin.write_text(f'#!/bin/sh\necho $$ > "{pidfile}"\nexec sleep 600\n')
    plugin.chmod(0o755)
    kubeconfig = directory / "kubeconfig"
    exec_user = {
        "apiVersion": "client.authentication.k8s.io/v1beta1",
        "command": str(plugin),
        "interactiveMode": "Never",
    }
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": server}}],
                "users": [{"name": "u", "user": {"exec": exec_user}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    return kubeconfig, pidfile


def end_plugin(pidfile: Path) -> None:
    """The client's thread waits on the plugin: end it so the agent can stop (once: the
    pidfile goes with it, so a later call cannot hit a process that reused the pid)."""
    with contextlib.suppress(FileNotFoundError, ValueError, ProcessLookupError):
        pid = int(pidfile.read_text())
        pidfile.unlink()
        os.kill(pid, signal.SIGKILL)


def test_an_exec_plugin_that_hangs_leaves_the_agent_serving_without_an_apiserver(
    in_process_nvml: SimNode,
    kube_server: KubeServer,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    kubeconfig, pidfile = hanging_kubeconfig(tmp_path, kube_server.url)
    # Where the client looks for a kubeconfig when none is named ($KUBECONFIG, read at import).
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(kubeconfig))
    monkeypatch.setattr(main, "CONNECT_TIMEOUT", 1.0)
    caplog.set_level(logging.ERROR)
    try:
        node, stop = start_node(in_process_nvml, kube_server, config={"apiServer": ""})
        try:
            admits_at_request_without_apiserver(node)
            assert pidfile.exists()  # the plugin ran, and is still hanging
        finally:
            end_plugin(pidfile)
            stop()
    finally:
        end_plugin(pidfile)  # also when the agent never started
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert [
        m
        for m in said
        if m.startswith("pod annotations unavailable, every container keeps limit = request")
        and "no apiserver client within 1 s" in m
    ], said
