"""`gpufrac run`: the agent on this node, or a simulated GPU node with a short demo.

On a real node (an NVIDIA driver and a kubelet present) this is the agent itself.
Elsewhere it builds a simulated node (simgpu), runs the real agent against the
kubelet emulator, and walks through what gpufrac does, printing each step.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from gpufrac import native

KUBELET_SOCKET = "/var/lib/kubelet/device-plugins/kubelet.sock"


def real_node_present() -> bool:
    """A real GPU node: the NVIDIA driver's device files and a kubelet socket."""
    return os.path.exists("/dev/nvidiactl") and os.path.exists(KUBELET_SOCKET)


def banner(title: str) -> None:
    print(f"\n=== {title} " + "=" * max(0, 72 - len(title)), flush=True)


class SimEnv:
    """A simulated node in a temporary directory and the environment that sees it."""

    def __init__(self, preset: str, root: Path) -> None:
        from gpufrac.simgpu.spec import create_node, load_preset

        self.root = root
        self.state = root / "node.state"
        create_node(load_preset(preset), self.state)
        self.libdir = native.native_dir()
        native.library(native.FAKE_NVML)
        native.library(native.FAKE_CUDA)
        self.env = dict(os.environ)
        self.env["SIMGPU_STATE"] = str(self.state)
        self.env["LD_LIBRARY_PATH"] = f"{self.libdir}:{self.env.get('LD_LIBRARY_PATH', '')}".rstrip(":")

    def gpufrac(self, *args: str) -> str:
        """Run a gpufrac CLI command on the simulated node (a fresh process, as a user would)."""
        r = subprocess.run(
            [sys.executable, "-m", "gpufrac.agent.cli", *args],
            env=self.env,
            capture_output=True,
            text=True,
            check=False,
        )
        if r.returncode != 0:
            raise RuntimeError(f"gpufrac {' '.join(args)} failed: {r.stderr.strip()}")
        return r.stdout


def run_demo(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="gpufrac-demo-") as tmp:
        sim = SimEnv(args.preset, Path(tmp))
        banner(f"Simulated node: preset {args.preset}")
        print(f"node state: {sim.state}\nfake driver libraries: {sim.libdir}")
        banner("GPU inventory (gpufrac gpus)")
        print(sim.gpufrac("gpus"), end="")
        banner("Topology (gpufrac topo)")
        print(sim.gpufrac("topo"), end="")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    if real_node_present() and not args.sim:
        from gpufrac.agent.main import cmd_agent

        return cmd_agent(args)
    return run_demo(args)
