"""The node configuration: typed, loaded in one place, validated with clear errors.

The ConfigMap (deploy/daemonset/config.yaml) holds YAML with camelCase keys, as
Kubernetes objects do; each maps to a snake_case dataclass field below. Unknown
keys and bad values raise ConfigError naming the key, the value and the reason,
so a typo never silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints

import yaml

from gpufrac.core.flags import CLASS_NAMES
from gpufrac.core.policy import PolicyConfig, parse_config
from gpufrac.core.units import MAX_MS_FIELD_S, MIN_ARBITER_TIMEOUT_MS, parse_bytes, parse_duration

GiB = 1 << 30
RESOLVERS = ("swap", "evict", "wait")
MAX_HEAD_OF_LINE_S = 60.0  # headOfLineBound's ceiling (validate says why)
# A DRA driver name: a DNS subdomain, at most 63 characters (resource.k8s.io validation).
_DRIVER_NAME = re.compile(r"^(?=.{1,63}$)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


class ConfigError(ValueError):
    """A configuration key has a value the agent cannot use."""


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(p.title() for p in rest)


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


# Field metadata: how a value is parsed. "bytes" and "seconds" accept the
# human forms ("1Gi", "30m"); everything else must already have the field's type.
def _bytes(default: int) -> Any:
    return field(default=default, metadata={"kind": "bytes"})


def _seconds(default: float, *, positive: bool = False) -> Any:
    """A duration; `positive` for the period of a loop, where 0 would make it spin."""
    return field(default=default, metadata={"kind": "seconds", "positive": positive})


def _choice(default: str, *choices: str) -> Any:
    return field(default=default, metadata={"kind": "choice", "choices": choices})


@dataclass
class PathsConfig:
    state_dir: str = "/var/lib/gpufrac"
    kubelet_dir: str = "/var/lib/kubelet"
    # Where the shim library lives on the host (mounted read-only into containers).
    shim_host_path: str = "/var/lib/gpufrac/lib/libmemguard.so"
    # Where the container sees its gpufrac directory (config, usage, arbiter socket).
    container_dir: str = "/var/run/gpufrac"

    @property
    def device_plugin_dir(self) -> str:
        return os.path.join(self.kubelet_dir, "device-plugins")

    @property
    def pod_resources_socket(self) -> str:
        return os.path.join(self.kubelet_dir, "pod-resources", "kubelet.sock")

    @property
    def containers_dir(self) -> str:
        return os.path.join(self.state_dir, "containers")


@dataclass
class HealthConfig:
    # XIDs that say nothing about the GPU itself (application faults) are ignored.
    ignored_xids: list[int] = field(default_factory=lambda: [13, 31, 43, 45, 68, 109])
    # A GPU made Unhealthy by an XID is Healthy again after this long without a new one.
    xid_recovery: float = _seconds(300.0)
    poll_interval: float = _seconds(1.0, positive=True)


@dataclass
class WatchdogConfig:
    mode: str = _choice("enforce", "off", "report", "enforce")
    tolerance: int = _bytes(256 << 20)
    interval: float = _seconds(5.0, positive=True)


@dataclass
class SwapConfig:
    host_ram_budget: int = _bytes(64 * GiB)
    # Pods that say nothing about swap may be swapped if this is true.
    default_swappable: bool = False
    # A container is a swap victim only after this long without GPU work (0 = evictIdleThreshold).
    idle_threshold: float = _seconds(0.0)
    # How long a swap-out waits for the victim's CUDA calls in flight before giving up on it.
    lock_timeout: float = _seconds(10.0)


@dataclass
class IdleConfig:
    enabled: bool = True
    idle_timeout: float = _seconds(3600.0)
    max_runtime: float = _seconds(0.0)  # 0 = no limit
    grace_period: float = _seconds(300.0)
    action: str = _choice("notify", "notify", "swap", "evict")
    dry_run: bool = False
    # Evictions go through the Eviction API (PodDisruptionBudgets hold); a plain
    # delete is used only when this is set.
    allow_delete: bool = False
    exempt_namespaces: list[str] = field(default_factory=lambda: ["kube-system"])
    # Classes reaped besides "interactive".
    reap_classes: list[str] = field(default_factory=list)
    interval: float = _seconds(10.0, positive=True)


@dataclass
class ArbiterLimitsConfig:
    """Per-container limits on the arbiter socket (gpufrac.agent.arbiter.fairness,
    docs/arbiter-protocol.md): one container cannot starve the others' bursts."""

    # Connections one container may hold open at once (requests not yet sent included).
    connections_per_container: int = 32
    # Requests of one container being decided at once (waiting, resolvers, swap-in, reclaim).
    inflight_per_container: int = 16
    # Requests per second one container may send, and how many at once above that rate.
    requests_per_second: float = 200.0
    request_burst: int = 400
    # Connections on the node at once (file descriptors); shared evenly between containers.
    max_connections: int = 4096
    # Connections the kernel queues for the agent to accept. A flood ahead of a neighbour's
    # connection is at most this deep; past it, connecting shims wait in the kernel, woken in
    # turn as the agent accepts (docs/arbiter-protocol.md, Fairness).
    listen_backlog: int = 16


