"""`gpufrac memguard inspect NAMESPACE/POD[/CONTAINER]` (or a container's directory):
what the shim of one container is held to (the agent's config) and what its processes
use (the shim's usage file).

A pod name is resolved through the running agent (the command, gpufrac.agent.cli.memguard):
its status socket lists every container it holds with the directory it wrote for it. A host
path (starting with / or .) is read directly, with no agent needed (a node whose agent is down).
This module reads and formats; it asks the agent nothing.

Pids are as the shim recorded them, in the container's pid namespace; activity
ages use CLOCK_MONOTONIC, which the host and its containers share.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from gpufrac.core.output import table
from gpufrac.core.units import format_bytes
from gpufrac.memguard import abi

FLAG_NAMES = {
    abi.FLAG_POD_KNOWN: "pod-known",
    abi.FLAG_PREEMPTIBLE: "preemptible",
    abi.FLAG_SWAPPABLE: "swappable",
    abi.FLAG_WHOLE_GPU: "whole-gpu",
    abi.FLAG_DISABLED: "disabled",
}


def flag_names(flags: int) -> list[str]:
    names = [name for bit, name in FLAG_NAMES.items() if flags & bit]
    unknown = flags & ~sum(FLAG_NAMES)
    if unknown:
        names.append(f"0x{unknown:x}")
    return names


def inspect_dir(directory: str | Path) -> dict[str, Any]:
    """One container's memguard state as plain data. Raises FormatError if the
    config cannot be read; a missing or damaged usage file is reported in
    `usage_error` (the shim refuses allocations in that state)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise abi.FormatError(f"{directory}: no such directory")
    if not (directory / abi.CONFIG_FILE).exists():
        raise abi.FormatError(
            f"{directory} is not a container's gpufrac directory (it has no {abi.CONFIG_FILE} file); "
            "those are <paths.stateDir>/containers/<key>, /var/lib/gpufrac/containers/<key> by default"
        )
    cfg = abi.read_config(directory)
    out: dict[str, Any] = {
        "dir": str(directory),
        "generation": abi.generation(directory),
        "gpu_uuid": cfg.gpu_uuid,
        "namespace": cfg.namespace,
        "pod": cfg.pod,
        "container": cfg.container,
        "pod_uid": cfg.pod_uid,
        "request_bytes": cfg.request_bytes,
        "limit_bytes": cfg.limit_bytes,
        "grant_bytes": cfg.grant_bytes,
        "flags": flag_names(cfg.flags),
        "workload_class": abi.CLASS_BY_NUMBER.get(cfg.workload_class, str(cfg.workload_class)),
        "priority": cfg.priority,
        "arbiter_timeout_ms": cfg.arbiter_timeout_ms,
        "wait_timeout_ms": cfg.wait_timeout_ms,
        "usage_error": None,
        "total_used_bytes": None,
        "grant_returned_bytes": None,
        "processes": [],
    }
    try:
        usage = abi.read_usage(directory)
    except abi.FormatError as e:
        out["usage_error"] = str(e)
        return out
    now = time.monotonic_ns()
    out["total_used_bytes"] = int(usage.total_used)
    out["grant_returned_bytes"] = int(usage.grant_returned)
    for slot in usage.slots:
        if slot.pid == 0:
            continue
        last = int(slot.last_activity_ns)
        out["processes"].append(
            {
                "pid": int(slot.pid),  # -1: being reclaimed right now
                "used_bytes": int(slot.used_bytes),
                "peak_bytes": int(slot.peak_bytes),
                "launches": int(slot.launches),
                "idle_seconds": round(max(0, now - last) / 1e9, 3) if last else None,
                "oom_refusals": int(slot.oom_refusals),
                "swapped": bool(slot.swapped),
            }
        )
    return out


class TargetError(Exception):
    """The NAMESPACE/POD[/CONTAINER] names nothing the agent holds (or names it ambiguously)."""


def is_host_path(target: str) -> bool:
    return target.startswith(("/", "."))


def parse_target(target: str) -> tuple[str, str, str | None]:
    """NAMESPACE/POD or NAMESPACE/POD/CONTAINER; ValueError says what is wrong."""
    parts = target.split("/")
    if len(parts) not in (2, 3) or not all(parts):
        raise ValueError(
            f"{target!r} is neither NAMESPACE/POD[/CONTAINER] nor a host path (those start with / or .)"
        )
    return parts[0], parts[1], parts[2] if len(parts) == 3 else None


def resolve_target(status: dict[str, Any], namespace: str, pod: str, container: str | None) -> str:
    """The directory of the container the agent's status document names; TargetError if
    none, or if the pod has several and `container` does not say which."""
    node = status.get("node", "?")
    held = [
        c for c in status.get("containers") or [] if (c.get("namespace"), c.get("pod")) == (namespace, pod)
    ]
    if not held:
        raise TargetError(f"no container of pod {namespace}/{pod} holds gpufrac devices on node {node}")
    if container is not None:
        held = [c for c in held if c.get("container") == container]
        if not held:
            raise TargetError(
                f"container {container} of pod {namespace}/{pod} holds no gpufrac devices on node {node}"
            )
    names = sorted({c.get("container") or "?" for c in held})
    if len(held) > 1:
        raise TargetError(
            f"pod {namespace}/{pod} has several containers with gpufrac devices: {', '.join(names)}; "
            f"name one: {namespace}/{pod}/CONTAINER"
        )
    return str(held[0]["directory"])


def format_report(d: dict[str, Any], *, wide: bool = False) -> str:
    who = "/".join(x for x in (d["namespace"], d["pod"], d["container"]) if x) or "(pod not known yet)"
    lines = [
        f"container  {who}",
        f"gpu        {d['gpu_uuid'] or '-'}",
        f"request    {format_bytes(d['request_bytes'])}",
        f"limit      {format_bytes(d['limit_bytes'])}",
        f"grant      {format_bytes(d['grant_bytes'])}",
        f"generation {d['generation']}",
        f"flags      {','.join(d['flags']) or '-'}",
        f"class      {d['workload_class']} (priority {d['priority']})",
    ]
    if wide:
        lines += [
            f"directory  {d['dir']}",
            f"pod uid    {d['pod_uid'] or '-'}",
            f"timeouts   arbiter {d['arbiter_timeout_ms']} ms, wait {d['wait_timeout_ms']} ms",
        ]
    if d["usage_error"]:
        lines.append(f"usage      UNREADABLE: {d['usage_error']}")
        return "\n".join(lines)
    lines.append(f"total      {format_bytes(d['total_used_bytes'])} used")
    procs = d["processes"]
    if not procs:
        lines.append("processes  none")
        return "\n".join(lines)
    rows = [["PID", "USED", "PEAK", "LAUNCHES", "IDLE", "OOM", "SWAPPED"]]
    for p in procs:
        idle = "-" if p["idle_seconds"] is None else f"{p['idle_seconds']:.1f}s"
        rows.append(
            [
                str(p["pid"]),
                format_bytes(p["used_bytes"]),
                format_bytes(p["peak_bytes"]),
                str(p["launches"]),
                idle,
                str(p["oom_refusals"]),
                "yes" if p["swapped"] else "no",
            ]
        )
    lines.append("")
    lines += table(rows, align_right=range(len(rows[0])))
    return "\n".join(lines)
