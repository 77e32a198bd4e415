"""The DCGM exporter recipes in deploy/daemonset/METRICS.md, evaluated by promtool.

A real scrape of the agent on a simulated node (two pods, real workloads under the shim
holding memory) becomes promtool's input series, with the target labels a ServiceMonitor
adds; beside them, series shaped like the DCGM exporter's (its metric and label names, its
units) for the same GPUs, the UUIDs and models read through NVML. Each recipe must give
exactly the samples worked out here from the same data: a label-name mismatch between the
two exporters would give no samples at all.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections import defaultdict
from pathlib import Path

import pynvml
import pytest
import yaml

from gpufrac.core.native import REPO_ROOT
from gpufrac.core.slices import FRACTION, MEMORY
from tests.fixtures.metrics import CTX, NODE, GiB, InprocNode, MiB, Scrape, finish, result

pytestmark = pytest.mark.tools

METRICS_MD = REPO_ROOT / "deploy" / "daemonset" / "METRICS.md"
# What a Prometheus Operator scrape adds (the agent's ServiceMonitor: honorLabels, node).
GPUFRAC_TARGET = {"job": "gpufrac-agent-metrics", "instance": "10.0.0.5:9410", "node": NODE}
DCGM_TARGET = {
    "job": "nvidia-dcgm-exporter",
    "instance": "10.0.0.6:9400",
    "namespace": "gpu-operator",
    "pod": "nvidia-dcgm-exporter-x7k2p",
}
WATTS = {0: 300, 1: 120}  # board power of GPU 0 and 1; the rest idle at 60 W
HOT = 0  # GPU 0 runs at 90 °C, the others at 60 °C


def recipes() -> dict[str, str]:
    """name -> PromQL, from METRICS.md's ```promql blocks (first line: `# name`)."""
    blocks = re.findall(r"```promql\n(.*?)```", METRICS_MD.read_text(), re.S)
    out = {}
    for block in blocks:
        first, _, expr = block.partition("\n")
        assert first.startswith("# "), f"recipe without a name line: {block!r}"
        out[first[2:].strip()] = expr.strip()
    return out


def series(name: str, labels: dict[str, str]) -> str:
    inner = ",".join(f"{k}={json.dumps(v)}" for k, v in sorted(labels.items()))
    return f"{name}{{{inner}}}"


def value(v: float) -> str:
    # promtool's series notation reads `+` as an expansion step, so no exponent forms.
    return f"{v:.0f}" if float(v).is_integer() else repr(float(v))


def dcgm_gpus() -> list[dict[str, str]]:
    """DCGM exporter's labels for every GPU of the node, from NVML."""
    gpus = []
    for i in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        gpus.append(
            {
                "gpu": str(i),
                "UUID": pynvml.nvmlDeviceGetUUID(h),
                "device": f"nvidia{i}",
                "modelName": pynvml.nvmlDeviceGetName(h),
                "pci_bus_id": pynvml.nvmlDeviceGetPciInfo(h).busId,
                "Hostname": NODE,
                "DCGM_FI_DRIVER_VERSION": pynvml.nvmlSystemGetDriverVersion(),
                **DCGM_TARGET,
            }
        )
    return gpus


def promtool_test(
    tmp_path: Path, inputs: dict[str, float], tests: list[dict]
) -> subprocess.CompletedProcess[str]:
    spec = {
        "rule_files": [],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [
                    {"series": s, "values": " ".join([value(v)] * 3)} for s, v in inputs.items()
                ],
                "promql_expr_test": tests,
            }
        ],
    }
    path = tmp_path / "recipes_test.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: run `make tools` (Debian package prometheus)"
    return subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True, timeout=120)


def samples(s: Scrape, name: str) -> list[tuple[dict[str, str], float]]:
    return [(dict(ls), v) for (n, ls), v in s.samples.items() if n == name]


