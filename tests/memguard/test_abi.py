"""The ctypes mirrors match the C headers, field for field.

A C probe is compiled against the real headers (nodestate.h, memguard_abi.h) and
prints sizeof/offsetof of every field the Python side declares, plus the shared
constants; any drift between C and Python fails here instead of corrupting a
shared file at run time.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest

from gpufrac.core import native
from gpufrac.memguard import abi, wire
from gpufrac.simgpu import nodestate

pytestmark = pytest.mark.unit

SIM_HDR = native.REPO_ROOT / "gpufrac/simgpu/native/nodestate.h"
MG_HDR = native.REPO_ROOT / "gpufrac/memguard/native/memguard_abi.h"

# ctypes mirror -> C typedef
STRUCTS: list[tuple[type[ctypes.Structure], str]] = [
    (nodestate.Event, "simgpu_event_t"),
    (nodestate.Gpu, "simgpu_gpu_t"),
    (nodestate.Proc, "simgpu_proc_t"),
    (nodestate.Node, "simgpu_node_t"),
    (abi.ConfigStruct, "mg_config_t"),
    (abi.ProcSlot, "mg_proc_slot_t"),
    (abi.UsageStruct, "mg_usage_t"),
    (abi.ComputeStruct, "mg_compute_t"),
    (wire.BurstRequest, "mg_burst_req_t"),
    (wire.BurstReply, "mg_burst_rep_t"),
]

# Python constant -> C macro
CONSTANTS: list[tuple[int, str]] = [
    (nodestate.MAGIC, "SIMGPU_MAGIC"),
    (nodestate.ABI_VERSION, "SIMGPU_ABI_VERSION"),
    (nodestate.MAX_GPUS, "SIMGPU_MAX_GPUS"),
    (nodestate.MAX_NVLINKS, "SIMGPU_MAX_NVLINKS"),
    (nodestate.MAX_PROCS, "SIMGPU_MAX_PROCS"),
    (nodestate.EVENT_RING, "SIMGPU_EVENT_RING"),
    (nodestate.CPU_WORDS, "SIMGPU_CPU_WORDS"),
    (nodestate.UUID_LEN, "SIMGPU_UUID_LEN"),
    (nodestate.NAME_LEN, "SIMGPU_NAME_LEN"),
    (nodestate.BUSID_LEN, "SIMGPU_BUSID_LEN"),
    (nodestate.NVLINK_NVSWITCH, "SIMGPU_NVLINK_NVSWITCH"),
    (nodestate.PID_FREE, "SIMGPU_PID_FREE"),
    (nodestate.PID_REAPING, "SIMGPU_PID_REAPING"),
    (nodestate.TOPO_INTERNAL, "SIMGPU_TOPO_INTERNAL"),
    (nodestate.TOPO_SINGLE, "SIMGPU_TOPO_SINGLE"),
    (nodestate.TOPO_MULTIPLE, "SIMGPU_TOPO_MULTIPLE"),
    (nodestate.TOPO_HOSTBRIDGE, "SIMGPU_TOPO_HOSTBRIDGE"),
    (nodestate.TOPO_NODE, "SIMGPU_TOPO_NODE"),
    (nodestate.TOPO_SYSTEM, "SIMGPU_TOPO_SYSTEM"),
    (nodestate.CKPT_RUNNING, "SIMGPU_CKPT_RUNNING"),
    (nodestate.CKPT_LOCKED, "SIMGPU_CKPT_LOCKED"),
    (nodestate.CKPT_CHECKPOINTED, "SIMGPU_CKPT_CHECKPOINTED"),
    (nodestate.CKPT_FAILED, "SIMGPU_CKPT_FAILED"),
    (abi.CONFIG_MAGIC, "MG_CONFIG_MAGIC"),
    (abi.USAGE_MAGIC, "MG_USAGE_MAGIC"),
    (abi.COMPUTE_MAGIC, "MG_COMPUTE_MAGIC"),
    (abi.ABI_VERSION, "MG_ABI_VERSION"),
    (abi.MAX_PROCS, "MG_MAX_PROCS"),
    (abi.MIN_ARBITER_TIMEOUT_MS, "MG_MIN_ARBITER_TIMEOUT_MS"),
    (abi.FLAG_POD_KNOWN, "MG_FLAG_POD_KNOWN"),
    (abi.FLAG_PREEMPTIBLE, "MG_FLAG_PREEMPTIBLE"),
    (abi.FLAG_SWAPPABLE, "MG_FLAG_SWAPPABLE"),
    (abi.FLAG_WHOLE_GPU, "MG_FLAG_WHOLE_GPU"),
    (abi.FLAG_DISABLED, "MG_FLAG_DISABLED"),
    (abi.CLASS_BATCH, "MG_CLASS_BATCH"),
    (abi.CLASS_INTERACTIVE, "MG_CLASS_INTERACTIVE"),
    (abi.CLASS_INFERENCE, "MG_CLASS_INFERENCE"),
    (wire.BURST_MAGIC, "MG_BURST_MAGIC"),
    (wire.BURST_OP_BURST, "MG_BURST_OP_BURST"),
    (wire.BURST_OP_RECLAIM, "MG_BURST_OP_RECLAIM"),
    (wire.BURST_GRANTED, "MG_BURST_GRANTED"),
    (wire.BURST_DENIED, "MG_BURST_DENIED"),
    (wire.BURST_BUSY, "MG_BURST_BUSY"),
]


def _probe_source() -> str:
    lines = [
        "#include <stddef.h>",
        "#include <stdio.h>",
        f'#include "{SIM_HDR}"',
        f'#include "{MG_HDR}"',
        "int main(void) {",
    ]
    for cls, cname in STRUCTS:
        lines.append(f'    printf("sizeof {cname} %zu\\n", sizeof({cname}));')
        for name, *_ in cls._fields_:
            lines.append(
                f'    printf("field {cname} {name} %zu %zu\\n", offsetof({cname}, {name}),'
                f" sizeof((({cname} *)0)->{name}));"
            )
    for _, macro in CONSTANTS:
        lines.append(f'    printf("const {macro} %lld\\n", (long long)({macro}));')
    lines += ["    return 0;", "}"]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> dict[str, int]:
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc, "a C compiler is needed to build the native parts"
    d: Path = tmp_path_factory.mktemp("abi")
    (d / "probe.c").write_text(_probe_source())
    subprocess.run(
        [cc, "-std=c11", "-Wall", "-Werror", "-o", str(d / "probe"), str(d / "probe.c")], check=True
    )
    out = subprocess.run([str(d / "probe")], check=True, capture_output=True, text=True).stdout
    facts: dict[str, int] = {}
    for line in out.splitlines():
        kind, *rest = line.split()
        if kind == "field":
            cname, field, off, size = rest
            facts[f"{cname}.{field}.offset"] = int(off)
            facts[f"{cname}.{field}.size"] = int(size)
        else:
            facts[f"{kind} {rest[0]}"] = int(rest[1])
    return facts


@pytest.mark.parametrize(("cls", "cname"), STRUCTS, ids=[c for _, c in STRUCTS])
def test_struct_layout_matches_header(probe: dict[str, int], cls: type[ctypes.Structure], cname: str) -> None:
    assert ctypes.sizeof(cls) == probe[f"sizeof {cname}"], f"sizeof {cname}"
    for name, *_ in cls._fields_:
        desc = getattr(cls, name)
        assert (desc.offset, desc.size) == (probe[f"{cname}.{name}.offset"], probe[f"{cname}.{name}.size"]), (
            f"{cname}.{name}: ctypes (offset, size) differs from C"
        )


def test_ctypes_mirror_covers_the_whole_struct(probe: dict[str, int]) -> None:
    """No C field hides in a gap: consecutive ctypes fields tile each struct."""
    for cls, cname in STRUCTS:
        end = 0
        for name, *_ in cls._fields_:
            desc = getattr(cls, name)
            assert desc.offset == end, f"{cname}: gap or overlap before {name}"
            end = desc.offset + desc.size
        assert end == probe[f"sizeof {cname}"], f"{cname}: trailing bytes not mirrored"


@pytest.mark.parametrize(("value", "macro"), CONSTANTS, ids=[m for _, m in CONSTANTS])
def test_constants_match_header(probe: dict[str, int], value: int, macro: str) -> None:
    c = probe[f"const {macro}"]
    assert value == (c & 0xFFFFFFFFFFFFFFFF if value > 1 << 62 else c), macro
