"""`gpufrac run --keep` stopped by a signal leaves nothing behind: not the agent serving
its metrics port, not its temp directory, not the containers' cgroups.

The demo is run as a user runs it (the console script, in its own process); the
signal goes to that process alone, as `kill` or a service manager sends it, so the
demo itself has to take its children down.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpufrac.simgpu.runtime import DEFAULT_HIERARCHY

GPUFRAC = Path(sys.executable).with_name("gpufrac")
SERVING = re.compile(r"serving until .*metrics http://127\.0\.0\.1:(\d+)/metrics, status socket (\S+)")


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid ...: comm may hold spaces, so split after its closing paren.
        if int(stat.rpartition(")")[2].split()[1]) == pid:
            out.append(int(entry.name))
    return out


def _container_cgroups(pids: list[int]) -> list[Path]:
    """The kubepods cgroups the demo's containers run in (pids controller, as the runtime
    emulator creates them)."""
    found = []
    for pid in pids:
        try:
            lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            _, controllers, path = line.split(":", 2)
            if "kubepods" in path and (controllers == "pids" or controllers == ""):
                found.append(Path(DEFAULT_HIERARCHY) / path.lstrip("/"))
    return found


def _port_in_use(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_run_keep_cleans_up_on_signal(sig: signal.Signals) -> None:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [str(GPUFRAC), "run", "--keep", "--sim"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        seen: list[str] = []
        match = None
        for line in proc.stdout:
            seen.append(line)
            match = SERVING.search(line)
            if match:
                break
        assert match, "the demo ended before serving:\n" + "".join(seen[-40:])
        port, status_socket = int(match.group(1)), Path(match.group(2))
        tmp = status_socket.parent
        children = _children(proc.pid)
        cgroups = _container_cgroups(children)
        # What a leak would leave: check it is all there while the demo serves.
        assert _port_in_use(port)
        assert tmp.is_dir() and status_socket.exists()
        assert len(cgroups) == 3 and all(c.is_dir() for c in cgroups), (
            cgroups
        )  # llm-server, embedder, notebook
        assert children

        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, out[-3000:]
        assert "Traceback" not in out

        assert not _port_in_use(port), f"the agent still serves :{port}"
        assert not tmp.exists(), f"{tmp} left behind: {list(tmp.rglob('*'))[:10]}"
        assert [c for c in cgroups if c.exists()] == []
        deadline = time.monotonic() + 10  # reaped children vanish from /proc at once; allow a moment
        while any(_alive(p) for p in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [p for p in children if _alive(p)] == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def test_run_stopped_mid_demo_exits_143_and_cleans_up() -> None:
    import yaml

    proc = subprocess.Popen(
        [str(GPUFRAC), "run", "--sim"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    try:
        assert proc.stdout is not None
        tmp = None
        for line in proc.stdout:
            m = re.match(r"node state (\S+)/node\.state;", line)
            if m:
                tmp = Path(m.group(1))
            if "Collision 1" in line:  # the containers run; the demo is mid-way
                break
        assert tmp is not None and tmp.is_dir()
        port = yaml.safe_load((tmp / "a" / "agent.yaml").read_text())["metrics"]["port"]
        children = _children(proc.pid)
        cgroups = _container_cgroups(children)
        assert cgroups and _port_in_use(port)

        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=120)
        assert proc.returncode == 128 + signal.SIGTERM
        assert not _port_in_use(port) and not tmp.exists()
        assert [c for c in cgroups if c.exists()] == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
