"""`gpufrac sim ...`: create a simulated GPU node, inject faults, show its state.

gpufrac sim create (--preset NAME | --spec FILE) --out PATH [--node-name NAME]
gpufrac sim xid     --state PATH --gpu N [--xid 79]
gpufrac sim lose    --state PATH --gpu N
gpufrac sim restore --state PATH --gpu N
gpufrac sim util    --state PATH --gpu N [--gpu-util PCT] [--mem-util PCT]
gpufrac sim show    --state PATH [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

import psutil

from gpufrac.core.output import add_output_args, output_format, render
from gpufrac.core.units import format_bytes
from gpufrac.simgpu import faults
from gpufrac.simgpu.nodestate import CKPT_CHECKPOINTED, CKPT_FAILED, CKPT_LOCKED, NodeState, NodeStateError
from gpufrac.simgpu.spec import SpecError, create_node, load_preset, load_spec, preset_names

_CKPT_NAMES = {CKPT_LOCKED: "locked", CKPT_CHECKPOINTED: "checkpointed", CKPT_FAILED: "failed"}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpufrac sim", description="Manage a simulated GPU node.")
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)

    c = sub.add_parser("create", help="write a node-state file from a preset or a spec file")
    src = c.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", help=f"one of: {', '.join(preset_names())}")
    src.add_argument("--spec", help="node spec file (YAML, or JSON by .json suffix)")
    c.add_argument("--out", required=True, help="node-state file to write (SIMGPU_STATE)")
    c.add_argument("--node-name", help="override the node name (GPU UUIDs derive from it)")

    def gpu_cmd(name: str, help_: str) -> argparse.ArgumentParser:
        s = sub.add_parser(name, help=help_)
        s.add_argument("--state", required=True, help="node-state file")
        s.add_argument("--gpu", required=True, type=int, help="GPU index on the node")
        return s

    gpu_cmd("xid", "post an XID critical-error event").add_argument("--xid", type=int, default=79)
    gpu_cmd("lose", "the GPU falls off the bus (XID 79, then NVML_ERROR_GPU_IS_LOST)")
    gpu_cmd("restore", "bring a lost GPU back")
    u = gpu_cmd("util", "pin reported utilisation (omit a value to derive it from activity)")
    u.add_argument("--gpu-util", type=int, help="percent")
    u.add_argument("--mem-util", type=int, help="percent")

    s = sub.add_parser("show", help="GPUs, used memory and live processes")
    s.add_argument("--state", required=True, help="node-state file")
    add_output_args(s)
    return p


def snapshot(st: NodeState) -> dict[str, Any]:
    """The node's dynamic picture as plain data (for `show` and tests)."""
    n = st.node
    gpus = []
    for i, g in enumerate(st.gpus):
        gpus.append(
            {
                "index": i,
                "uuid": g.uuid.decode(),
                "name": g.name.decode(),
                "pci_bus_id": g.pci_bus_id.decode(),
                "numa_node": g.numa_node if g.numa_node >= 0 else None,
                "memory_total": g.total_bytes,
                "memory_reserved": g.reserved_bytes,
                "memory_used": g.used_bytes,
                "lost": bool(g.lost),
                "mig_enabled": bool(g.mig_mode),
                "events": g.event_seq,
            }
        )
    procs = []
    for p in st.live_procs():
        procs.append(
            {
                "pid": p.pid,
                "gpu": p.gpu,
                "alive": psutil.pid_exists(p.pid),
                "memory_used": p.used_bytes,
                "memory_swapped": p.swapped_bytes,
                "launches": p.launches,
                "checkpoint": _CKPT_NAMES.get(p.ckpt_state, "running"),
            }
        )
    return {
        "node_name": n.node_name.decode(),
        "driver_version": n.driver_version.decode(),
        "cuda_driver_version": n.cuda_driver_version,
        "checkpoint_supported": bool(n.checkpoint_supported),
        "gpus": gpus,
        "processes": procs,
    }


def _print_show(doc: dict[str, Any]) -> None:
    print(f"node {doc['node_name']}  driver {doc['driver_version']}  CUDA {doc['cuda_driver_version']}")
    print(f"{'GPU':>3}  {'UUID':<40}  {'NAME':<24}  {'USED':>8} / {'TOTAL':<8}  STATE")
    for g in doc["gpus"]:
        state = "LOST" if g["lost"] else "ok"
        if g["mig_enabled"]:
            state += ", MIG enabled"
        if g["events"]:
            state += f" ({g['events']} events)"
        used, total = format_bytes(g["memory_used"]), format_bytes(g["memory_total"])
        print(f"{g['index']:>3}  {g['uuid']:<40}  {g['name']:<24}  {used:>8} / {total:<8}  {state}")
    print(f"\n{len(doc['processes'])} process slot(s)")
    for p in doc["processes"]:
        note = "" if p["alive"] else "  (exited, not yet reaped)"
        print(
            f"  pid {p['pid']:>7}  GPU {p['gpu']}  {format_bytes(p['memory_used']):>8}"
            f"  launches {p['launches']}  {p['checkpoint']}{note}"
        )


def _run(args: argparse.Namespace) -> int:
    if args.action == "create":
        spec = load_preset(args.preset) if args.preset else load_spec(args.spec)
        if args.node_name:
            spec = dataclasses.replace(spec, node_name=args.node_name)
        path = create_node(spec, args.out)
        print(f"created {path}: {spec.node_name}, {len(spec.gpus)} x {spec.gpus[0].model}")
        print(f"use it with: SIMGPU_STATE={path} LD_LIBRARY_PATH=<gpufrac>/build/native")
        return 0
    if args.action == "show":
        with NodeState(args.state) as st:
            doc = snapshot(st)
        if output_format(args) in ("json", "yaml"):
            print(render(args, doc, str))
        else:
            _print_show(doc)  # the table has no wider form
        return 0
    if args.action == "xid":
        seq = faults.inject_xid(args.state, args.gpu, args.xid)
        print(f"XID {args.xid} posted on GPU {args.gpu} (event {seq})")
    elif args.action == "lose":
        faults.fall_off_bus(args.state, args.gpu)
        print(f"GPU {args.gpu} fell off the bus")
    elif args.action == "restore":
        faults.restore_gpu(args.state, args.gpu)
        print(f"GPU {args.gpu} restored")
    elif args.action == "util":
        faults.set_utilisation(args.state, args.gpu, args.gpu_util, args.mem_util)
        print(f"GPU {args.gpu} utilisation: gpu={args.gpu_util}, memory={args.mem_util} (None = derived)")
    return 0


def cmd_sim(args: argparse.Namespace) -> int:
    """Entry point of `gpufrac sim`; args.sim_args holds the rest of the command line."""
    sub = _parser().parse_args(list(args.sim_args))
    try:
        return _run(sub)
    except (SpecError, NodeStateError, faults.FaultError) as e:
        print(f"gpufrac sim {sub.action}: {e}", file=sys.stderr)
        return 2