COMPUTE_MODES = ("fair", "strict")


@dataclass
class ComputeConfig:
    """Compute shares (gpufrac.agent.compute, docs/compute.md): each container's share of its
    GPU's compute, held by pacing its launches from the driver's measured utilisation."""

    enabled: bool = True
    # fair: a share is guaranteed while the GPU is contended and compute nobody uses goes to the
    # busy; strict: a share is also a cap. A namespace's policy may say otherwise (policy.*.computeMode).
    mode: str = _choice("fair", *COMPUTE_MODES)
    # The control period: how often the driver's per-process utilisation is read and the paces set.
    interval: float = _seconds(0.1, positive=True)


@dataclass
class DraConfig:
    """The DRA driver (mode: dra): its name, where the container runtime reads CDI specs,
    and how often the agent checks what it published and booked against the apiserver."""

    # The driver name of the ResourceSlices, DeviceClasses and claim parameters.
    driver_name: str = "gpufrac.dev"
    # The container runtime's CDI spec directory (containerd and CRI-O read /var/run/cdi).
    cdi_spec_dir: str = "/var/run/cdi"
    # How often the node's ResourceSlice is checked (the kubelet deletes a node's slices when
    # it starts; the agent publishes them again).
    slice_check_interval: float = _seconds(10.0, positive=True)
    # How often claim bookings are checked against the apiserver: a claim deleted while the
    # kubelet could not tell the agent (its unprepare lost) is released.
    claim_check_interval: float = _seconds(60.0, positive=True)


@dataclass
class MetricsConfig:
    port: int = 9410
    bind_address: str = "0.0.0.0"


