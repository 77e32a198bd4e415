"""`gpufrac gpus` and `gpufrac topo`: the node's GPUs and their interconnect.

The formatting functions are pure (inventory in, text or dict out) so the demo
and the agent's status output reuse them; the two commands only gather the data.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Iterable, Mapping
from typing import Any

from gpufrac.core.gpus import MIG_REASON, GpuHealth, Inventory, Link, PcieLink, mig_to_dict
from gpufrac.core.output import render, table

GiB = 1 << 30

TOPO_LEGEND = """\
Legend:

  X    = Self
  SYS  = PCIe path crossing the interconnect between NUMA nodes (e.g. UPI, Infinity Fabric)
  NODE = PCIe path crossing host bridges within one NUMA node
  PHB  = PCIe path through one PCIe host bridge (typically the CPU)
  PXB  = PCIe path through several PCIe switches, not through a host bridge
  PIX  = PCIe path through at most one PCIe switch
  NV#  = NVLink: a bonded set of # links (directly or through NVSwitches)"""


def cpu_list(cpus: Iterable[int]) -> str:
    """CPU numbers as a kernel-style list: (0, 1, 2, 5) -> '0-2,5'."""
    parts: list[str] = []
    run: list[int] = []
    for c in sorted(set(cpus)):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(parts)


def link_label(link: Link) -> str:
    """nvidia-smi topo -m cell: NV<n> when the pair has NVLink, else the PCIe path."""
    return f"NV{link.nvlinks}" if link.nvlinks and link.pcie is not PcieLink.SELF else link.pcie.value


def cuda_version(v: int) -> str:
    """cuDriverGetVersion's 12080 -> '12.8'."""
    return f"{v // 1000}.{v % 1000 // 10}" if v else "?"


def _numa(n: int | None) -> str:
    return "N/A" if n is None else str(n)


def _health_text(h: GpuHealth | None) -> str:
    if h is None:
        return "?"
    return "Healthy" if h.healthy else f"Unhealthy: {h.reason}"


# ---------------------------------------------------------------- gpus


def gpus_to_dict(
    inv: Inventory,
    used: Mapping[str, int] | None = None,
    health: Mapping[str, GpuHealth] | None = None,
) -> dict[str, Any]:
    """The `gpufrac gpus --json` document. `used` (bytes) and `health` are per UUID;
    GPUs missing from them get null."""
    used, health = used or {}, health or {}
    gpus = []
    for g in inv.gpus:
        h = health.get(g.uuid)
        gpus.append(
            {
                "index": g.index,
                "uuid": g.uuid,
                "model": g.model,
                "memory_total": g.memory_total,
                "memory_used": used.get(g.uuid),
                "pci_bus_id": g.pci_bus_id,
                "numa_node": g.numa_node,
                "cpu_affinity": list(g.cpu_affinity),
                "minor": g.minor,
                "healthy": None if h is None else h.healthy,
                "health_reason": None if h is None else h.reason,
            }
        )
    return {
        "driver_version": inv.driver_version,
        "cuda_driver_version": inv.cuda_driver_version,
        "gpus": gpus,
        "unreachable": [{"index": i, "reason": r} for i, r in sorted(inv.unreachable.items())],
        "mig": [mig_to_dict(g, used.get(g.uuid)) for g in inv.mig],
    }


def format_gpus(
    inv: Inventory,
    used: Mapping[str, int] | None = None,
    health: Mapping[str, GpuHealth] | None = None,
    *,
    wide: bool = False,
) -> str:
    """The `gpufrac gpus` table; `wide` adds CPU affinity and the device minor number."""
    used, health = used or {}, health or {}
    count = len(inv.gpus) + len(inv.unreachable) + len(inv.mig)
    head = (
        f"Driver {inv.driver_version or '?'}  CUDA {cuda_version(inv.cuda_driver_version)}  "
        f"{count} GPU{'s' if count != 1 else ''}"
    )
    body: list[tuple[int, list[str]]] = []
    for g in inv.gpus:
        u = used.get(g.uuid)
        body.append(
            (
                g.index,
                [
                    str(g.index),
                    g.uuid,
                    g.model,
                    f"{g.memory_total / GiB:.1f}GiB",
                    "?" if u is None else f"{u / GiB:.1f}GiB",
                    g.pci_bus_id,
                    _numa(g.numa_node),
                    *([cpu_list(g.cpu_affinity) or "N/A", str(g.minor)] if wide else []),
                    _health_text(health.get(g.uuid)),
                ],
            )
        )
    extra = ["?", "?"] if wide else []
    for g in inv.mig:
        u = used.get(g.uuid)
        cells = [str(g.index), g.uuid, g.model, f"{g.memory_total / GiB:.1f}GiB"]
        cells += ["?" if u is None else f"{u / GiB:.1f}GiB", g.pci_bus_id, _numa(g.numa_node)]
        if wide:
            cells += [cpu_list(g.cpu_affinity) or "N/A", str(g.minor)]
        body.append((g.index, [*cells, MIG_REASON]))
    for i, reason in inv.unreachable.items():
        body.append((i, [str(i), "?", "?", "?", "?", "?", "?", *extra, f"Unhealthy: {reason}"]))
    head_row = ["IDX", "UUID", "MODEL", "MEMORY", "USED", "PCI BUS ID", "NUMA"]
    rows = [[*head_row, *(["CPU AFFINITY", "MINOR"] if wide else []), "HEALTH"]]
    rows += [cells for _, cells in sorted(body, key=lambda item: item[0])]
    return "\n".join([head, "", *table(rows, align_right=(0, 3, 4))])