def test_dcgm_recipes_join_on_one_label(node: InprocNode, tmp_path: Path) -> None:
    infer = node.admit("infer", MEMORY, 8)
    notebook = node.admit("notebook", FRACTION, 25)
    # One after the other, so each scrape figure is one container's allocation plus its one
    # context (docs/architecture.md, "context charge", for how a context is measured).
    w1 = node.workload(infer, "alloc", 3 * GiB, "hold")
    w2 = None
    try:
        assert result(w1, "alloc") == 0 and result(w1, "hold") == 0
        w2 = node.workload(notebook, "alloc", 1 * GiB, "hold")
        assert result(w2, "alloc") == 0 and result(w2, "hold") == 0
        s = node.wait_scrape(
            lambda s: (
                s.get("gpufrac_container_memory_used_bytes", pod="infer") == 3 * GiB + CTX
                and s.get("gpufrac_container_memory_used_bytes", pod="notebook") == 1 * GiB + CTX
            ),
            "both workloads' memory",
        )
    finally:
        finish(w1)
        if w2 is not None:
            finish(w2)

    # The scrape as Prometheus would store it (target labels added; the workload's
    # namespace/pod kept by honorLabels), and DCGM's series for the same GPUs.
    inputs: dict[str, float] = {}
    for (name, ls), v in s.samples.items():
        if name.startswith("gpufrac_"):
            inputs[series(name, {**GPUFRAC_TARGET, **dict(ls)})] = v
    gpus = dcgm_gpus()
    used_mib, util, power, temp = {}, {}, {}, {}
    for i, g in enumerate(gpus):
        uuid = g["UUID"]
        nvml = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByUUID(uuid))
        used_mib[uuid] = int(nvml.used) // MiB  # DCGM reports framebuffer in MiB
        util[uuid], power[uuid], temp[uuid] = 10 * (i + 1), WATTS.get(i, 60), 90 if i == HOT else 60
        inputs[series("DCGM_FI_DEV_FB_USED", g)] = used_mib[uuid]
        inputs[series("DCGM_FI_DEV_GPU_UTIL", g)] = util[uuid]
        inputs[series("DCGM_FI_DEV_POWER_USAGE", g)] = power[uuid]
        inputs[series("DCGM_FI_DEV_GPU_TEMP", g)] = temp[uuid]
    by_uuid = {g["UUID"]: g for g in gpus}

    # What each recipe must give, worked out from the same numbers.
    def strip(labels: dict[str, str]) -> dict[str, str]:
        # Prometheus keeps no empty label (claim="" of a device-plugin container is no label).
        return {k: v for k, v in {**GPUFRAC_TARGET, **labels}.items() if k != "__name__" and v != ""}

    requests = samples(s, "gpufrac_container_memory_request_bytes")
    used = samples(s, "gpufrac_container_memory_used_bytes")
    assert requests and used and all("UUID" in ls and ls["UUID"] == ls["uuid"] for ls, _ in requests + used)
    used_sum: dict[str, float] = defaultdict(float)
    for ls, v in used:
        used_sum[ls["UUID"]] += v
    hot_pods: dict[tuple[str, str], int] = defaultdict(int)
    for ls, _ in requests:
        if temp[ls["UUID"]] > 85:
            hot_pods[(ls["namespace"], ls["pod"])] += 1
    assert hot_pods, "no container landed on the hot GPU: the hot-GPU recipe would prove nothing"
    gpu_req = {ls["UUID"]: v for ls, v in samples(s, "gpufrac_gpu_memory_requested_bytes")}
    gpu_burst = {ls["UUID"]: v for ls, v in samples(s, "gpufrac_gpu_memory_burst_granted_bytes")}

    def exp(labels: dict[str, str], v: float) -> dict:
        return {"labels": series("", labels), "value": v}

    expected = {
        "gpufrac:container_gpu_util_percent:dcgm": [
            exp({**strip(ls), "modelName": by_uuid[ls["UUID"]]["modelName"]}, util[ls["UUID"]])
            for ls, _ in requests
        ],
        "gpufrac:container_power_watts_by_memory_share:dcgm": [
            exp(strip(ls), power[ls["UUID"]] * v / used_sum[ls["UUID"]])
            for ls, v in used
            if used_sum[ls["UUID"]]
        ],
        "gpufrac:pod_containers_on_hot_gpu:dcgm": [
            exp({"namespace": ns, "pod": pod}, n) for (ns, pod), n in hot_pods.items()
        ],
        "gpufrac:gpu_memory_beyond_granted_bytes:dcgm": [
            exp(g, used_mib[g["UUID"]] * MiB - gpu_req[g["UUID"]] - gpu_burst[g["UUID"]]) for g in gpus
        ],
    }
    found = recipes()
    assert set(found) == set(expected), f"METRICS.md recipes {sorted(found)} != tested {sorted(expected)}"
    for name, expr in found.items():
        assert re.search(r"\bon\(UUID\)", expr), f"{name} does not join on UUID"
    tests = [{"expr": expr, "eval_time": "2m", "exp_samples": expected[name]} for name, expr in found.items()]
    out = promtool_test(tmp_path, inputs, tests)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_recipe_check_fails_on_a_label_name_mismatch(in_process_nvml: object, tmp_path: Path) -> None:
    # The same join with gpufrac's lowercase name on one side matches nothing, and promtool says so.
    g = dcgm_gpus()[0]
    inputs = {
        series("DCGM_FI_DEV_GPU_UTIL", g): 50,
        series("gpufrac_gpu_memory_total_bytes", {"uuid": g["UUID"], **GPUFRAC_TARGET}): 80 * GiB,
    }
    expr = "gpufrac_gpu_memory_total_bytes * 0 + on(UUID) group_left() DCGM_FI_DEV_GPU_UTIL"
    want = [{"labels": series("", {"uuid": g["UUID"], **GPUFRAC_TARGET}), "value": 50}]
    out = promtool_test(tmp_path, inputs, [{"expr": expr, "eval_time": "2m", "exp_samples": want}])
    assert out.returncode != 0
