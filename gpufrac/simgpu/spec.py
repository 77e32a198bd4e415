"""Node specs for the simulated GPU node: presets and YAML/JSON files -> NodeSpec ->
node-state file.

A spec file (YAML or JSON) looks like a preset (gpufrac/simgpu/presets/*.yaml):

    preset: dgx-h100            # optional: start from a preset, then override
    node_name: worker-3
    driver_version: "570.124.06"
    cuda_driver_version: 12080
    checkpoint_supported: true
    gpu_defaults: {memory: 81559Mi, reserved: 540Mi, ...}   # merged key by key
    gpus:                                                   # replaces the preset's list
      - {model: NVIDIA L4, memory: 23034Mi, pci_bus_id: "00000000:01:00.0", numa_node: 0,
         cpu_affinity: "0-31", host_bridge: rc0, pcie_switch: sw0, nvlinks: {1: 4}}
    topology: [[X, PIX], [PIX, X]]                          # optional PCIe-level override

PCIe levels between two GPUs are derived from where they hang: same `pcie_switch`
-> PIX, switches sharing an upstream switch ("sw0/a" and "sw0/b") -> PXB, same
`host_bridge` -> PHB, same NUMA node -> NODE, otherwise SYS (nvidia-smi names).
NVLink: `nvlinks` maps a peer GPU index to a link count (direct links, must be
symmetric); `nvswitch_links` counts links into an NVSwitch fabric, through which
every pair of fabric GPUs talks over NVLink (DGX/HGX H100).

One module (~510 lines) on purpose: it is one format's reader, every key's check
next to the others, and the writer of the node-state file that format describes.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import os
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from gpufrac.core.units import parse_bytes
from gpufrac.simgpu import nodestate as ns

MiB = 1 << 20
PRESET_DIR = Path(__file__).resolve().parent / "presets"
NVLINK_NVSWITCH = ns.NVLINK_NVSWITCH  # nvlink_peers entry: the link goes to an NVSwitch

# nvidia-smi topo -m names <-> nvmlGpuTopologyLevel_t values.
TOPO_NAMES = {
    "X": ns.TOPO_INTERNAL,
    "PIX": ns.TOPO_SINGLE,
    "PXB": ns.TOPO_MULTIPLE,
    "PHB": ns.TOPO_HOSTBRIDGE,
    "NODE": ns.TOPO_NODE,
    "SYS": ns.TOPO_SYSTEM,
}
TOPO_LEVEL_NAMES = {v: k for k, v in TOPO_NAMES.items()}

_BUS_ID = re.compile(r"^([0-9A-Fa-f]{4,8}):([0-9A-Fa-f]{2}):([0-9A-Fa-f]{2})\.([0-7])$")
# Simulated UUIDs are uuid5 in this namespace: stable per (node, index), unlike any real GPU's.
_UUID_NS = uuid.UUID("6b1d3f0e-3c53-4d3c-9f4e-6770756672a1")


class SpecError(ValueError):
    """A node spec has a key or value that cannot describe a GPU node."""


@dataclass(frozen=True)
class GpuSpec:
    model: str
    memory: int  # bytes, as NVML reports memory.total
    reserved: int  # bytes the driver keeps (NVML memory v2 "reserved")
    pci_bus_id: str  # NVML format, "00000000:18:00.0"
    numa_node: int | None
    cpu_affinity: tuple[int, ...]  # CPU numbers
    nvlink_peers: tuple[int, ...] = ()  # one entry per link: peer GPU index or NVLINK_NVSWITCH
    sm_count: int = 0
    compute_capability: tuple[int, int] = (0, 0)
    pci_device_id: int = 0  # (device << 16) | 0x10de
    pci_subsystem_id: int = 0
    host_bridge: str = ""
    pcie_switch: str = ""  # "" = directly under the host bridge; "a/b" = switch b below switch a
    uuid: str = ""  # "" = derived from node name and index
    context_memory: int = 0  # bytes each CUDA context takes on the device (whole MiB)
    mig_enabled: bool = False  # MIG mode on (MIG-capable parts only: compute capability 8.0, 9.0)
    # How long the driver lets one context hold the GPU while another has work (microseconds):
    # not published by NVIDIA; docs/simgpu.md "Compute model" says why this default.
    timeslice_us: int = ns.TIMESLICE_US


@dataclass(frozen=True)
class NodeSpec:
    node_name: str
    gpus: tuple[GpuSpec, ...]
    driver_version: str = "570.124.06"
    nvml_version: str = "12.570.124.06"
    cuda_driver_version: int = 12080
    checkpoint_supported: bool = True
    topology_override: tuple[tuple[int, ...], ...] | None = None

    def gpu_uuid(self, index: int) -> str:
        g = self.gpus[index]
        return g.uuid or "GPU-" + str(uuid.uuid5(_UUID_NS, f"{self.node_name}/{index}"))

    @property
    def topology(self) -> tuple[tuple[int, ...], ...]:
        """topology[a][b]: the nvmlGpuTopologyLevel_t of the PCIe path between GPUs a and b."""
        if self.topology_override is not None:
            return self.topology_override
        return tuple(
            tuple(_pcie_level(a, b, ia == ib) for ib, b in enumerate(self.gpus))
            for ia, a in enumerate(self.gpus)
        )

    def nvlinks(self, a: int, b: int) -> int:
        """NVLink links usable between GPUs a and b (direct, or through the NVSwitch fabric)."""
        if a == b:
            return 0
        pa, pb = self.gpus[a].nvlink_peers, self.gpus[b].nvlink_peers
        direct = pa.count(b)
        fabric = min(pa.count(NVLINK_NVSWITCH), pb.count(NVLINK_NVSWITCH))
        return direct + fabric


def _pcie_level(a: GpuSpec, b: GpuSpec, same: bool) -> int:
    if same:
        return ns.TOPO_INTERNAL
    if a.host_bridge and a.host_bridge == b.host_bridge:
        if a.pcie_switch and a.pcie_switch == b.pcie_switch:
            return ns.TOPO_SINGLE
        sa, sb = a.pcie_switch.split("/"), b.pcie_switch.split("/")
        if a.pcie_switch and b.pcie_switch and sa[0] == sb[0]:
            return ns.TOPO_MULTIPLE
        return ns.TOPO_HOSTBRIDGE
    if a.numa_node is not None and a.numa_node == b.numa_node:
        return ns.TOPO_NODE
    return ns.TOPO_SYSTEM


# ---------------------------------------------------------------- parsing


def _fail(key: str, value: Any, why: str) -> SpecError:
    shown = repr(value)
    if len(shown) > 80:  # a whole file given where a value belongs: its start says enough
        shown = shown[:77] + "..."
    return SpecError(f"{key}: {shown} {why}")


def _int(key: str, v: Any, lo: int | None = None, hi: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise _fail(key, v, "is not an integer")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise _fail(key, v, f"is out of range [{lo}, {hi}]")
    return v


def _str(key: str, v: Any, max_len: int) -> str:
    if not isinstance(v, str) or not v:
        raise _fail(key, v, "is not a non-empty string")
    if len(v.encode()) >= max_len:
        raise _fail(key, v, f"is longer than {max_len - 1} bytes")
    return v


def _bytes(key: str, v: Any) -> int:
    try:
        return parse_bytes(v)
    except ValueError as e:
        raise SpecError(f"{key}: {e}") from None


def _cpus(key: str, v: Any) -> tuple[int, ...]:
    """CPU list as "0-55,112-167" or a list of ints."""
    cpus: list[int] = []
    if isinstance(v, str):
        for part in v.split(","):
            m = re.fullmatch(r"\s*(\d+)(?:-(\d+))?\s*", part)
            if not m:
                raise _fail(key, v, 'is not a CPU list like "0-55,112-167"')
            lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
            if hi < lo:
                raise _fail(key, v, f"has a descending range {part.strip()!r}")
            cpus.extend(range(lo, hi + 1))
    elif isinstance(v, list):
        cpus = [_int(f"{key}[{i}]", c, 0) for i, c in enumerate(v)]
    else:
        raise _fail(key, v, 'is not a CPU list like "0-55,112-167"')
    limit = ns.CPU_WORDS * 64
    if any(c >= limit for c in cpus):
        raise _fail(key, v, f"names a CPU >= {limit} (the simulated affinity mask holds {limit})")
    return tuple(sorted(set(cpus)))


def _bus_id(key: str, v: Any) -> str:
    m = _BUS_ID.match(v) if isinstance(v, str) else None
    if not m:
        raise _fail(key, v, 'is not a PCI bus id like "00000000:18:00.0"')
    dom, bus, dev, fn = (int(x, 16) for x in m.groups())
    return f"{dom:08X}:{bus:02X}:{dev:02X}.{fn}"


def _cc(key: str, v: Any) -> tuple[int, int]:
    m = re.fullmatch(r"(\d+)\.(\d+)", str(v)) if isinstance(v, (str, float)) else None
    if not m:
        raise _fail(key, v, 'is not a compute capability like "9.0"')
    return int(m.group(1)), int(m.group(2))


_GPU_KEYS = {
    "model",
    "memory",
    "reserved",
    "pci_bus_id",
    "numa_node",
    "cpu_affinity",
    "nvlinks",
    "nvswitch_links",
    "sm_count",
    "compute_capability",
    "pci_device_id",
    "pci_subsystem_id",
    "host_bridge",
    "pcie_switch",
    "uuid",
    "context_memory",
    "mig_enabled",
    "timeslice_us",
}
_NODE_KEYS = {
    "preset",
    "node_name",
    "driver_version",
    "nvml_version",
    "cuda_driver_version",
    "checkpoint_supported",
    "gpu_defaults",
    "gpus",
    "topology",
}


def _check_keys(where: str, d: Any, allowed: set[str]) -> Mapping[str, Any]:
    if not isinstance(d, Mapping):
        raise _fail(where or "spec", d, "is not a mapping")
    for k in d:
        if k not in allowed:
            raise SpecError(
                f"{where + '.' if where else ''}{k}: unknown key (known: {', '.join(sorted(allowed))})"
            )
    return d


def _gpu(i: int, raw: Mapping[str, Any], count: int) -> GpuSpec:
    key = f"gpus[{i}]"
    d = _check_keys(key, raw, _GPU_KEYS)
    for req in ("model", "memory"):
        if req not in d:
            raise SpecError(f"{key}.{req}: missing")
    memory = _bytes(f"{key}.memory", d["memory"])
    reserved = _bytes(f"{key}.reserved", d.get("reserved", 0))
    if memory == 0 or reserved >= memory:
        raise _fail(f"{key}.reserved", d.get("reserved", 0), f"leaves no usable memory of {d['memory']!r}")
    peers: list[int] = []
    nvl = d.get("nvlinks", {}) or {}
    if not isinstance(nvl, Mapping):
        raise _fail(f"{key}.nvlinks", nvl, "is not a mapping of peer GPU index to link count")
    for peer, n in nvl.items():
        p = _int(f"{key}.nvlinks key", int(peer) if isinstance(peer, str) and peer.isdigit() else peer, 0)
        if p >= count or p == i:
            raise _fail(f"{key}.nvlinks", peer, f"is not another GPU's index (0..{count - 1})")
        peers += [p] * _int(f"{key}.nvlinks[{peer}]", n, 1)
    peers += [NVLINK_NVSWITCH] * _int(f"{key}.nvswitch_links", d.get("nvswitch_links", 0), 0)
    if len(peers) > ns.MAX_NVLINKS:
        raise _fail(f"{key}.nvlinks", nvl, f"gives {len(peers)} links, more than {ns.MAX_NVLINKS}")
    ctx_mem = _bytes(f"{key}.context_memory", d.get("context_memory", 0))
    if ctx_mem % MiB or ctx_mem >= memory - reserved or ctx_mem // MiB > 0xFFFF:
        why = "is not a whole number of MiB below the usable memory and at most 65535 MiB"
        raise _fail(f"{key}.context_memory", d.get("context_memory"), why)
    numa = d.get("numa_node")
    uid = d.get("uuid", "")
    if uid and not (isinstance(uid, str) and uid.startswith("GPU-") and len(uid) < ns.UUID_LEN):
        raise _fail(f"{key}.uuid", uid, 'is not a GPU UUID like "GPU-<uuid>"')
    cc = _cc(f"{key}.compute_capability", d.get("compute_capability", "0.0"))
    mig = _bool(f"{key}.mig_enabled", d.get("mig_enabled", False))
    if mig and (cc[1] != 0 or cc[0] < 8):
        # As the driver: only A100/H100-class parts (x.0, 8.0 and up) have MIG at all.
        why = f"needs a MIG-capable GPU (compute capability 8.0 or 9.0), not {cc[0]}.{cc[1]}"
        raise _fail(f"{key}.mig_enabled", mig, why)
    return GpuSpec(
        model=_str(f"{key}.model", d["model"], ns.NAME_LEN),
        memory=memory,
        reserved=reserved,
        pci_bus_id=_bus_id(f"{key}.pci_bus_id", d.get("pci_bus_id", f"00000000:{i + 1:02X}:00.0")),
        numa_node=None if numa is None else _int(f"{key}.numa_node", numa, 0, 63),
        cpu_affinity=_cpus(f"{key}.cpu_affinity", d.get("cpu_affinity", [])),
        nvlink_peers=tuple(peers),
        sm_count=_int(f"{key}.sm_count", d.get("sm_count", 0), 0),
        compute_capability=cc,
        pci_device_id=_int(f"{key}.pci_device_id", d.get("pci_device_id", 0), 0, 0xFFFFFFFF),
        pci_subsystem_id=_int(f"{key}.pci_subsystem_id", d.get("pci_subsystem_id", 0), 0, 0xFFFFFFFF),
        host_bridge=str(d.get("host_bridge", "")),
        pcie_switch=str(d.get("pcie_switch", "")),
        uuid=uid,
        context_memory=ctx_mem,
        mig_enabled=mig,
        timeslice_us=_int(f"{key}.timeslice_us", d.get("timeslice_us", ns.TIMESLICE_US), 1, 1_000_000),
    )


def _topology(raw: Any, count: int) -> tuple[tuple[int, ...], ...]:
    if not isinstance(raw, list) or len(raw) != count:
        raise _fail("topology", raw, f"is not a {count}x{count} matrix of {'/'.join(TOPO_NAMES)}")
    rows = []
    for a, row in enumerate(raw):
        if not isinstance(row, list) or len(row) != count:
            raise _fail(f"topology[{a}]", row, f"is not a row of {count} levels")
        levels = []
        for b, name in enumerate(row):
            if name not in TOPO_NAMES:
                raise _fail(f"topology[{a}][{b}]", name, f"is not one of {', '.join(TOPO_NAMES)}")
            if (name == "X") != (a == b):
                raise _fail(f"topology[{a}][{b}]", name, "must be X exactly on the diagonal")
            levels.append(TOPO_NAMES[name])
        rows.append(tuple(levels))
    for a in range(count):
        for b in range(count):
            if rows[a][b] != rows[b][a]:
                raise _fail(f"topology[{a}][{b}]", raw[a][b], f"differs from topology[{b}][{a}]")
    return tuple(rows)


def _merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        if k == "gpu_defaults" and isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = {**out[k], **v}
        elif k != "preset":
            out[k] = v
    return out


def spec_from_dict(raw: Any, *, _depth: int = 0) -> NodeSpec:
    """Build and validate a NodeSpec from parsed YAML/JSON."""
    d = _check_keys("", raw, _NODE_KEYS)
    if "preset" in d:
        if _depth:
            raise _fail("preset", d["preset"], "is used inside a preset")
        d = _merge(_preset_dict(d["preset"]), d)
    gpus_raw = d.get("gpus")
    if not isinstance(gpus_raw, list) or not gpus_raw:
        raise _fail("gpus", gpus_raw, "is not a non-empty list of GPUs")
    if len(gpus_raw) > ns.MAX_GPUS:
        raise _fail("gpus", f"<{len(gpus_raw)} GPUs>", f"has more than {ns.MAX_GPUS} GPUs")
    defaults = d.get("gpu_defaults", {}) or {}
    _check_keys("gpu_defaults", defaults, _GPU_KEYS)
    gpus = []
    for i, g in enumerate(gpus_raw):
        _check_keys(f"gpus[{i}]", g, _GPU_KEYS)
        gpus.append(_gpu(i, {**defaults, **g}, len(gpus_raw)))
    _check_links(gpus)
    seen: dict[str, int] = {}
    for i, g in enumerate(gpus):
        if g.pci_bus_id in seen:
            raise _fail(f"gpus[{i}].pci_bus_id", g.pci_bus_id, f"is also gpus[{seen[g.pci_bus_id]}]'s")
        seen[g.pci_bus_id] = i
    spec = NodeSpec(
        node_name=_str("node_name", d.get("node_name", "sim-node"), 64),
        gpus=tuple(gpus),
        driver_version=_str("driver_version", d.get("driver_version", "570.124.06"), 32),
        cuda_driver_version=_int("cuda_driver_version", d.get("cuda_driver_version", 12080), 1000),
        checkpoint_supported=_bool("checkpoint_supported", d.get("checkpoint_supported", True)),
        topology_override=_topology(d["topology"], len(gpus)) if d.get("topology") is not None else None,
    )
    nvml = d.get("nvml_version") or f"{spec.cuda_driver_version // 1000}.{spec.driver_version}"
    spec = dataclasses.replace(spec, nvml_version=_str("nvml_version", nvml, 32))
    uuids = [spec.gpu_uuid(i) for i in range(len(gpus))]
    if len(set(uuids)) != len(uuids):
        raise _fail("gpus[].uuid", uuids, "are not unique")
    return spec


def _bool(key: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise _fail(key, v, "is not true or false")
    return v


def _check_links(gpus: Sequence[GpuSpec]) -> None:
    """Direct NVLinks are cables: a link from a to b is also a link from b to a."""
    for a, g in enumerate(gpus):
        for b in set(g.nvlink_peers) - {NVLINK_NVSWITCH}:
            there, back = g.nvlink_peers.count(b), gpus[b].nvlink_peers.count(a)
            if there != back:
                raise SpecError(
                    f"gpus[{a}].nvlinks: {there} link(s) to GPU {b}, but gpus[{b}].nvlinks has {back} back"
                )


def _parse_text(text: str, source: str) -> Any:
    try:
        if source.endswith(".json"):
            return json.loads(text)
        return yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise SpecError(
            f"{source}: not valid {'JSON' if source.endswith('.json') else 'YAML'}: {e}"
        ) from None


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def _preset_dict(name: Any) -> Mapping[str, Any]:
    if not isinstance(name, str) or name not in preset_names():
        raise _fail("preset", name, f"is not a preset (known: {', '.join(preset_names())})")
    path = PRESET_DIR / f"{name}.yaml"
    raw = _parse_text(path.read_text(), str(path))
    return _check_keys("", raw, _NODE_KEYS)


def load_preset(name: str, node_name: str | None = None) -> NodeSpec:
    """A built-in node: dgx-h100, pcie-l4x4, a100x2-nvlink."""
    raw = dict(_preset_dict(name))
    if node_name is not None:
        raw["node_name"] = node_name
    return spec_from_dict(raw, _depth=1)


def load_spec(path: str | os.PathLike[str]) -> NodeSpec:
    """A node spec file (YAML, or JSON by the .json suffix): a preset plus overrides, or a full GPU list."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise SpecError(f"cannot read node spec {p}: {e.strerror}") from None
    try:
        return spec_from_dict(_parse_text(text, str(p)))
    except SpecError as e:
        raise SpecError(f"{p}: {e}") from None


