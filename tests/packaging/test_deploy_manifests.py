"""The cluster install (deploy/daemonset) checked offline.

* Every Kubernetes object validates against the Kubernetes OpenAPI schemas that
  ship inside kubernetes-validate (strict: unknown fields are errors), for the
  oldest and the newest Kubernetes version we claim. No network is touched: the
  package picks the newest bundled schema set not newer than the version asked for.
* `kubectl kustomize` builds the base and the optional parts (kubectl must be
  installed; `make tools` installs Debian's when it is missing).
* The node config the ConfigMap carries loads through gpufrac.core.config, so
  the manifests and the agent's config loader cannot drift apart.
* The DaemonSet agrees with the agent: its command parses with the real CLI, the
  host paths and ports are the config's, the RBAC grants exactly what the agent
  calls, and the image and Dockerfile agree with the init container.
* Kinds the Kubernetes schemas do not cover (ServiceMonitor, the scheduler and
  descheduler configurations, the Grafana dashboard) get targeted checks.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any, get_type_hints

import kubernetes_validate
import pytest
import yaml

import gpufrac
from gpufrac.agent.cli.commands import build_parser
from gpufrac.core import annotations, config, slices
from gpufrac.core.native import REPO_ROOT
from gpufrac.core.units import parse_bytes

pytestmark = pytest.mark.tools

DEPLOY = REPO_ROOT / "deploy" / "daemonset"
# DRA mode's install: the base plus the DRA agent, DeviceClasses and RBAC (a kustomize overlay
# beside the base, which it includes), and its examples.
DRA = REPO_ROOT / "deploy" / "dra"
NAMESPACE = "gpufrac-system"
# Oldest Kubernetes the manifests claim to support, and the newest the bundled schemas know.
K8S_VERSIONS = ("1.28.0", kubernetes_validate.latest_version())
# DRA mode's objects (deploy/dra): resource.k8s.io/v1 with consumable capacity, on by default
# from 1.36; checked against 1.36 and the newest.
DRA_K8S_VERSIONS = ("1.36.0", kubernetes_validate.latest_version())
# What the agent calls in DRA mode besides AGENT_API_CALLS (gpufrac/agent/kube/claims.py and
# resourceslices.py): deploy/dra/clusterrole.yaml grants exactly these.
DRA_API_CALLS = {
    ("resource.k8s.io", "resourceslices", "get"),
    ("resource.k8s.io", "resourceslices", "list"),
    ("resource.k8s.io", "resourceslices", "create"),
    ("resource.k8s.io", "resourceslices", "update"),
    ("resource.k8s.io", "resourceslices", "delete"),
    ("resource.k8s.io", "resourceclaims", "get"),
}
# Kinds without a schema in kubernetes-validate; each has its own test below.
CHECKED_ELSEWHERE = {"ServiceMonitor", "KubeSchedulerConfiguration", "DeschedulerPolicy", "Kustomization"}
# What the agent calls on the API server (gpufrac/agent/kube/, its only door to it):
# (apiGroup, resource, verb). Anything beyond this is a privilege it does not use.
AGENT_API_CALLS = {
    ("", "pods", "get"),
    ("", "pods", "list"),
    ("", "pods", "watch"),
    ("", "pods/eviction", "create"),
    ("", "pods/status", "patch"),
    ("", "events", "create"),
    ("", "events", "patch"),
    ("", "nodes", "get"),
    ("", "nodes", "patch"),
}


# -- helpers -----------------------------------------------------------------------------------------


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _manifest_files() -> list[Path]:
    """Every YAML file under deploy/daemonset that holds Kubernetes-style objects."""
    return sorted(p for p in DEPLOY.rglob("*.yaml") if p.name != "config.yaml")


@cache
def _kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        pytest.fail(
            "kubectl is not installed, so `kubectl kustomize` cannot be checked: run `make tools` "
            "(as root it installs Debian's kubernetes-client) or install kubectl yourself"
        )
    return path


@cache
def _kustomize(subdir: str = "") -> tuple[dict[str, Any], ...]:
    out = subprocess.run(
        [_kubectl(), "kustomize", str(DEPLOY / subdir)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, f"kubectl kustomize deploy/daemonset/{subdir} failed:\n{out.stderr}"
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


@cache
def _kustomize_dra() -> tuple[dict[str, Any], ...]:
    out = subprocess.run([_kubectl(), "kustomize", str(DRA)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"kubectl kustomize deploy/dra failed:\n{out.stderr}"
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


def _one(objs: tuple[dict[str, Any], ...] | list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [o for o in objs if o["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def _agent_pod() -> dict[str, Any]:
    return _one(_kustomize(), "DaemonSet")["spec"]["template"]


def _container(pod: dict[str, Any], name: str, init: bool = False) -> dict[str, Any]:
    key = "initContainers" if init else "containers"
    return next(c for c in pod["spec"][key] if c["name"] == name)


def _shipped_config(tmp_path: Path) -> config.Config:
    """The node config exactly as the cluster gets it: from the built ConfigMap."""
    cm = _one(_kustomize(), "ConfigMap")
    path = tmp_path / "config.yaml"
    path.write_text(cm["data"]["config.yaml"])
    return config.load(path)


def _fields(cls: type[Any], prefix: str = "") -> Iterator[str]:
    """Dotted camelCase keys of a config dataclass, recursively."""
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = prefix + config._camel(f.name)
        if dataclasses.is_dataclass(hints[f.name]):
            yield from _fields(hints[f.name], key + ".")
        else:
            yield key


def _keys(data: dict[str, Any], prefix: str = "") -> Iterator[str]:
    for k, v in data.items():
        if isinstance(v, dict) and v:  # an empty mapping ({}) is a key's value, not a section
            yield from _keys(v, f"{prefix}{k}.")
        else:
            yield prefix + k


def _rules(role: dict[str, Any]) -> set[tuple[str, str, str]]:
    return {
        (group, res, verb)
        for rule in role["rules"]
        for group in rule.get("apiGroups", [])
        for res in rule.get("resources", [])
        for verb in rule["verbs"]
    }


def _pod_specs() -> Iterator[tuple[Path, dict[str, Any]]]:
    """(file, pod template) for every workload in examples/."""
    for path in sorted((DEPLOY / "examples").glob("*.yaml")):
        for doc in _docs(path):
            if doc["kind"] == "Pod":
                yield path, doc
            elif doc["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
                yield path, doc["spec"]["template"]


# -- Kubernetes schemas ------------------------------------------------------------------------------


def _dra_files() -> list[Path]:
    """deploy/dra's objects: its resources and examples (its config.yaml is a node config, and
    its patch a fragment: both are checked through the built overlay)."""
    skip = {"config.yaml", "device-plugin-affinity.yaml"}
    return sorted(p for p in DRA.rglob("*.yaml") if p.name not in skip)


def _manifest_versions() -> list[Any]:
    """(file, Kubernetes version) to validate: DRA mode's files against the versions it needs."""
    return [
        pytest.param(p, v, id=f"{p.relative_to(DEPLOY.parent)}-{v}")
        for p, versions in [(p, K8S_VERSIONS) for p in _manifest_files()]
        + [(p, DRA_K8S_VERSIONS) for p in _dra_files()]
        for v in versions
    ]


