"""The node config: camelCase YAML to typed fields, and a clear error for every bad value."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpufrac.core.config import Config, ConfigError, load

pytestmark = pytest.mark.unit

GiB = 1 << 30


def _load(tmp_path: Path, text: str) -> Config:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return load(path)


def test_yaml_keys_units_and_overrides_reach_typed_fields(tmp_path: Path) -> None:
    cfg = _load(
        tmp_path,
        "nodeName: gpu-7\nmemoryUnit: 512Mi\nwaitTimeout: 1m30s\n"
        "idle:\n  idleTimeout: 2h\n  reapClasses: [batch]\nwatchdog:\n  mode: enforce\n  interval: 250ms\n",
    )
    assert (cfg.node_name, cfg.memory_unit, cfg.wait_timeout) == ("gpu-7", 512 << 20, 90.0)
    assert (cfg.idle.idle_timeout, cfg.idle.reap_classes) == (7200.0, ["batch"])
    assert (cfg.watchdog.mode, cfg.watchdog.interval) == ("enforce", 0.25)
    assert cfg.reserved_per_gpu == GiB  # untouched keys keep their defaults
    over = load(tmp_path / "config.yaml", {"idle": {"action": "swap"}, "metrics": {"port": 9500}})
    assert (over.idle.action, over.idle.idle_timeout, over.metrics.port) == ("swap", 7200.0, 9500)


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("colour: red\n", ["colour", "unknown key", "memoryUnit"]),
        ("idle:\n  idleTimout: 1h\n", ["idle.idleTimout", "unknown key", "idleTimeout"]),
        ("memoryUnit: lots\n", ["memoryUnit", "'lots'", "quantity"]),
        ("memoryUnit: 512Ki\n", ["memoryUnit", "1Mi minimum"]),
        ("reservedPerGpu: -1Gi\n", ["reservedPerGpu", "negative"]),
        ("waitTimeout: soon\n", ["waitTimeout", "'soon'", "duration"]),
        ("waitTimeout: .nan\n", ["waitTimeout", "nan", "finite"]),
        ("arbiterTimeout: 0s\n", ["arbiterTimeout", "0s", "least the agent can honour, 100ms"]),
        ("arbiterTimeout: 99ms\n", ["arbiterTimeout", "0.099s", "100ms"]),
        ("health:\n  xidRecovery: .inf\n", ["health.xidRecovery", "inf", "finite"]),
        ("idle:\n  interval: 0\n", ["idle.interval", "0", "more than 0"]),
        ("watchdog:\n  interval: 0s\n", ["watchdog.interval", "'0s'", "more than 0"]),
        ("health:\n  pollInterval: 0ms\n", ["health.pollInterval", "more than 0"]),
        ("nodeName: ''\n", ["nodeName", "empty", "NODE_NAME"]),
        ("idle:\n  action: delete\n", ["idle.action", "'delete'", "notify"]),
        ("metrics:\n  port: true\n", ["metrics.port", "True"]),
        ("metrics:\n  port: 70000\n", ["metrics.port", "70000", "TCP port"]),
        ("resolvers: [wait, pray]\n", ["resolvers", "pray", "swap"]),
        ("resolvers: [wait, wait]\n", ["resolvers", "twice"]),
        ("idle:\n  reapClasses: [sleepy]\n", ["idle.reapClasses", "sleepy", "interactive"]),
        ("idle:\n  exemptNamespaces: kube-system\n", ["idle.exemptNamespaces", "list of str"]),
        ("watchdog: strict\n", ["watchdog", "mapping", "'strict'"]),
        ("- a\n- b\n", ["top level must be a mapping"]),
        ("idle: [\n", ["not valid YAML"]),
    ],
)
def test_a_bad_value_is_refused_naming_key_and_reason(tmp_path: Path, text: str, names: list[str]) -> None:
    with pytest.raises(ConfigError) as exc:
        _load(tmp_path, text)
    for name in names:
        assert name in str(exc.value), (text, str(exc.value))


def test_an_unreadable_file_says_which_and_why(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"cannot read config file .*missing\.yaml: No such file"):
        load(tmp_path / "missing.yaml")


def test_compute_section_and_its_checks() -> None:
    cfg = load(overrides={"compute": {"mode": "strict", "interval": "250ms"}})
    assert (cfg.compute.enabled, cfg.compute.mode, cfg.compute.interval) == (True, "strict", 0.25)
    for bad, says in (
        ({"mode": "greedy"}, r"compute\.mode: 'greedy' is not one of \['fair', 'strict'\]"),
        ({"interval": "1ms"}, r"compute\.interval: 0\.001s must be between 10ms and 10s"),
        ({"interval": "0s"}, r"compute\.interval: .* must be more than 0"),
        ({"enable": True}, r"compute\.enable: unknown key"),
    ):
        with pytest.raises(ConfigError, match=says):
            load(overrides={"compute": bad})
