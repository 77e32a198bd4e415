"""The Helm chart (deploy/helm/gpufrac) rendered by a real helm and held to the kustomize base.

* helm is the project-local binary `make tools` installs (build/tools/helm, pinned), never
  whatever a machine has on PATH.
* With its default values (plus the required image.repository) the chart renders exactly the
  objects `kubectl kustomize deploy/daemonset` does, field for field; the optional parts
  (ServiceMonitor, pod-delete RBAC) exactly the optional kustomizations. Any drift between the
  two installs (a new RBAC rule, a changed probe) fails here.
* Everything it renders validates against the Kubernetes schemas, defaults and overrides alike.
* values.schema.json refuses unknown keys (the node config's too, derived from config.py), and
  the chart refuses to render without an image repository the operator chose.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
from functools import cache
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

import kubernetes_validate
import pytest
import yaml

import gpufrac
from gpufrac.core import config, policy
from gpufrac.core.native import REPO_ROOT

pytestmark = pytest.mark.tools

CHART = REPO_ROOT / "deploy" / "helm" / "gpufrac"
BASE = REPO_ROOT / "deploy" / "daemonset"
HELM = REPO_ROOT / "build" / "tools" / "helm"
K8S_VERSIONS = ("1.28.0", kubernetes_validate.latest_version())
# The base's placeholder image (kustomization.yaml `images:`); the chart gets the same path.
PLACEHOLDER = "set-your-registry.invalid/gpufrac/agent"
NO_SCHEMA = {"ServiceMonitor"}

Obj = dict[str, Any]


def _helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    if not HELM.exists():
        pytest.fail(f"{HELM} is missing: run `make tools` (it installs the pinned helm there)")
    out = subprocess.run([str(HELM), *args], capture_output=True, text=True, timeout=120)
    if check:
        assert out.returncode == 0, f"helm {' '.join(args)} failed:\n{out.stderr}"
    return out


def _sets(values: dict[str, Any]) -> list[str]:
    # --set-json keeps types exactly (strings stay strings, as they would in a values file).
    return [a for k, v in values.items() for a in ("--set-json", f"{k}={json.dumps(v)}")]


def _render(**values: Any) -> tuple[Obj, ...]:
    values.setdefault("image.repository", PLACEHOLDER)
    out = _helm("template", "gpufrac", str(CHART), *_sets(values))
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


def _render_error(**values: Any) -> str:
    out = _helm("template", "gpufrac", str(CHART), *_sets(values), check=False)
    assert out.returncode != 0, "helm template accepted values it should refuse"
    return out.stderr


@cache
def _kustomize(subdir: str = "") -> tuple[Obj, ...]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.fail("kubectl is not installed: run `make tools`")
    out = subprocess.run(
        [kubectl, "kustomize", str((BASE / subdir).resolve())], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


def _key(o: Obj) -> tuple[str, str, str | None, str]:
    return (o["apiVersion"], o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"])


def _by_key(objs: tuple[Obj, ...]) -> dict[tuple[str, str, str | None, str], Obj]:
    table = {_key(o): o for o in objs}
    assert len(table) == len(objs), "two objects with the same kind, namespace and name"
    return table


def _differences(a: Any, b: Any, where: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b)) for d in _differences(a.get(k), b.get(k), f"{where}.{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [
            d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in _differences(x, y, f"{where}[{i}]")
        ]
    return [] if a == b else [f"{where}: kustomize {a!r} != helm {b!r}"]


def _assert_same_objects(kustomized: tuple[Obj, ...], rendered: tuple[Obj, ...]) -> None:
    k, h = _by_key(kustomized), _by_key(rendered)
    assert set(k) == set(h), (
        f"only kustomize: {sorted(set(k) - set(h))}; only helm: {sorted(set(h) - set(k))}"
    )
    problems = [d for key in k for d in _differences(k[key], h[key], f"{key[1]}/{key[3]}")]
    assert not problems, "helm and kustomize disagree:\n" + "\n".join(problems)


def _one(objs: tuple[Obj, ...], kind: str) -> Obj:
    (found,) = [o for o in objs if o["kind"] == kind]
    return found


def _agent(objs: tuple[Obj, ...]) -> Obj:
    return _one(objs, "DaemonSet")["spec"]["template"]["spec"]["containers"][0]


# -- the tool ----------------------------------------------------------------------------------------


def test_helm_is_the_pinned_project_local_binary() -> None:
    makefile = (REPO_ROOT / "Makefile").read_text()
    pinned = next(ln.split(":=")[1].strip() for ln in makefile.splitlines() if ln.startswith("HELM_VERSION"))
    assert _helm("version", "--short").stdout.startswith(pinned + "+")


def test_chart_lints_strictly() -> None:
    out = _helm(
        "lint", "--strict", str(CHART), *_sets({"image.repository": "registry.example.com/gpufrac/agent"})
    )
    assert "0 chart(s) failed" in out.stdout


# -- the same objects as kustomize -------------------------------------------------------------------


def test_defaults_render_exactly_the_kustomize_base() -> None:
    _assert_same_objects(_kustomize(), _render())


def test_service_monitor_renders_exactly_the_monitoring_kustomization() -> None:
    _assert_same_objects(
        (*_kustomize(), *_kustomize("monitoring")), _render(**{"monitoring.serviceMonitor.enabled": True})
    )


def test_pod_delete_rbac_renders_exactly_the_rbac_kustomization() -> None:
    _assert_same_objects((*_kustomize(), *_kustomize("rbac-pod-delete")), _render(**{"rbac.podDelete": True}))


def test_dra_renders_exactly_the_dra_kustomization() -> None:
    # deploy/dra is the base plus DRA mode's objects: the chart with dra.enabled, the same.
    _assert_same_objects(_kustomize("../dra"), _render(**{"dra.enabled": True}))


def test_dra_keeps_the_device_plugin_agents_off_dra_nodes_whatever_the_affinity() -> None:
    affinity = OVERRIDES["affinity"]
    objs = _render(**{"dra.enabled": True, "affinity": affinity, "nodeSelector": {"pool": "gpu"}})
    sets = {o["metadata"]["name"]: o["spec"]["template"]["spec"] for o in objs if o["kind"] == "DaemonSet"}
    (term,) = sets["gpufrac-agent"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"]
    # The operator's expression and ours, in one term: both must hold.
    assert term["matchExpressions"] == [
        *affinity["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0][
            "matchExpressions"
        ],
        {"key": "gpufrac.dev/mode", "operator": "NotIn", "values": ["dra"]},
    ]
    assert sets["gpufrac-agent-dra"]["affinity"] == affinity
    assert sets["gpufrac-agent-dra"]["nodeSelector"] == {
        "gpufrac.dev/enabled": "true",
        "pool": "gpu",
        "gpufrac.dev/mode": "dra",
    }
    # The DeviceClasses follow the driver's name.
    renamed = _render(**{"dra.enabled": True, "config": {"dra": {"driverName": "gpu.example.com"}}})
    classes = [o for o in renamed if o["kind"] == "DeviceClass"]
    assert {c["metadata"]["name"] for c in classes} == {"gpu-memory.gpu.example.com", "gpu.gpu.example.com"}
    assert all(
        c["spec"]["selectors"][0]["cel"]["expression"] == 'device.driver == "gpu.example.com"'
        for c in classes
    )


def test_the_comparison_catches_drift() -> None:
    # The equality above is only worth something if one changed field breaks it.
    base = _kustomize()
    drifted = json.loads(json.dumps(_render()))
    _one(drifted, "ClusterRole")["rules"].append(
        {"apiGroups": [""], "resources": ["nodes"], "verbs": ["list"]}
    )
    with pytest.raises(AssertionError, match="rules"):
        _assert_same_objects(base, drifted)
    with pytest.raises(AssertionError, match="only kustomize"):
        _assert_same_objects(base, tuple(o for o in _render() if o["kind"] != "Namespace"))


def test_chart_config_file_is_the_bases() -> None:
    assert (CHART / "files" / "config.yaml").read_bytes() == (BASE / "config.yaml").read_bytes()
    dra = REPO_ROOT / "deploy" / "dra" / "config.yaml"
    assert (CHART / "files" / "dra-config.yaml").read_bytes() == dra.read_bytes()


def test_chart_app_version_is_this_version() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["appVersion"] == gpufrac.__version__
    assert _agent(_render())["image"] == f"{PLACEHOLDER}:{gpufrac.__version__}"


# -- Kubernetes schemas ------------------------------------------------------------------------------

OVERRIDES: dict[str, Any] = {
    "monitoring.serviceMonitor.enabled": True,
    "monitoring.serviceMonitor.labels": {"release": "kube-prometheus-stack"},
    "rbac.podDelete": True,
    "config": {"idle": {"allowDelete": True, "action": "evict"}, "metrics": {"port": 9500}},
    "image.digest": "sha256:" + "ab" * 32,
    "image.pullPolicy": "Always",
    "image.pullSecrets": [{"name": "regcred"}],
    "nodeSelector": {"pool": "gpu"},
    "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "gpu", "effect": "NoSchedule"}],
    "affinity": {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["a100", "h100"]}]}
                ]
            }
        }
    },
    "runtimeClassName": "nvidia",
    "commonLabels": {"team": "ml-platform"},
    "podAnnotations": {"example.com/owner": "ml-platform"},
}


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("values", [{}, OVERRIDES], ids=["defaults", "overrides"])
def test_rendered_objects_match_the_kubernetes_schema(version: str, values: dict[str, Any]) -> None:
    objs = _render(**values)
    for o in objs:
        if o["kind"] in NO_SCHEMA:
            continue
        try:
            kubernetes_validate.validate(o, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{o['kind']}/{o['metadata']['name']} invalid for Kubernetes {version}: {e.message}")
    assert {o["kind"] for o in objs} >= {"DaemonSet", "ConfigMap", "ClusterRole", "Namespace"}


@pytest.mark.parametrize("version", ("1.36.0", kubernetes_validate.latest_version()))
def test_dra_objects_match_the_kubernetes_schema(version: str) -> None:
    for o in _render(**{**OVERRIDES, "dra.enabled": True}):
        if o["kind"] in NO_SCHEMA:
            continue
        try:
            kubernetes_validate.validate(o, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{o['kind']}/{o['metadata']['name']} invalid for Kubernetes {version}: {e.message}")


# -- values --------------------------------------------------------------------------------------------


def test_values_land_where_the_operator_expects() -> None:
    objs = _render(**OVERRIDES)
    pod = _one(objs, "DaemonSet")["spec"]["template"]
    spec = pod["spec"]
    # Helm merges maps: the opt-in label stays unless set to null.
    assert spec["nodeSelector"] == {"gpufrac.dev/enabled": "true", "pool": "gpu"}
    assert spec["tolerations"] == OVERRIDES["tolerations"]
    assert spec["affinity"] == OVERRIDES["affinity"]
    assert spec["runtimeClassName"] == "nvidia"
    assert spec["imagePullSecrets"] == [{"name": "regcred"}]
    for c in (*spec["initContainers"], *spec["containers"]):
        assert c["image"] == f"{PLACEHOLDER}@sha256:{'ab' * 32}"
        assert c["imagePullPolicy"] == "Always"
    assert pod["metadata"]["annotations"]["example.com/owner"] == "ml-platform"
    # commonLabels reach every object but never the DaemonSet's immutable selector.
    assert all(o["metadata"]["labels"]["team"] == "ml-platform" for o in objs if o["kind"] != "ConfigMap")
    assert "team" not in _one(objs, "DaemonSet")["spec"]["selector"]["matchLabels"]
    monitor = _one(objs, "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"


def test_config_overrides_reach_the_agent_and_the_daemonset_follows(tmp_path: Path) -> None:
    default = _render()
    objs = _render(
        config={
            "waitTimeout": "1m",
            "metrics": {"port": 9500},
            "paths": {"kubeletDir": "/var/lib/k0s/kubelet"},
        }
    )
    cm = _one(objs, "ConfigMap")
    path = tmp_path / "config.yaml"
    path.write_text(cm["data"]["config.yaml"])
    cfg = config.load(path)  # what the agent will read: its own loader accepts it
    assert cfg.wait_timeout == 60 and cfg.metrics.port == 9500
    assert cfg.paths.kubelet_dir == "/var/lib/k0s/kubelet"
    # Untouched keys keep the shipped defaults.
    assert dataclasses.replace(
        cfg, wait_timeout=30.0, metrics=config.MetricsConfig(), paths=config.PathsConfig(), node_name="n"
    ) == dataclasses.replace(config.Config(), node_name="n")
    # A changed config is a new ConfigMap name, so the agents roll.
    assert cm["metadata"]["name"] != _one(default, "ConfigMap")["metadata"]["name"]
    pod = _one(objs, "DaemonSet")["spec"]["template"]
    assert pod["spec"]["volumes"][0]["configMap"]["name"] == cm["metadata"]["name"]
    agent = _agent(objs)
    assert agent["ports"] == [{"name": "metrics", "containerPort": 9500, "protocol": "TCP"}]
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == "9500"
    host = {v["name"]: v["hostPath"]["path"] for v in pod["spec"]["volumes"] if "hostPath" in v}
    assert host["device-plugins"] == cfg.paths.device_plugin_dir
    assert host["pod-resources"] == str(Path(cfg.paths.pod_resources_socket).parent)
    mounts = {m["name"]: m["mountPath"] for m in agent["volumeMounts"]}
    assert all(mounts[name] == p for name, p in host.items())


def test_a_config_typo_is_refused_at_install_naming_the_key() -> None:
    assert "waitTimeOut" in _render_error(config={"waitTimeOut": "1m"})
    assert "action" in _render_error(config={"idle": {"action": "delete"}})


def test_install_refuses_without_an_image_repository() -> None:
    err = _render_error(**{"image.repository": ""})
    assert "image.repository is required" in err
    # A bare Docker Hub name is exactly what could be squatted: a registry host must come first.
    assert "image/repository" in _render_error(**{"image.repository": "gpufrac/agent"})
    assert "image/digest" in _render_error(**{"image.digest": "latest"})


def test_a_namespace_managed_elsewhere() -> None:
    objs = _render(**{"namespace.create": False, "namespace.name": "gpu-infra"})
    assert "Namespace" not in {o["kind"] for o in objs}
    assert {o["metadata"].get("namespace") for o in objs} == {None, "gpu-infra"}
    (binding,) = [o for o in objs if o["kind"] == "ClusterRoleBinding"]
    assert binding["subjects"][0]["namespace"] == "gpu-infra"


def test_chart_refuses_kubernetes_older_than_the_manifests_support() -> None:
    args = ("template", "gpufrac", str(CHART), *_sets({"image.repository": PLACEHOLDER}))
    assert _helm(*args, "--kube-version", "1.28.0").returncode == 0
    old = _helm(*args, "--kube-version", "1.27.9", check=False)
    assert old.returncode != 0 and "kubeVersion" in old.stderr


def test_allow_delete_needs_the_pod_delete_grant() -> None:
    err = _render_error(config={"idle": {"allowDelete": True}})
    assert "rbac.podDelete" in err
    objs = _render(config={"idle": {"allowDelete": True}}, **{"rbac.podDelete": True})
    assert any(
        o["kind"] == "ClusterRole" and o["metadata"]["name"] == "gpufrac-agent-pod-delete" for o in objs
    )


def _config_schema(cls: type[Any], skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """What values.schema.json must say about the node config, derived from config.py."""
    hints = get_type_hints(cls)
    props: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        hint, kind = hints[f.name], f.metadata.get("kind")
        if kind == "policy":  # a dataclass too, but its namespaces are a free-form mapping
            props[config._camel(f.name)] = _policy_schema()
            continue
        if dataclasses.is_dataclass(hint):
            props[config._camel(f.name)] = _config_schema(hint)
            continue
        if kind == "bytes":
            leaf: dict[str, Any] = {"type": ["string", "integer"]}
        elif kind == "seconds":
            leaf = {"type": ["string", "number"]}
        elif kind == "choice":
            leaf = {"enum": list(f.metadata["choices"])}
        elif get_origin(hint) is list:
            (item,) = get_args(hint)
            leaf = {"type": "array", "items": {"type": {int: "integer", str: "string"}[item]}}
        else:
            leaf = {"type": {bool: "boolean", int: "integer", float: "number", str: "string"}[hint]}
        props[config._camel(f.name)] = leaf
    return {"type": "object", "additionalProperties": False, "properties": props}


def _policy_schema() -> dict[str, Any]:
    """The `policy` section: `default` and one entry per namespace, each with the same keys."""
    hints = get_type_hints(policy.NamespacePolicy)
    names = {attr: key for key, attr in policy._KEYS.items()}

    def leaf(name: str) -> dict[str, Any]:
        if name == "compute_mode":  # a mode, or null for the node's
            return {"enum": [*policy.COMPUTE_MODES, None]}
        return {"type": {bool: "boolean", float: "number", int: "integer"}[hints[name]]}

    entry = {
        "type": "object",
        "additionalProperties": False,
        "properties": {names[f.name]: leaf(f.name) for f in dataclasses.fields(policy.NamespacePolicy)},
    }
    namespaces = {
        "type": "object",
        "propertyNames": {"pattern": policy._NAMESPACE.pattern},
        "additionalProperties": entry,
    }
    return {
        "type": "object",
        "additionalProperties": False,
        "properties": {"default": entry, "namespaces": namespaces},
    }


def test_values_schema_knows_every_config_key_and_no_other() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    described = dict(schema["properties"]["config"])
    described.pop("description", None)
    # nodeName comes from NODE_NAME per node, never from the ConfigMap.
    assert described == _config_schema(config.Config, skip=("node_name",))