@pytest.mark.parametrize(("path", "version"), _manifest_versions())
def test_every_manifest_matches_the_kubernetes_schema(path: Path, version: str) -> None:
    docs = _docs(path)
    assert docs, f"{path} holds no objects"
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            assert doc["kind"] in CHECKED_ELSEWHERE, f"{path}: no schema and no check for kind {doc['kind']}"
        except kubernetes_validate.ValidationError as e:
            where = ".".join(str(p) for p in e.path)
            pytest.fail(
                f"{path.relative_to(DEPLOY.parent)} {doc['kind']} invalid for Kubernetes {version}: "
                f"{where}: {e.message}"
            )


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_the_built_objects_match_the_kubernetes_schema(version: str) -> None:
    # What kustomize emits (generated ConfigMap, rewritten names) is what the cluster receives.
    for doc in (*_kustomize(), *_kustomize("monitoring"), *_kustomize("rbac-pod-delete")):
        if doc["kind"] in CHECKED_ELSEWHERE:
            continue
        kubernetes_validate.validate(doc, version, strict=True)


def test_schema_validation_rejects_a_misspelled_field() -> None:
    # The schema check above is only worth something if it catches the typical mistake.
    ds = json.loads(json.dumps(_one(_kustomize(), "DaemonSet")))
    ds["spec"]["template"]["spec"]["hostPid"] = True
    with pytest.raises(kubernetes_validate.ValidationError, match="hostPid"):
        kubernetes_validate.validate(ds, K8S_VERSIONS[-1], strict=True)