@dataclass
class Config:
    node_name: str = field(default_factory=lambda: os.environ.get("NODE_NAME", os.uname().nodename))
    # How the node's GPUs are offered: "device-plugin" (extended resources, any Kubernetes) or
    # "dra" (a DRA driver with consumable capacity, Kubernetes 1.34+). A node is in one mode:
    # the agent books its GPUs for one front end only (docs/architecture.md).
    mode: str = _choice("device-plugin", "device-plugin", "dra")
    memory_unit: int = _bytes(GiB)
    # What no container is charged for: the driver's reservation and fragmentation (each
    # process's CUDA context is charged to its container by the shim).
    reserved_per_gpu: int = _bytes(GiB)
    allocation_policy: str = _choice("binpack", "binpack", "spread")
    device_list_strategy: str = _choice("envvar", "envvar", "cdi")
    lend_unused_requests: bool = False
    resolvers: list[str] = field(default_factory=lambda: list(RESOLVERS))
    wait_timeout: float = _seconds(30.0)
    # A burst that fits waits at most this long behind requests ahead of it on its GPU that
    # cannot be served (strict order up to here, then it is granted past them), however long
    # they may wait: docs/arbiter-protocol.md, Resolvers, "Order".
    head_of_line_bound: float = _seconds(1.0)
    # How long the shim waits to connect and send, and the agent to read a request (at least
    # MIN_ARBITER_TIMEOUT_MS, validate); the reply may take it plus the wait timeout.
    arbiter_timeout: float = _seconds(2.0)
    # Burst grants stay this far below what NVML says is physically free.
    grant_margin: int = _bytes(256 << 20)
    evict_idle_threshold: float = _seconds(600.0)
    status_socket: str = "/var/run/gpufrac/status.sock"
    # The apiserver URL; empty = the in-cluster service account, else $KUBECONFIG / ~/.kube/config.
    api_server: str = ""
    # A kubeconfig file to reach the apiserver with (when apiServer is empty); empty = the
    # in-cluster service account, else $KUBECONFIG or ~/.kube/config.
    kubeconfig: str = ""
    log_json: bool = False
    log_level: str = _choice("info", "debug", "info", "warning", "error")
    paths: PathsConfig = field(default_factory=PathsConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    swap: SwapConfig = field(default_factory=SwapConfig)
    idle: IdleConfig = field(default_factory=IdleConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    # Per-namespace caps on what pod annotations may ask (gpufrac.core.policy parses it).
    policy: PolicyConfig = field(default_factory=PolicyConfig, metadata={"kind": "policy"})
    arbiter_limits: ArbiterLimitsConfig = field(default_factory=ArbiterLimitsConfig)
    dra: DraConfig = field(default_factory=DraConfig)
    compute: ComputeConfig = field(default_factory=ComputeConfig)

    def validate(self) -> None:
        if not self.node_name.strip():
            # The pod watch selects spec.nodeName=<this>: empty would select unscheduled pods.
            raise ConfigError("nodeName: empty; set it or the NODE_NAME environment variable")
        if self.memory_unit < (1 << 20):
            raise ConfigError(f"memoryUnit: {self.memory_unit} bytes is below the 1Mi minimum")
        bad = [r for r in self.resolvers if r not in RESOLVERS]
        if bad:
            raise ConfigError(f"resolvers: unknown resolver(s) {bad}; choose from {list(RESOLVERS)}")
        if len(set(self.resolvers)) != len(self.resolvers):
            raise ConfigError(f"resolvers: {self.resolvers} names a resolver twice")
        if not 0 < self.metrics.port < 65536:
            raise ConfigError(f"metrics.port: {self.metrics.port} is not a TCP port")
        if self.arbiter_timeout * 1000 < MIN_ARBITER_TIMEOUT_MS:  # NaN is refused by the parser
            # The agent would drop every request not read by its loop's next turn, and the shim
            # read 0 as 2 s: the two would not mean the same timeout (docs/arbiter-protocol.md).
            raise ConfigError(
                f"arbiterTimeout: {self.arbiter_timeout:g}s is less than the least the agent can honour, "
                f"{MIN_ARBITER_TIMEOUT_MS}ms (a shim's request must reach the agent's loop within it on "
                "a loaded node)"
            )
        for key, seconds in (("arbiterTimeout", self.arbiter_timeout), ("waitTimeout", self.wait_timeout)):
            # The shim holds these in a u32 of milliseconds: refuse rather than wrap around.
            if seconds > MAX_MS_FIELD_S:
                raise ConfigError(
                    f"{key}: {seconds:g}s is more than the shim's limit of {MAX_MS_FIELD_S:g}s "
                    "(a 32-bit count of milliseconds, about 49.7 days)"
                )
        # The driver's cuCheckpointProcessLock takes a u32 of milliseconds, and 0 means no timeout
        # at all (a swap-out would wait on a busy victim for ever): at least 1 ms, at most the field.
        if not 0.001 <= self.swap.lock_timeout <= MAX_MS_FIELD_S:
            raise ConfigError(
                f"swap.lockTimeout: {self.swap.lock_timeout:g}s must be between 1ms and {MAX_MS_FIELD_S:g}s "
                "(the driver's 32-bit count of milliseconds, where 0 would mean no timeout)"
            )
        if self.head_of_line_bound > MAX_HEAD_OF_LINE_S:
            # Past it, one container's request that cannot be served holds its neighbours'
            # bursts for as long as it waits (its own wait timeout): the hole the bound closes.
            raise ConfigError(
                f"headOfLineBound: {self.head_of_line_bound:g}s is more than {MAX_HEAD_OF_LINE_S:g}s"
            )
        lim = self.arbiter_limits
        for key, value, low in (
            ("connectionsPerContainer", lim.connections_per_container, 1),
            ("inflightPerContainer", lim.inflight_per_container, 1),
            ("requestBurst", lim.request_burst, 1),
            ("maxConnections", lim.max_connections, 1),
            ("listenBacklog", lim.listen_backlog, 1),
        ):
            if not low <= value <= 1_000_000:
                raise ConfigError(f"arbiterLimits.{key}: {value} must be between {low} and 1000000")
        if not 0 < lim.requests_per_second <= 1e6:  # NaN fails this too
            raise ConfigError(
                f"arbiterLimits.requestsPerSecond: {lim.requests_per_second} must be above 0, at most 1e6"
            )
        if lim.connections_per_container > lim.max_connections:
            raise ConfigError(
                f"arbiterLimits.connectionsPerContainer: {lim.connections_per_container} is more than "
                f"maxConnections ({lim.max_connections})"
            )
        if not _DRIVER_NAME.match(self.dra.driver_name):
            raise ConfigError(
                f"dra.driverName: {self.dra.driver_name!r} is not a DNS subdomain of at most 63 "
                "characters (lowercase letters, digits, '-' and '.')"
            )
        if not 0.01 <= self.compute.interval <= 10:
            # Shorter than the driver's sampling is noise; longer, a share takes many seconds to hold.
            raise ConfigError(f"compute.interval: {self.compute.interval:g}s must be between 10ms and 10s")
        bad = [c for c in self.idle.reap_classes if c not in CLASS_NAMES]
        if bad:
            raise ConfigError(
                f"idle.reapClasses: unknown workload class(es) {bad}; choose from {sorted(CLASS_NAMES)}"
            )


def dra_plugin_socket(config: Config) -> str:
    """The DRA driver's gRPC socket (the DRAPlugin and DRAResourceHealth services), where the
    kubelet's registration is told to find it: <kubelet dir>/plugins/<driver>/dra.sock."""
    return os.path.join(config.paths.kubelet_dir, "plugins", config.dra.driver_name, "dra.sock")


def dra_registration_socket(config: Config) -> str:
    """The DRA driver's registration socket, which the kubelet's plugin watcher finds in
    <kubelet dir>/plugins_registry/."""
    return os.path.join(config.paths.kubelet_dir, "plugins_registry", f"{config.dra.driver_name}-reg.sock")


def arbiter_socket_dir(config: Config) -> str:
    """Host directory holding the node-wide arbiter socket and nothing else. Containers admitted
    by an agent that mounted it (memguard_abi.h MG_SOCKET_DIR) reach the arbiter through it;
    new containers get a socket of their own (gpufrac.agent.arbiter.listeners)."""
    return os.path.join(config.paths.state_dir, "arbiter")


def arbiter_socket(config: Config) -> str:
    """Host path of the node-wide arbiter socket (the agent's tools, containers admitted by an
    agent that mounted its directory; peers are told apart by SO_PEERCRED)."""
    return os.path.join(arbiter_socket_dir(config), "arbiter.sock")


def _convert(path: str, f: dataclasses.Field[Any], hint: Any, value: Any) -> Any:
    kind = f.metadata.get("kind")
    try:
        if kind == "bytes":
            return parse_bytes(value)
        if kind == "seconds":
            seconds = parse_duration(value)
            if f.metadata["positive"] and seconds <= 0:
                raise ValueError(f"{value!r} must be more than 0")
            return seconds
    except ValueError as e:
        raise ConfigError(f"{path}: {e}") from None
    if kind == "policy":
        try:
            return parse_config(path, value)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if kind == "choice":
        if value not in f.metadata["choices"]:
            raise ConfigError(f"{path}: {value!r} is not one of {list(f.metadata['choices'])}")
        return value
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        return _build(hint, value, path + ".")
    origin = getattr(hint, "__origin__", None)
    if origin is list:
        (item,) = hint.__args__
        if not isinstance(value, list) or not all(isinstance(v, item) for v in value):
            raise ConfigError(f"{path}: expected a list of {item.__name__}, got {value!r}")
        return list(value)
    # bool is an int subclass: check it first so `port: true` is refused.
    if hint is bool or isinstance(value, bool):
        if not (hint is bool and isinstance(value, bool)):
            raise ConfigError(f"{path}: expected {hint.__name__}, got {value!r}")
        return value
    if hint is float and isinstance(value, int):
        if abs(value) > 1e300:  # float() of a longer integer raises OverflowError
            raise ConfigError(f"{path}: {value!r} is out of range")
        return float(value)
    if not isinstance(value, hint):
        raise ConfigError(f"{path}: expected {hint.__name__}, got {value!r}")
    return value


def _build(cls: type[Any], data: dict[str, Any], prefix: str = "") -> Any:
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if not isinstance(key, str):  # YAML allows keys of any type ("? [a]", "1: x")
            raise ConfigError(f"{prefix}{key!r}: a key must be a string")
        name = _snake(key)
        if name not in fields:
            known = ", ".join(sorted(_camel(n) for n in fields))
            raise ConfigError(f"{prefix}{key}: unknown key (known: {known})")
        kwargs[name] = _convert(prefix + key, fields[name], hints[name], value)
    return cls(**kwargs)


def _read(path: str | os.PathLike[str]) -> dict[str, Any]:
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from e
    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from e
    if loaded is not None and not isinstance(loaded, dict):
        raise ConfigError(f"config file {path}: top level must be a mapping")
    return loaded or {}


def load(
    path: str | os.PathLike[str] | None = None,
    overrides: dict[str, Any] | None = None,
    *,
    overlays: Sequence[str | os.PathLike[str]] = (),
) -> Config:
    """Load the node config from a YAML file (or defaults), merge `overlays` (files, in order:
    the DRA DaemonSet's `mode: dra` over the shipped config) and `overrides` over it, validate."""
    data: dict[str, Any] = _read(path) if path is not None else {}
    for overlay in overlays:
        data = _merge(data, _read(overlay))
    if overrides:
        data = _merge(data, overrides)
    cfg: Config = _build(Config, data)
    cfg.validate()
    return cfg


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out
