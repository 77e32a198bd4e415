"""The command line as kubectl users expect it: `--version`, `-o json|yaml|wide` on every
listing command (`--json` still an alias), `memguard inspect NAMESPACE/POD[/CONTAINER]`
found through the running agent, and the exit codes `gpufrac --help` documents.

Every command runs as a user runs it: the console script in a fresh process, against a
simulated node (gpus, topo) or the real agent's status socket (status, memguard inspect)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

import gpufrac
from gpufrac.agent.cli.gpus import cpu_list
from gpufrac.simgpu.kubelet import Container, Pod
from gpufrac.simgpu.spec import load_preset
from tests.fixtures.kube import pod_manifest
from tests.fixtures.metrics import GiB, InprocNode, finish, read_line

if TYPE_CHECKING:
    from tests.fixtures.simnode import SimNode

GPUFRAC = Path(sys.executable).with_name("gpufrac")


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(GPUFRAC), *args], env=env, capture_output=True, text=True, timeout=120, check=False
    )


def ok(*args: str, env: dict[str, str] | None = None) -> str:
    r = run(*args, env=env)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    return r.stdout


def test_version() -> None:
    r = run("--version")
    assert r.returncode == 0
    assert r.stdout.strip() == f"gpufrac {gpufrac.__version__}"


def test_help_documents_the_exit_codes() -> None:
    for args in (["--help"], ["status", "--help"], ["memguard", "--help"]):
        text = ok(*args)
        assert "exit codes" in text
        for code in ("0 ", "1 ", "2 ", "130 ", "143 "):
            assert f"\n  {code}" in text, (args, text)


def test_usage_errors_exit_2() -> None:
    for args in (["gpus", "-o", "xml"], ["nosuchcommand"], ["memguard", "inspect", "a/b/c/d"]):
        r = run(*args)
        assert r.returncode == 2, (args, r.stderr)
        assert r.stderr.strip() and "Traceback" not in r.stderr


def test_a_bad_node_config_exits_2_naming_the_key(sim_node: SimNode, tmp_path: Path) -> None:
    cfg = tmp_path / "node.yaml"
    cfg.write_text("memoryUnit: lots\n")
    for args in (["gpus", "--config", str(cfg)], ["status", "--config", str(cfg)]):
        r = run(*args, env=sim_node.process_env())
        assert r.returncode == 2, (args, r.stderr)
        assert "memoryUnit" in r.stderr and "Traceback" not in r.stderr


def test_no_driver_exits_1(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "LD_LIBRARY_PATH": str(tmp_path)}
    for command in ("gpus", "topo"):
        r = run(command, "-o", "json", env=env)
        assert r.returncode == 1, r.stderr
        assert "no NVIDIA driver" in r.stderr


def test_gpus_output_formats(make_sim_node: Callable[..., SimNode]) -> None:
    node = make_sim_node("pcie-l4x4")
    spec = load_preset("pcie-l4x4")
    env = node.process_env()
    doc = json.loads(ok("gpus", "-o", "json", env=env))
    assert json.loads(ok("gpus", "--json", env=env)) == doc
    assert yaml.safe_load(ok("gpus", "-o", "yaml", env=env)) == doc
    assert [g["uuid"] for g in doc["gpus"]] == [spec.gpu_uuid(i) for i in range(len(spec.gpus))]

    plain = ok("gpus", env=env).splitlines()
    wide = ok("gpus", "-o", "wide", env=env).splitlines()
    header = next(line for line in wide if line.startswith("IDX"))
    assert "CPU AFFINITY" in header and "MINOR" in header
    assert not any("CPU AFFINITY" in line for line in plain)
    for i, g in enumerate(spec.gpus):
        row = next(line.split() for line in wide if line.split()[:1] == [str(i)])
        assert cpu_list(g.cpu_affinity) in row


def test_topo_output_formats(make_sim_node: Callable[..., SimNode]) -> None:
    env = make_sim_node("dgx-h100").process_env()
    doc = json.loads(ok("topo", "-o", "json", env=env))
    assert json.loads(ok("topo", "--json", env=env)) == doc
    assert yaml.safe_load(ok("topo", "-o", "yaml", env=env)) == doc
    wide = ok("topo", "-o", "wide", env=env)
    # Every pair once, with the NVLink count and the PCIe path a NV# cell hides.
    for link in doc["links"]:
        assert f"GPU{link['a']}-GPU{link['b']}  " in wide
    pair = next(line for line in wide.splitlines() if line.startswith("GPU0-GPU7"))
    link = next(x for x in doc["links"] if (x["a"], x["b"]) == (0, 7))
    assert pair.split() == ["GPU0-GPU7", str(link["nvlinks"]), link["pcie"]]
    assert "PAIR" not in ok("topo", env=env)


def _status(node: InprocNode, *extra: str) -> str:
    return ok("status", "--socket", str(node.status_socket), *extra)


def test_status_output_formats(node: InprocNode) -> None:
    node.admit("server", "gpufrac.dev/gpu-memory", 8, {"gpufrac.dev/gpu-memory-limit": "24Gi"})
    node.wait(
        lambda: any(
            c["limit_bytes"] == 24 * GiB for c in json.loads(_status(node, "-o", "json"))["containers"]
        ),
        "the server's limit to show",
    )
    doc = json.loads(_status(node, "-o", "json"))
    via_yaml = yaml.safe_load(_status(node, "-o", "yaml"))
    assert set(via_yaml) == set(doc)
    assert via_yaml["containers"][0]["key"] == doc["containers"][0]["key"]
    assert via_yaml["containers"][0]["directory"] == doc["containers"][0]["directory"]
    assert json.loads(_status(node, "--json"))["node"] == doc["node"]

    wide = _status(node, "-o", "wide").splitlines()
    (c,) = doc["containers"]
    row = next(line for line in wide if " server " in line).split()
    assert row[-1] == c["key"]
    gpu_header = next(line for line in wide if line.startswith("GPU "))
    assert "UUID" in gpu_header and "PCI BUS ID" in gpu_header
    assert sum(1 for line in wide if doc["gpus"][0]["uuid"] in line) == 1
    assert c["key"] not in _status(node)


def test_memguard_inspect_by_pod_name(node: InprocNode) -> None:
    pod = node.admit("server", "gpufrac.dev/gpu-memory", 8, {"gpufrac.dev/gpu-memory-limit": "24Gi"})
    work = node.workload(pod, "alloc", 3 * GiB, "hold")
    try:
        while not read_line(work).startswith("hold"):
            pass
        sock = ("--socket", str(node.status_socket))

        # The container holds its 3 GiB and its process's CUDA context (the preset's figure).
        held = 3 * GiB + load_preset("dgx-h100").gpus[0].context_memory

        def inspected() -> dict[str, Any] | None:
            r = run("memguard", "inspect", "default/server", *sock, "-o", "json")
            if r.returncode == 1 and "no container of pod default/server" in r.stderr:
                return None  # the agent has not yet learnt whose container it is (pod-resources)
            assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
            d: dict[str, Any] = json.loads(r.stdout)
            return d if d["limit_bytes"] == 24 * GiB and d["total_used_bytes"] == held else None

        d = node.wait(inspected, "inspect to show the limit and the 3 GiB and the context")
        assert (d["namespace"], d["pod"], d["container"], d["pod_uid"]) == (
            "default",
            "server",
            "main",
            pod.uid,
        )
        # The same container as the host path the agent wrote, and as NAMESPACE/POD/CONTAINER.
        (c,) = json.loads(_status(node, "-o", "json"))["containers"]
        assert d["dir"] == c["directory"]
        by_path = json.loads(ok("memguard", "inspect", c["directory"], "-o", "json"))
        by_container = json.loads(ok("memguard", "inspect", "default/server/main", *sock, "--json"))
        for other in (by_path, by_container):
            assert (other["dir"], other["limit_bytes"], other["total_used_bytes"]) == (
                d["dir"],
                24 * GiB,
                held,
            )
        assert (
            yaml.safe_load(ok("memguard", "inspect", "default/server", *sock, "-o", "yaml"))["dir"]
            == d["dir"]
        )
        text = ok("memguard", "inspect", "default/server", *sock)
        assert "container  default/server/main" in text and "limit      24Gi" in text
        assert "directory" not in text
        assert f"directory  {d['dir']}" in ok("memguard", "inspect", "default/server", *sock, "-o", "wide")
    finally:
        finish(work)

    for target, says in (
        ("default/nobody", "no container of pod default/nobody"),
        ("default/server/sidecar", "container sidecar of pod default/server"),
    ):
        r = run("memguard", "inspect", target, *sock)
        assert r.returncode == 1 and says in r.stderr, r.stderr


def test_memguard_inspect_asks_which_container(node: InprocNode) -> None:
    resource = "gpufrac.dev/gpu-memory"
    pod = Pod("default", "pair", [Container("a", {resource: 4}), Container("b", {resource: 4})])
    node.kube.core_v1().create_namespaced_pod(
        "default", pod_manifest("pair", node=node.agent.config.node_name, uid=pod.uid, containers=("a", "b"))
    )
    node.kubelet.admit(pod)
    sock = ("--socket", str(node.status_socket))
    node.wait(
        lambda: {c["container"] for c in json.loads(_status(node, "-o", "json"))["containers"]} == {"a", "b"},
        "both containers bound to their pod",
    )
    r = run("memguard", "inspect", "default/pair", *sock)
    assert r.returncode == 1
    assert "a, b" in r.stderr and "default/pair/CONTAINER" in r.stderr
    assert json.loads(ok("memguard", "inspect", "default/pair/b", *sock, "-o", "json"))["container"] == "b"


def test_memguard_inspect_without_an_agent_exits_1(tmp_path: Path) -> None:
    r = run("memguard", "inspect", "default/server", "--socket", str(tmp_path / "none.sock"))
    assert r.returncode == 1
    assert "gpufrac memguard inspect:" in r.stderr and "Traceback" not in r.stderr