# -- kustomize ---------------------------------------------------------------------------------------


def test_kustomize_builds_the_base_without_crds() -> None:
    objs = _kustomize()
    kinds = sorted(o["kind"] for o in objs)
    assert kinds == sorted(
        ["Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "ConfigMap", "DaemonSet"]
    )
    # Only built-in API groups: nothing that needs the Prometheus Operator (or any CRD).
    assert {o["apiVersion"].rpartition("/")[0] for o in objs} <= {"", "apps", "rbac.authorization.k8s.io"}
    for o in objs:
        if o["kind"] not in ("Namespace", "ClusterRole", "ClusterRoleBinding"):
            assert o["metadata"]["namespace"] == NAMESPACE, f"{o['kind']} is not in {NAMESPACE}"
    # The generated ConfigMap carries a content hash and the DaemonSet follows it,
    # so a config change rolls the agents.
    cm_name = _one(objs, "ConfigMap")["metadata"]["name"]
    assert re.fullmatch(r"gpufrac-config-[a-z0-9]{10}", cm_name)
    volumes = {v["name"]: v for v in _agent_pod()["spec"]["volumes"]}
    assert volumes["config"]["configMap"]["name"] == cm_name


def test_kustomize_image_is_this_version() -> None:
    kust = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    (image,) = kust["images"]
    assert image["newTag"] == gpufrac.__version__
    pod = _agent_pod()["spec"]
    for c in (*pod["initContainers"], *pod["containers"]):
        assert c["image"] == f"{image['name']}:{gpufrac.__version__}"


# -- the node config ---------------------------------------------------------------------------------


def test_shipped_config_loads_and_is_the_defaults(tmp_path: Path) -> None:
    shipped = _shipped_config(tmp_path)
    defaults = config.Config()
    # nodeName differs per node and comes from NODE_NAME; everything else is the built-in default.
    assert dataclasses.replace(shipped, node_name="n") == dataclasses.replace(defaults, node_name="n")


def test_config_file_names_every_key_once_each_with_a_comment() -> None:
    text = (DEPLOY / "config.yaml").read_text()
    documented = set(_keys(yaml.safe_load(text)))
    expected = set(_fields(config.Config)) - {"nodeName"}
    assert documented == expected, (
        f"missing: {sorted(expected - documented)}, unknown: {sorted(documented - expected)}"
    )
    # Section headers ("paths:") stand alone; every line that sets a value has a comment above it.
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"^\s*([A-Za-z]+):\s*\S", line)
        if m:
            assert lines[i - 1].strip().startswith("#"), (
                f"config.yaml key {m.group(1)!r} has no comment above it"
            )


def test_a_typo_in_the_shipped_config_is_refused(tmp_path: Path) -> None:
    # An operator's typo must stop the agent with the key named, not fall back silently.
    bad = tmp_path / "config.yaml"
    bad.write_text((DEPLOY / "config.yaml").read_text().replace("waitTimeout:", "waitTimeOut:"))
    with pytest.raises(config.ConfigError, match="waitTimeOut"):
        config.load(bad)


# -- the DaemonSet agrees with the agent ------------------------------------------------------------


