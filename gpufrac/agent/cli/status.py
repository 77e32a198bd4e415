"""`gpufrac status`: the node at a glance as a table (or JSON/YAML), from the running
agent's status socket."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from typing import Any

from gpufrac.agent.status.client import StatusUnavailable, fetch
from gpufrac.core import slices
from gpufrac.core.output import render, table
from gpufrac.core.units import format_bytes


def _b(n: int | None) -> str:
    return "?" if n is None else format_bytes(int(n))


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def _numa(n: object) -> str:
    return "N/A" if n is None else str(n)


def _compute(c: Mapping[str, Any]) -> list[str]:
    """SHARE, MODE, COMPUTE (measured use; "held" while its launches are paced)."""
    share = c.get("compute_share")
    if share is None:
        return ["-", "-", "-"]
    used = c.get("compute_used")
    shown = "?" if used is None else f"{used * 100:.0f}%"
    if c.get("compute_unheld"):
        shown += " UNHELD"
    elif c.get("compute_paced"):
        shown += " held"
    return [f"{share * 100:.0f}%", c.get("compute_mode") or "?", shown]


def _short_resource(r: str) -> str:
    return r.rsplit("/", 1)[-1]


def format_status(status: Mapping[str, Any], *, wide: bool = False) -> str:
    """The `gpufrac status` table from a status document (the JSON the endpoint serves);
    `wide` adds GPU UUIDs, PCI bus ids and NUMA nodes, and each container's key,
    priority, process count, OOM refusals and swapped bytes."""
    ready = "Ready" if status.get("ready") else f"NotReady ({status.get('ready_reason', '?')})"
    regs = ", ".join(
        f"{_short_resource(r)} {'registered' if ok else 'NOT registered'}"
        for r, ok in (status.get("registered") or {}).items()
    )
    lines = [
        f"Node {status.get('node', '?')}  gpufrac {status.get('version', '?')}  "
        f"driver {status.get('driver_version') or '?'}  {ready}",
        f"Kubelet: {regs or '?'}",
        "",
    ]
    gpus = status.get("gpus") or []
    resources = list(slices.RESOURCES)
    rows = [
        [
            "GPU",
            "MODEL",
            *(["UUID", "PCI BUS ID", "NUMA"] if wide else []),
            "TOTAL",
            "ALLOCATABLE",
            "REQUESTED",
            "USED",
            "BURST",
            "UTIL",
            *[f"{_short_resource(r).upper()} USED/FREE" for r in resources],
            "HEALTH",
        ]
    ]
    for g in gpus:
        util = g.get("utilization_ratio")
        sl = g.get("slices") or {}
        rows.append(
            [
                str(g["index"]),
                g["model"],
                *([g["uuid"], g["pci_bus_id"], _numa(g.get("numa_node"))] if wide else []),
                _b(g["memory_total_bytes"]),
                _b(g["memory_allocatable_bytes"]),
                _b(g["memory_requested_bytes"]),
                _b(g.get("memory_used_bytes")),
                _b(g["memory_burst_granted_bytes"]),
                "?" if util is None else f"{util * 100:.0f}%",
                *[f"{sl[r]['allocated']}/{sl[r]['free']}" if r in sl else "?" for r in resources],
                "Healthy" if g["healthy"] else f"Unhealthy: {g.get('health_reason') or '?'}",
            ]
        )
    extra = 3 if wide else 0
    for m in status.get("mig") or []:
        where = [m["uuid"], m["pci_bus_id"], _numa(m.get("numa_node"))] if wide else []
        rows.append(
            [str(m["index"]), m["model"], *where, _b(m["memory_total"]), *["-"] * 5]
            + ["-" for _ in resources]
            + [m["reason"]]
        )
    for i, reason in sorted((status.get("unreachable") or {}).items(), key=lambda kv: int(kv[0])):
        rows.append([str(i), *["?"] * (7 + extra), *["?" for _ in resources], f"Unhealthy: {reason}"])
    lines += table(rows, align_right=range(2 + extra, 8 + extra + len(resources)))
    index_of = {g["uuid"]: g["index"] for g in gpus}
    containers = status.get("containers") or []
    lines.append("")
    if not containers:
        lines.append("No containers hold gpufrac devices.")
        return "\n".join(lines)
    crow = [
        [
            "NAMESPACE",
            "POD",
            "CONTAINER",
            "GPU",
            "RESOURCE",
            "REQUEST",
            "LIMIT",
            "USED",
            "BURST",
            "IDLE",
            "SHARE",
            "MODE",
            "COMPUTE",
            "CLASS",
            *(["PRIORITY", "PROCS", "OOM", "SWAPPED", "THROTTLED", "KEY"] if wide else []),
        ]
    ]
    for c in sorted(containers, key=lambda c: (c["namespace"], c["pod"], c["container"], c["key"])):
        crow.append(
            [
                c["namespace"] or "?",
                c["pod"] or f"({c['key']}, pod not known yet)",
                c["container"] or (f"claim {c['claim']}" if c.get("claim") else "?"),
                ",".join(str(index_of.get(u, "?")) for u in c["gpus"]),
                f"{_short_resource(c['resource'])} {c['slices']}",
                _b(c["request_bytes"]),
                _b(c["limit_bytes"]),
                _b(c.get("used_bytes")),
                _b(c["burst_granted_bytes"]),
                _duration(c.get("idle_seconds")),
                *_compute(c),
                c["workload_class"],
                *(
                    [
                        str(c["priority"]),
                        str(c.get("processes", 0)),
                        str(c.get("oom_refusals", 0)),
                        _b(c.get("swapped_bytes", 0)),
                        _duration(c.get("compute_throttled_seconds", 0.0)),
                        c["key"],
                    ]
                    if wide
                    else []
                ),
            ]
        )
    lines += table(crow, align_right=(5, 6, 7, 8, 9, 10, 12, *((14, 15, 16, 17, 18) if wide else ())))
    return "\n".join(lines)


def default_socket(args: argparse.Namespace) -> str:
    if getattr(args, "socket", None):
        return str(args.socket)
    from gpufrac.core import config as config_mod

    return config_mod.load(getattr(args, "config", None)).status_socket


def cmd_status(args: argparse.Namespace) -> int:
    """`gpufrac status [-o json|yaml|wide] [--socket PATH]`."""
    from gpufrac.core.config import ConfigError

    try:
        path = default_socket(args)
    except ConfigError as e:
        print(f"gpufrac status: {e}", file=sys.stderr)
        return 2
    try:
        data = fetch(path)
    except StatusUnavailable as e:
        print(f"gpufrac status: {e}", file=sys.stderr)
        return 1
    print(render(args, data, lambda wide: format_status(data, wide=wide), sort_keys=True))
    return 0
