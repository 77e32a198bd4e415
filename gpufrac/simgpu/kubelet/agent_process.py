"""The real agent as a subprocess on a simulated node, wired to a KubeletEmulator."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any


def _free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the kernel's pick of an ephemeral port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class AgentProcess:
    """The real agent as a subprocess on a simulated node, wired to a KubeletEmulator.

    Writes <root>/agent.yaml (state under <root>/state, the emulator's directory as
    kubelet dir, metrics on a free loopback port unless `config` names one) and runs
    `python -m gpufrac.agent.main` with the simgpu environment."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        node_state: str | os.PathLike[str],
        kubelet_dir: str | os.PathLike[str],
        config: dict[str, Any] | None = None,
        reconcile_interval: float = 0.5,
        release_grace: float = 2.0,
    ) -> None:
        import yaml

        from gpufrac.core import native

        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.node_state = Path(node_state)
        self.state_dir = self.root / "state"
        self.config_path = self.root / "agent.yaml"
        self.log_path = self.root / "agent.log"
        cfg: dict[str, Any] = {
            "paths": {
                "stateDir": str(self.state_dir),
                "kubeletDir": str(kubelet_dir),
                "shimHostPath": str(native.native_dir() / native.SHIM),
            },
            "health": {"pollInterval": "50ms"},
            # Under the root, so agents of concurrent tests never share one status socket.
            "statusSocket": str(self.root / "status.sock"),
            # Loopback and a port free now, not the agent's 0.0.0.0:9410: agents of concurrent
            # tests never fight over one port, nor take the one a user's demo serves.
            "metrics": {"bindAddress": "127.0.0.1", "port": _free_port()},
        }
        for k, v in (config or {}).items():
            cfg[k] = {**cfg[k], **v} if isinstance(v, dict) and isinstance(cfg.get(k), dict) else v
        self.config_path.write_text(yaml.safe_dump(cfg))
        native.library(native.FAKE_NVML)
        self.env = dict(os.environ)
        self.env.update(SIMGPU_STATE=str(self.node_state), LD_LIBRARY_PATH=str(native.native_dir()))
        self.args = [
            "--config",
            str(self.config_path),
            "--reconcile-interval",
            str(reconcile_interval),
            "--release-grace",
            str(release_grace),
        ]
        self.proc: Any = None

    def start(self) -> AgentProcess:
        import subprocess
        import sys

        log = open(self.log_path, "ab")  # noqa: SIM115 - the child keeps it
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gpufrac.agent.main", *self.args], env=self.env, stdout=log, stderr=log
        )
        log.close()
        return self

    @property
    def pid(self) -> int:
        return int(self.proc.pid)

    def kill(self) -> None:
        """kill -9: no cleanup of any kind."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except Exception:
                self.proc.kill()
                self.proc.wait(30)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def state(self) -> dict[str, Any]:
        import json

        state: dict[str, Any] = json.loads((self.state_dir / "state.json").read_text())
        return state

    def container_dirs(self) -> set[str]:
        d = self.state_dir / "containers"
        return set(os.listdir(d)) if d.exists() else set()