def test_daemonset_runs_the_agent_command_with_the_mounted_config() -> None:
    pod = _agent_pod()
    agent = _container(pod, "agent")
    argv = [*agent["command"], *agent.get("args", [])]
    assert argv[0] == "gpufrac"
    parser, handlers = build_parser()
    args = parser.parse_args(argv[1:])
    assert handlers[args.command][0] == "gpufrac.agent.main"
    mounts = {m["name"]: m["mountPath"] for m in agent["volumeMounts"]}
    assert Path(args.config).parent == Path(mounts["config"])
    env = {e["name"]: e for e in agent["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"


def test_daemonset_mounts_the_configured_host_paths_at_the_same_place(tmp_path: Path) -> None:
    cfg = _shipped_config(tmp_path)
    pod = _agent_pod()
    host = {v["name"]: v["hostPath"]["path"] for v in pod["spec"]["volumes"] if "hostPath" in v}
    mounts = {m["name"]: m["mountPath"] for m in _container(pod, "agent")["volumeMounts"]}
    needed = {
        cfg.paths.state_dir,
        cfg.paths.device_plugin_dir,
        str(Path(cfg.paths.pod_resources_socket).parent),
    }
    assert set(host.values()) == needed
    # The agent hands host paths to the kubelet, so inside == outside.
    for name, path in host.items():
        assert mounts[name] == path, f"volume {name}: host {path} mounted at {mounts.get(name)}"
    # The status socket lives on a writable mount (the root filesystem is read-only).
    assert _container(pod, "agent")["securityContext"]["readOnlyRootFilesystem"] is True
    assert any(Path(cfg.status_socket).parent == Path(p) for p in mounts.values())


def test_daemonset_probes_and_metrics_port_follow_the_config(tmp_path: Path) -> None:
    cfg = _shipped_config(tmp_path)
    agent = _container(_agent_pod(), "agent")
    ports = {p["name"]: p["containerPort"] for p in agent["ports"]}
    assert ports == {"metrics": cfg.metrics.port}
    assert agent["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert agent["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert agent["startupProbe"]["httpGet"]["path"] == "/healthz"
    ann = _agent_pod()["metadata"]["annotations"]
    assert ann["prometheus.io/port"] == str(cfg.metrics.port)


def test_daemonset_security_is_minimal_and_node_critical() -> None:
    pod = _agent_pod()
    spec = pod["spec"]
    assert spec["hostPID"] is True
    assert spec["priorityClassName"] == "system-node-critical"
    assert spec["nodeSelector"] == {"gpufrac.dev/enabled": "true"}
    assert not spec.get("hostNetwork") and not spec.get("hostIPC")
    agent = _container(pod, "agent")["securityContext"]
    assert agent.get("privileged") is not True
    assert agent["allowPrivilegeEscalation"] is False
    assert agent["capabilities"]["drop"] == ["ALL"]
    assert sorted(agent["capabilities"]["add"]) == ["KILL", "SYS_PTRACE"]
    init = _container(pod, "install-shim", init=True)["securityContext"]
    assert init["capabilities"] == {"drop": ["ALL"]} and init["allowPrivilegeEscalation"] is False
    # Each added capability is explained in the manifest, next to where it is granted.
    text = (DEPLOY / "daemonset.yaml").read_text()
    for cap in ("SYS_PTRACE", "KILL"):
        lines = text.splitlines()
        at = next(i for i, ln in enumerate(lines) if ln.strip() == f"- {cap}")
        assert lines[at - 1].strip().startswith("#"), f"{cap} is granted without a comment saying why"
    for c in (*spec["initContainers"], *spec["containers"]):
        assert {"cpu", "memory"} <= set(c["resources"]["requests"]), c["name"]
        assert "memory" in c["resources"]["limits"], c["name"]


def test_shim_goes_where_the_agent_expects_it(tmp_path: Path) -> None:
    cfg = _shipped_config(tmp_path)
    init = _container(_agent_pod(), "install-shim", init=True)
    script = " ".join(init["command"])
    sources = re.findall(r"install -D -m \d+ (\S+) (\S+)", script)
    assert len(sources) == 1
    source, tmp = sources[0]
    assert re.search(rf"mv -f {re.escape(tmp)} {re.escape(cfg.paths.shim_host_path)}\b", script)
    # The image puts the shim where the init container copies it from, and tells
    # gpufrac.core.native where its native parts are.
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert re.search(rf"^COPY --from=shim \S+/libmemguard\.so {re.escape(source)}$", dockerfile, re.M)
    assert re.search(rf"GPUFRAC_NATIVE_DIR={re.escape(str(Path(source).parent))}\b", dockerfile)


def test_dockerfile_builds_with_the_projects_own_make_targets() -> None:
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    stages = re.findall(r"^FROM \S+ AS (\w+)$", dockerfile, re.M)
    assert stages == ["shim", "wheel", "runtime"]
    targets = re.findall(r"^RUN make (\S+)", dockerfile, re.M)
    assert targets == ["build/native/libmemguard.so", "proto"]
    for target in targets:
        dry = subprocess.run(
            ["make", "-n", "-C", str(REPO_ROOT), target], capture_output=True, text=True, timeout=60
        )
        assert dry.returncode == 0, f"Makefile has no working target {target}: {dry.stderr}"
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", dockerfile, re.M).group(1))
    agent = _container(_agent_pod(), "agent")
    assert cmd == agent["args"]
    assert json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", dockerfile, re.M).group(1)) == agent["command"]
    assert re.search(r"^USER (?!0\b|root\b)\S+$", dockerfile, re.M), "the image should default to non-root"


# -- RBAC --------------------------------------------------------------------------------------------


def test_rbac_grants_exactly_what_the_agent_calls() -> None:
    objs = _kustomize()
    role = _one(objs, "ClusterRole")
    for rule in role["rules"]:
        assert "nonResourceURLs" not in rule and "resourceNames" not in rule
        for field in ("apiGroups", "resources", "verbs"):
            assert "*" not in rule[field], f"wildcard in {field}: {rule}"
    assert _rules(role) == AGENT_API_CALLS
    binding = _one(objs, "ClusterRoleBinding")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": role["metadata"]["name"],
    }
    sa = _one(objs, "ServiceAccount")["metadata"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": sa["name"], "namespace": sa["namespace"]}
    ]
    assert _agent_pod()["spec"]["serviceAccountName"] == sa["name"]


def test_pod_delete_is_a_separate_opt_in() -> None:
    objs = _kustomize("rbac-pod-delete")
    assert _rules(_one(objs, "ClusterRole")) == {("", "pods", "delete")}
    binding = _one(objs, "ClusterRoleBinding")
    sa = _one(_kustomize(), "ServiceAccount")["metadata"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": sa["name"], "namespace": sa["namespace"]}
    ]
    assert config.Config().idle.allow_delete is False


# -- monitoring --------------------------------------------------------------------------------------


def test_monitoring_selects_the_agents_metrics_port() -> None:
    objs = _kustomize("monitoring")
    svc = _one(objs, "Service")
    monitor = _one(objs, "ServiceMonitor")
    pod = _agent_pod()
    assert svc["metadata"]["namespace"] == NAMESPACE == monitor["metadata"]["namespace"]
    # Service -> agent pods -> their named metrics port.
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert svc["spec"]["clusterIP"] == "None"
    (port,) = svc["spec"]["ports"]
    assert port["targetPort"] in {p["name"] for p in _container(pod, "agent")["ports"]}
    # ServiceMonitor -> Service.
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert NAMESPACE in monitor["spec"]["namespaceSelector"]["matchNames"]
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == port["name"] and endpoint["path"] == "/metrics"
    # Workload namespace/pod/container labels must survive scraping unrenamed.
    assert endpoint["honorLabels"] is True
    assert {
        "sourceLabels": ["__meta_kubernetes_pod_node_name"],
        "targetLabel": "node",
        "action": "replace",
    } in (endpoint["relabelings"])


def _metrics_table() -> dict[str, str]:
    """name -> type from the tables in METRICS.md."""
    rows = re.findall(r"^\| `(gpufrac_\w+)` \| (\w+) \|", (DEPLOY / "METRICS.md").read_text(), re.M)
    return dict(rows)


def test_metrics_names_follow_prometheus_conventions() -> None:
    table = _metrics_table()
    assert len(table) >= 20
    for name, kind in table.items():
        assert kind in ("gauge", "counter", "histogram"), name
        assert name.endswith("_total") == (kind == "counter"), f"{name}: only counters end in _total"
        if kind == "histogram":
            assert name.endswith(("_seconds", "_bytes")), f"{name}: a histogram needs a base unit"
        assert not re.search(r"_(ms|milliseconds|kb|mb|gb|mib|gib|percent)(_|$)", name), (
            f"{name}: non-base unit"
        )


def test_dashboard_queries_only_documented_metrics_and_covers_them() -> None:
    dash = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    table = _metrics_table()
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [v["query"]["query"] for v in dash["templating"]["list"] if isinstance(v.get("query"), dict)]
    used = set()
    for name in re.findall(r"\bgpufrac_\w+", " ".join(exprs)):
        base = re.sub(r"_(bucket|count|sum)$", "", name) if name not in table else name
        assert base in table, f"dashboard queries {name}, which METRICS.md does not list"
        used.add(base)
    # The dashboard charts every metric METRICS.md lists but one: NVLink topology is a table, not a trend.
    assert set(table) - used == {"gpufrac_gpu_nvlink_links"}
    # Every panel reads from the chosen data source.
    assert all(p["datasource"]["uid"] == "${datasource}" for p in dash["panels"] if p["type"] != "row")


# -- examples ----------------------------------------------------------------------------------------


def test_examples_request_gpufrac_resources_with_valid_annotations() -> None:
    priority_classes = {d["metadata"]["name"] for d in _docs(DEPLOY / "examples" / "priorityclasses.yaml")}
    cfg = config.Config()
    seen: dict[str, dict[str, Any]] = {}
    for path, pod in _pod_specs():
        spec, ann = pod["spec"], pod["metadata"].get("annotations", {})
        names = [c["name"] for c in spec["containers"]]
        gpu = {
            (c["name"], r): v
            for c in spec["containers"]
            for r, v in c["resources"].get("limits", {}).items()
            if r in slices.RESOURCES
        }
        assert gpu, f"{path.name} requests no gpufrac resource"
        for (container, resource), value in gpu.items():
            assert isinstance(value, int) and value > 0
            if resource == slices.FRACTION:
                assert value <= 100 or value % 100 == 0, f"{path.name}: gpu-fraction {value}"
                request = cfg.memory_unit  # any request: only the annotations are checked here
            else:
                request = value * cfg.memory_unit
            result = annotations.parse_policy(
                ann,
                container=container,
                request_bytes=request,
                gpu_allocatable=80 << 30,
                cfg=cfg,
                containers=names,
                whole_gpu=resource == slices.FRACTION and value >= 200,
            )
            assert result.problems == [], f"{path.name}: {[p.message(container) for p in result.problems]}"
        if "priorityClassName" in spec:
            assert spec["priorityClassName"] in priority_classes
        seen[path.name] = {"ann": ann, "gpu": gpu}
    # The three workloads the install section walks through.
    inference = seen["inference-server.yaml"]
    assert parse_bytes(inference["ann"][annotations.MEMORY_LIMIT]) > 8 * cfg.memory_unit
    assert inference["gpu"] == {("server", slices.MEMORY): 8}
    notebook = seen["notebook.yaml"]["ann"]
    assert notebook[annotations.WORKLOAD_CLASS] == "interactive" and annotations.IDLE_TIMEOUT in notebook
    assert seen["training-whole-gpu.yaml"]["gpu"] == {("trainer", slices.FRACTION): 200}


# -- cluster-level packing ---------------------------------------------------------------------------


def test_scheduler_profile_scores_gpufrac_resources_most_allocated() -> None:
    (cfg,) = _docs(DEPLOY / "scheduler" / "kube-scheduler-config.yaml")
    assert cfg["apiVersion"] == "kubescheduler.config.k8s.io/v1"
    assert cfg["kind"] == "KubeSchedulerConfiguration"
    profiles = {p["schedulerName"]: p for p in cfg["profiles"]}
    assert len(profiles) == len(cfg["profiles"])
    binpack = profiles["gpufrac-binpack"]
    (fit,) = [pc for pc in binpack["pluginConfig"] if pc["name"] == "NodeResourcesFit"]
    strategy = fit["args"]["scoringStrategy"]
    assert strategy["type"] == "MostAllocated"
    weights = {r["name"]: r["weight"] for r in strategy["resources"]}
    assert set(slices.RESOURCES) <= set(weights)
    # The GPU resources dominate the score; weights must be positive integers (1..100 in kube-scheduler).
    assert all(isinstance(w, int) and 1 <= w <= 100 for w in weights.values())
    assert min(weights[r] for r in slices.RESOURCES) > max(
        w for r, w in weights.items() if r not in slices.RESOURCES
    )
    disabled = {p["name"] for p in binpack["plugins"]["score"]["disabled"]}
    assert "NodeResourcesBalancedAllocation" in disabled


def test_descheduler_policy_consolidates_gpufrac_nodes_only() -> None:
    (policy,) = _docs(DEPLOY / "descheduler" / "policy.yaml")
    assert policy["apiVersion"] == "descheduler/v1alpha2" and policy["kind"] == "DeschedulerPolicy"
    node_label = _agent_pod()["spec"]["nodeSelector"]
    assert policy["nodeSelector"] == ",".join(f"{k}={v}" for k, v in node_label.items())
    (profile,) = policy["profiles"]
    assert profile["plugins"]["balance"]["enabled"] == ["HighNodeUtilization"]
    args = {pc["name"]: pc.get("args", {}) for pc in profile["pluginConfig"]}
    thresholds = args["HighNodeUtilization"]["thresholds"]
    assert set(thresholds) == set(slices.RESOURCES)
    assert all(0 < v < 100 for v in thresholds.values())
    evictor = args["DefaultEvictor"]
    assert evictor["nodeFit"] is True
    # Opt-in only, and the opted-in example is the one that tolerates a restart.
    selector = evictor["labelSelector"]["matchLabels"]
    for path, pod in _pod_specs():
        opted_in = selector.items() <= pod["metadata"].get("labels", {}).items()
        assert opted_in == (path.name == "inference-server.yaml"), path.name


# -- DRA mode (deploy/dra) -----------------------------------------------------------------------------


def _dra_daemonsets() -> tuple[dict[str, Any], dict[str, Any]]:
    """The device-plugin DaemonSet and the DRA one, as `kubectl kustomize deploy/dra` builds them."""
    objs = _kustomize_dra()
    sets = {o["metadata"]["name"]: o for o in objs if o["kind"] == "DaemonSet"}
    assert set(sets) == {"gpufrac-agent", "gpufrac-agent-dra"}
    return sets["gpufrac-agent"], sets["gpufrac-agent-dra"]


def test_dra_overlay_builds_the_base_and_one_mode_per_node() -> None:
    objs = _kustomize_dra()
    for o in objs:
        for version in DRA_K8S_VERSIONS:
            try:
                kubernetes_validate.validate(o, version, strict=True)
            except kubernetes_validate.SchemaNotFoundError:
                assert o["kind"] in CHECKED_ELSEWHERE
    # The base, unchanged but for its DaemonSet keeping off nodes in DRA mode.
    base = {(o["kind"], o["metadata"]["name"]) for o in _kustomize()}
    assert base <= {(o["kind"], o["metadata"]["name"]) for o in objs}
    device_plugin, dra = _dra_daemonsets()
    terms = device_plugin["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"]
    assert terms == [
        {"matchExpressions": [{"key": "gpufrac.dev/mode", "operator": "NotIn", "values": ["dra"]}]}
    ]
    assert dra["spec"]["template"]["spec"]["nodeSelector"] == {
        "gpufrac.dev/enabled": "true",
        "gpufrac.dev/mode": "dra",
    }
    assert {o["metadata"]["name"] for o in objs if o["kind"] == "DeviceClass"} == {
        "gpu-memory.gpufrac.dev",
        "gpu.gpufrac.dev",
    }


def test_dra_daemonset_is_the_base_one_but_for_its_mode() -> None:
    """deploy/dra/daemonset.yaml copies the base's: the differences its header lists, no others."""
    device_plugin, dra = _dra_daemonsets()
    a, b = json.loads(json.dumps(device_plugin)), json.loads(json.dumps(dra))
    del a["spec"]["template"]["spec"]["affinity"]  # the overlay's patch of the base
    for o in (a, b):
        o["metadata"]["name"] = "x"
        for labels in (o["metadata"]["labels"], o["spec"]["selector"]["matchLabels"]):
            labels.pop("gpufrac.dev/mode", None)
        o["spec"]["template"]["metadata"]["labels"].pop("gpufrac.dev/mode", None)
        o["spec"]["template"]["spec"].pop("nodeSelector")
        agent = _container(o["spec"]["template"], "agent")
        agent.pop("args")
        keep = {"config", "state", "pod-resources", "run", "tmp"}
        agent["volumeMounts"] = [m for m in agent["volumeMounts"] if m["name"] in keep]
        o["spec"]["template"]["spec"]["volumes"] = [
            v for v in o["spec"]["template"]["spec"]["volumes"] if v["name"] in keep
        ]
    assert a == b


def test_dra_agent_runs_in_dra_mode_with_the_paths_its_config_names(tmp_path: Path) -> None:
    _, dra = _dra_daemonsets()
    pod = dra["spec"]["template"]
    agent = _container(pod, "agent")
    parser, handlers = build_parser()
    args = parser.parse_args([*agent["command"], *agent["args"]][1:])
    assert handlers[args.command][0] == "gpufrac.agent.main"
    # The config the agent loads: the base's node config with deploy/dra's overlay over it.
    mounts = {m["name"]: m["mountPath"] for m in agent["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    maps = {o["metadata"]["name"]: o for o in _kustomize_dra() if o["kind"] == "ConfigMap"}
    files = {}
    for name in ("config", "config-dra"):
        cm = maps[volumes[name]["configMap"]["name"]]
        (key,) = cm["data"]
        files[name] = tmp_path / f"{name}.yaml"
        files[name].write_text(cm["data"][key])
        assert Path(mounts[name]) / key in (Path(args.config), *map(Path, args.config_overlay))
    cfg = config.load(files["config"], overlays=[files["config-dra"]])
    assert cfg.mode == "dra"
    host = {v["name"]: v["hostPath"]["path"] for v in pod["spec"]["volumes"] if "hostPath" in v}
    assert set(host.values()) == {
        cfg.paths.state_dir,
        str(Path(cfg.paths.pod_resources_socket).parent),
        str(Path(config.dra_plugin_socket(cfg)).parent),
        str(Path(config.dra_registration_socket(cfg)).parent),
        cfg.dra.cdi_spec_dir,
    }
    for name, path in host.items():
        assert mounts[name] == path, f"volume {name}: host {path} mounted at {mounts.get(name)}"


def test_dra_rbac_grants_exactly_what_the_agent_calls_in_dra_mode() -> None:
    objs = _kustomize_dra()
    roles = {o["metadata"]["name"]: o for o in objs if o["kind"] == "ClusterRole"}
    assert _rules(roles["gpufrac-agent"]) == AGENT_API_CALLS
    assert _rules(roles["gpufrac-agent-dra"]) == DRA_API_CALLS
    binding = next(
        o for o in objs if o["kind"] == "ClusterRoleBinding" and o["metadata"]["name"].endswith("-dra")
    )
    assert binding["roleRef"]["name"] == "gpufrac-agent-dra"
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "gpufrac-agent", "namespace": NAMESPACE}
    ]


def test_dra_examples_ask_shipped_classes_with_parameters_the_agent_accepts() -> None:
    from gpufrac.core.claimconfig import claim_policy

    classes = {o["metadata"]["name"] for o in _kustomize_dra() if o["kind"] == "DeviceClass"}
    templates = [d for p in sorted((DRA / "examples").glob("*.yaml")) for d in _docs(p)]
    templates = [d for d in templates if d["kind"] == "ResourceClaimTemplate"]
    assert {t["metadata"]["name"] for t in templates} == {"llm-inference-gpu", "notebook-gpu", "training-gpu"}
    for t in templates:
        devices = t["spec"]["spec"]["devices"]
        for req in devices["requests"]:
            assert req["exactly"]["deviceClassName"] in classes
        params = [
            c["opaque"]["parameters"]
            for c in devices.get("config", [])
            if c["opaque"]["driver"] == "gpufrac.dev"
        ]
        _, problems = claim_policy(
            params,
            claim=t["metadata"]["name"],
            request_bytes=parse_bytes("4Gi"),
            gpu_allocatable=parse_bytes("79Gi"),
            cfg=config.Config(),
        )
        assert problems == [], [p.message(t["metadata"]["name"]) for p in problems]