# ---------------------------------------------------------------- topo


def topo_matrix(inv: Inventory) -> list[list[str]]:
    """matrix[i][j]: the link label between the i-th and j-th GPU of the inventory."""
    return [[link_label(inv.link(a.index, b.index)) for b in inv.gpus] for a in inv.gpus]


def topo_to_dict(inv: Inventory) -> dict[str, Any]:
    """The `gpufrac topo --json` document: per-GPU affinity, every pair once, and the matrix."""
    links = []
    for a in inv.gpus:
        for b in inv.gpus:
            if a.index < b.index:
                link = inv.link(a.index, b.index)
                links.append(
                    {
                        "a": a.index,
                        "b": b.index,
                        "nvlinks": link.nvlinks,
                        "pcie": link.pcie.value,
                        "label": link_label(link),
                    }
                )
    return {
        "gpus": [
            {
                "index": g.index,
                "uuid": g.uuid,
                "pci_bus_id": g.pci_bus_id,
                "numa_node": g.numa_node,
                "cpu_affinity": list(g.cpu_affinity),
                "cpu_affinity_list": cpu_list(g.cpu_affinity),
            }
            for g in inv.gpus
        ],
        "links": links,
        "matrix": topo_matrix(inv),
        "unreachable": [{"index": i, "reason": r} for i, r in sorted(inv.unreachable.items())],
        "mig": [{"index": g.index, "uuid": g.uuid, "reason": MIG_REASON} for g in inv.mig],
    }


def format_topo(inv: Inventory, *, wide: bool = False) -> str:
    """A `nvidia-smi topo -m` style matrix with CPU and NUMA affinity, and its legend;
    `wide` adds every pair's NVLink count and PCIe path, which a NV# cell hides."""
    names = [f"GPU{g.index}" for g in inv.gpus]
    rows = [["", *names, "CPU Affinity", "NUMA Affinity"]]
    for name, g, cells in zip(names, inv.gpus, topo_matrix(inv), strict=True):
        rows.append([name, *cells, cpu_list(g.cpu_affinity) or "N/A", _numa(g.numa_node)])
    lines = table(rows)
    lines += [f"GPU{i}: unreachable ({r})" for i, r in sorted(inv.unreachable.items())]
    lines += [f"GPU{g.index}: {MIG_REASON}" for g in inv.mig]
    if wide and len(inv.gpus) > 1:
        pairs = [["PAIR", "NVLINKS", "PCIE"]]
        for link in topo_to_dict(inv)["links"]:
            pairs.append([f"GPU{link['a']}-GPU{link['b']}", str(link["nvlinks"]), link["pcie"]])
        lines += ["", *table(pairs, align_right=(1,))]
    return "\n".join([*lines, "", TOPO_LEGEND])


# ---------------------------------------------------------------- commands


def _fail(message: str, code: int = 1) -> int:
    print(f"gpufrac: {message}", file=sys.stderr)
    return code


def _quiet_logs() -> None:
    # The report itself shows unreachable GPUs; the library's warnings would repeat it.
    logging.getLogger("gpufrac").setLevel(logging.ERROR)


def cmd_gpus(args: argparse.Namespace) -> int:
    from gpufrac.agent.gpu.health import HealthMonitor
    from gpufrac.agent.gpu.inventory import NvmlError, read_inventory, read_memory
    from gpufrac.core import config as config_mod

    _quiet_logs()
    try:
        cfg = config_mod.load(args.config)
    except config_mod.ConfigError as e:
        return _fail(str(e), 2)
    try:
        inv = read_inventory()
        memory = read_memory()
        # A one-shot look: does each GPU answer? (XID history lives in the running agent.)
        with HealthMonitor(cfg.health, inv.gpus) as monitor:
            monitor.poll(0)
            health = monitor.current()
    except NvmlError as e:
        return _fail(str(e))
    used = {uuid: m.used for uuid, m in memory.items()}
    doc = gpus_to_dict(inv, used, health)
    print(render(args, doc, lambda wide: format_gpus(inv, used, health, wide=wide)))
    return 0


def cmd_topo(args: argparse.Namespace) -> int:
    from gpufrac.agent.gpu.inventory import NvmlError, read_inventory

    _quiet_logs()
    try:
        inv = read_inventory()
    except NvmlError as e:
        return _fail(str(e))
    print(render(args, topo_to_dict(inv), lambda wide: format_topo(inv, wide=wide)))
    return 0