# ---------------------------------------------------------------- node-state file


def fill_node(node: ns.Node, spec: NodeSpec) -> None:
    """Write the static part of a zeroed node-state structure from a spec."""
    node.abi_version = ns.ABI_VERSION
    node.file_size = ctypes.sizeof(ns.Node)
    node.gpu_count = len(spec.gpus)
    node.cuda_driver_version = spec.cuda_driver_version
    node.driver_version = spec.driver_version.encode()
    node.nvml_version = spec.nvml_version.encode()
    node.node_name = spec.node_name.encode()
    node.checkpoint_supported = int(spec.checkpoint_supported)
    topo = spec.topology
    for i, g in enumerate(spec.gpus):
        out = node.gpus[i]
        out.uuid = spec.gpu_uuid(i).encode()
        out.name = g.model.encode()
        out.pci_bus_id = g.pci_bus_id.encode()
        dom, bus, rest = g.pci_bus_id.split(":")
        out.pci_domain, out.pci_bus, out.pci_device = int(dom, 16), int(bus, 16), int(rest.split(".")[0], 16)
        out.pci_device_id = g.pci_device_id
        out.pci_subsystem_id = g.pci_subsystem_id
        out.minor = i
        out.numa_node = -1 if g.numa_node is None else g.numa_node
        out.nvlink_count = len(g.nvlink_peers)
        for link in range(ns.MAX_NVLINKS):
            out.nvlink_peer[link] = g.nvlink_peers[link] if link < len(g.nvlink_peers) else -1
        for j in range(len(spec.gpus)):
            out.topo_level[j] = topo[i][j]
        for cpu in g.cpu_affinity:
            out.cpu_affinity[cpu // 64] |= 1 << (cpu % 64)
        out.total_bytes = g.memory
        out.reserved_bytes = g.reserved
        out.sm_count = g.sm_count
        out.cc_major, out.cc_minor = g.compute_capability
        out.ctx_mib = g.context_memory // MiB
        out.mig_mode = 1 if g.mig_enabled else 0
        out.timeslice_us = g.timeslice_us
    # Magic last: a reader that maps a file still being filled rejects it.
    node.magic = ns.MAGIC


def create_node(spec: NodeSpec, path: str | os.PathLike[str]) -> Path:
    """Write a fresh node-state file for `spec` at `path`, atomically (rename into place)."""
    p = Path(path)
    tmp = p.with_name(p.name + ".tmp")  # ns.allocate_file fills this one
    try:
        mm, node = ns.allocate_file(p)
        try:
            fill_node(node, spec)
            mm.flush()
        finally:
            del node
            mm.close()
        os.replace(tmp, p)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise SpecError(f"cannot write node-state file {p}: {e.strerror}") from None
    return p


__all__ = [
    "NVLINK_NVSWITCH",
    "TOPO_LEVEL_NAMES",
    "TOPO_NAMES",
    "GpuSpec",
    "NodeSpec",
    "SpecError",
    "create_node",
    "fill_node",
    "load_preset",
    "load_spec",
    "preset_names",
    "spec_from_dict",
]
