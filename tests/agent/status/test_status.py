"""`gpufrac status` against the real agent's status socket, as an operator runs it
(a separate process), and its one-line error when no agent is running."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml
import yaml

from gpufrac.agent.status.server import MAX_REQUEST, StatusServer
from gpufrac.core import slices
from gpufrac.core.slices import FRACTION, MEMORY
from gpufrac.core.units import format_bytes
from tests.fixtures.metrics import CTX, GiB, InprocNode, finish, read_line


def gpufrac(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpufrac.agent.cli.commands", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def status_json(node: InprocNode) -> dict[str, Any]:
    p = gpufrac("status", "--json", "--socket", str(node.status_socket))
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_status_shows_the_node_at_a_glance(node: InprocNode, tmp_path: Path) -> None:
    began = time.monotonic()
    server = node.admit("server", MEMORY, 8, {"gpufrac.dev/gpu-memory-limit": "24Gi"})
    node.admit("notebook", FRACTION, 25, {"gpufrac.dev/workload-class": "interactive"})
    work = node.workload(server, "alloc", 3 * GiB, "hold")
    try:
        while not read_line(work).startswith("hold"):
            pass

        def settled() -> dict[str, Any] | None:
            d = status_json(node)
            pods = {c["pod"]: c for c in d["containers"]}
            ok = (
                # its allocation and the CUDA context the shim charges it
                pods.get("server", {}).get("used_bytes") == 3 * GiB + CTX
                and pods.get("server", {}).get("limit_bytes") == 24 * GiB
                and pods.get("notebook", {}).get("workload_class") == "interactive"
            )
            return d if ok else None

        doc = node.wait(settled, "the status to show both pods, the limit and the 3 GiB + context")
        text = gpufrac("status", "--socket", str(node.status_socket))
    finally:
        finish(work)
    assert text.returncode == 0, text.stderr

    # JSON: the containers as admitted, the GPUs as NVML and the kubelet see them.
    assert doc["ready"] and doc["node"] == "sim-metrics-node"
    pods = {c["pod"]: c for c in doc["containers"]}
    assert set(pods) == {"server", "notebook"}
    s = pods["server"]
    assert (s["namespace"], s["container"], s["resource"], s["slices"]) == ("default", "main", MEMORY, 8)
    assert (s["request_bytes"], s["limit_bytes"], s["used_bytes"], s["processes"]) == (
        8 * GiB,
        24 * GiB,
        3 * GiB + CTX,
        1,
    )
    # Idle since its last GPU work, never longer than the container has existed (this test's span).
    assert s["idle_seconds"] is not None and 0 <= s["idle_seconds"] <= time.monotonic() - began
    gpus = {g["uuid"]: g for g in doc["gpus"]}
    assert len(gpus) == pynvml.nvmlDeviceGetCount()
    (server_gpu,) = s["gpus"]
    (nb_gpu,) = pods["notebook"]["gpus"]
    g = gpus[server_gpu]
    h = pynvml.nvmlDeviceGetHandleByUUID(server_gpu)
    assert g["memory_total_bytes"] == int(pynvml.nvmlDeviceGetMemoryInfo(h).total)
    assert g["memory_used_bytes"] >= 3 * GiB and g["healthy"]
    assert g["slices"][MEMORY]["allocated"] == 8
    assert gpus[nb_gpu]["slices"][FRACTION]["allocated"] == 25
    booked = sum(c["request_bytes"] for c in doc["containers"] if server_gpu in c["gpus"])
    assert g["memory_requested_bytes"] == booked
    idle_gpu = next(u for u in gpus if u not in (server_gpu, nb_gpu))
    assert gpus[idle_gpu]["slices"][FRACTION] == {"total": 100, "allocated": 0, "free": 100}

    # The table: one row per GPU and per container, sizes in binary units.
    lines = text.stdout.splitlines()
    assert lines[0].startswith("Node sim-metrics-node") and lines[0].endswith("Ready")
    assert "gpu-fraction registered" in lines[1] and "gpu-memory registered" in lines[1]
    row = next(line for line in lines if " server " in line).split()
    assert row[:2] == ["default", "server"] and row[-1] == "batch"
    assert row[6:9] == ["8Gi", "24Gi", format_bytes(3 * GiB + CTX)], row  # its allocation + context
    nb_row = next(line for line in lines if " notebook " in line)
    assert "gpu-fraction 25" in nb_row and nb_row.endswith("interactive")
    assert sum(1 for line in lines if "NVIDIA H100" in line) == len(gpus)

    # Without --socket the path comes from the node config, as on a node.
    cfg = tmp_path / "node.yaml"
    cfg.write_text(yaml.safe_dump({"statusSocket": str(node.status_socket)}))
    via_config = gpufrac("status", "--json", "--config", str(cfg))
    assert via_config.returncode == 0 and {c["pod"] for c in json.loads(via_config.stdout)["containers"]} == {
        "server",
        "notebook",
    }
    assert doc["registered"] == dict.fromkeys(slices.RESOURCES, True)


def test_status_endpoint_is_read_only(node: InprocNode) -> None:
    def ask(request: bytes) -> str:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(30)
            s.connect(str(node.status_socket))
            s.sendall(request)
            chunks = []
            while chunk := s.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks).decode()

    for method in ("POST", "PUT", "DELETE", "PATCH"):
        assert ask(f"{method} / HTTP/1.0\r\nContent-Length: 0\r\n\r\n".encode()).startswith("HTTP/1.0 405")
    assert ask(b"GET /containers/x HTTP/1.0\r\n\r\n").startswith("HTTP/1.0 404")
    assert ask(b"GET / HTTP/1.0\r\n\r\n").startswith("HTTP/1.0 200")
    assert oct(os.stat(node.status_socket).st_mode & 0o777) == oct(0o660)


def test_status_without_an_agent_says_so_in_one_line() -> None:
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        missing = os.path.join(tmp, "status.sock")
        p = gpufrac("status", "--socket", missing)
        assert p.returncode == 1 and p.stdout == ""
        assert p.stderr.count("\n") == 1 and missing in p.stderr and "not running" in p.stderr, p.stderr

        # A socket left behind by an agent that died: nothing listens on it.
        stale = os.path.join(tmp, "stale.sock")
        s = socket.socket(socket.AF_UNIX)
        s.bind(stale)
        s.close()
        p = gpufrac("status", "--json", "--socket", stale)
        assert p.returncode == 1 and p.stdout == ""
        assert p.stderr.count("\n") == 1 and stale in p.stderr and "not running" in p.stderr, p.stderr


def test_status_endpoint_refuses_a_request_over_its_limit() -> None:
    """The agent buffers at most MAX_REQUEST bytes of a request head: a bigger one is answered
    431 with the limit named, never parsed."""

    async def ask(path: str, request: bytes) -> bytes:
        reader, writer = await asyncio.open_unix_connection(path)
        writer.write(request)
        await writer.drain()
        reply = await asyncio.wait_for(reader.read(), 30)
        writer.close()
        return reply

    async def main() -> bytes:
        with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
            # No agent behind it: a request that got as far as reading the status would fail (500).
            server = await StatusServer(SimpleNamespace(), os.path.join(tmp, "status.sock")).start()
            try:
                return await ask(server.path, b"GET / HTTP/1.0\r\nX-Pad: " + b"a" * MAX_REQUEST + b"\r\n\r\n")
            finally:
                await server.stop()

    reply = asyncio.run(main())
    assert reply.startswith(b"HTTP/1.0 431"), reply[:100]
    body = json.loads(reply.split(b"\r\n\r\n", 1)[1])
    assert body == {"error": f"request too large: the limit is {MAX_REQUEST} bytes"}
