"""A PyTorch process on a real GPU, driven by JSON lines on stdin, one JSON reply per line.

tests/gpu starts it with or without the memguard shim (LD_PRELOAD of libmemguard.so,
GPUFRAC_CONTAINER_DIR) and asks it to allocate, free, check and report what it sees.
It never imports anything of the test suite: it is what a user's training or serving
process does, plus reporting.

Requests ({"op": ..., ...}) and what each answers ({"ok": true, ...} or {"ok": false,
"error": ..., "oom": bool}):
  info                          what the process sees: torch.cuda.mem_get_info, NVML memory
                                (v1 and v2), torch's reserved/allocated, the container's
                                usage file and this process's slot in it
  alloc name bytes [seed]       torch.empty of `bytes` (int32 words) kept as `name`; with a
                                seed, filled with a known pattern (from host memory, so the
                                fill needs no GPU memory besides the tensor)
  free name                     drop the tensor (the caching allocator may keep the memory)
  empty_cache                   torch.cuda.empty_cache()
  launch                        one small kernel on every kept tensor (GPU work)
  check name                    a kernel on the tensor first (GPU work: what brings a swapped
                                process back), then every word compared with its pattern
  graph replays                 capture y = x * 2 + 1 in a CUDA graph and replay it
  exit
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Any

import torch

DEV = torch.device("cuda", 0)
OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)
MULT = 40503  # word i of a tensor filled with seed s holds (i * MULT + s) & 0x7FFFFFFF
CHUNK = 1 << 24  # words per host<->device copy while filling and checking
tensors: dict[str, tuple[torch.Tensor, int | None, int]] = {}  # name -> (tensor, seed, data_ptr)
_nvml: Any = None


def pattern(start: int, stop: int, seed: int) -> torch.Tensor:
    t = torch.arange(start, stop, dtype=torch.int64)
    return t.mul_(MULT).add_(seed).bitwise_and_(0x7FFFFFFF).to(torch.int32)


def usage() -> dict[str, Any] | None:
    """The container's usage file as the shim keeps it (None when not under the shim)."""
    cdir = os.environ.get("GPUFRAC_CONTAINER_DIR")
    if not cdir:
        return None
    from gpufrac.memguard import abi

    u = abi.read_usage(cdir)
    mine = next((s for s in u.slots if s.pid == os.getpid()), None)
    slot = (
        {k: int(getattr(mine, k)) for k in ("used_bytes", "launches", "oom_refusals", "swapped")}
        if mine is not None
        else None
    )
    return {"total_used": int(u.total_used), "live": sum(1 for s in u.slots if s.pid > 0), "slot": slot}


def nvml_memory() -> dict[str, Any]:
    """NVML's memory reading of this process's GPU (v1 and v2 calls), as nvidia-smi gets it."""
    global _nvml
    import pynvml

    if _nvml is None:
        pynvml.nvmlInit()
        uuid = os.environ.get("GPUFRAC_TEST_GPU_UUID")
        _nvml = pynvml.nvmlDeviceGetHandleByUUID(uuid) if uuid else pynvml.nvmlDeviceGetHandleByIndex(0)
    m1 = pynvml.nvmlDeviceGetMemoryInfo(_nvml)
    m2 = pynvml.nvmlDeviceGetMemoryInfo(_nvml, version=pynvml.nvmlMemory_v2)
    return {
        "v1": {"total": int(m1.total), "free": int(m1.free), "used": int(m1.used)},
        "v2": {
            "total": int(m2.total),
            "free": int(m2.free),
            "used": int(m2.used),
            "reserved": int(m2.reserved),
        },
    }


def info() -> dict[str, Any]:
    torch.cuda.synchronize(DEV)
    u = usage()  # first: nothing below allocates
    free, total = torch.cuda.mem_get_info(DEV)
    return {
        "usage": u,
        "mem_get_info": {"free": int(free), "total": int(total)},
        "nvml": nvml_memory(),
        "reserved": int(torch.cuda.memory_reserved(DEV)),
        "allocated": int(torch.cuda.memory_allocated(DEV)),
    }


def alloc(name: str, nbytes: int, seed: int | None = None) -> dict[str, Any]:
    words = nbytes // 4
    t = torch.empty(words, dtype=torch.int32, device=DEV)
    if seed is not None:
        for a in range(0, words, CHUNK):
            b = min(words, a + CHUNK)
            t[a:b].copy_(pattern(a, b, seed))
        torch.cuda.synchronize(DEV)
    tensors[name] = (t, seed, t.data_ptr())
    return {"ptr": t.data_ptr()}


def launch() -> dict[str, Any]:
    for t, _, _ in tensors.values():
        (t[:1024] + 1).sum()
    torch.cuda.synchronize(DEV)
    return {}


def check(name: str) -> dict[str, Any]:
    t, seed, ptr = tensors[name]
    assert seed is not None, f"{name} was not filled with a pattern"
    (t[:1024] + 1).sum()  # a kernel first: GPU work, as an application's next step would be
    torch.cuda.synchronize(DEV)
    bad = 0
    for a in range(0, t.numel(), CHUNK):
        b = min(t.numel(), a + CHUNK)
        bad += int((t[a:b].cpu() != pattern(a, b, seed)).sum())
    return {"bad_words": bad, "same_address": t.data_ptr() == ptr}


def graph(replays: int) -> dict[str, Any]:
    """A CUDA graph captured and replayed; the launch counter of this process's usage slot
    is read around the replays alone (each replay is one cuGraphLaunch)."""
    x = torch.zeros(1 << 20, device=DEV)
    side = torch.cuda.Stream(DEV)
    side.wait_stream(torch.cuda.current_stream(DEV))
    with torch.cuda.stream(side):
        for _ in range(3):  # warm-up outside the capture, as PyTorch's docs ask
            y = x * 2 + 1
    torch.cuda.current_stream(DEV).wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = x * 2 + 1
    wrong = 0
    launches: list[int] = []
    for i in range(replays):
        x.fill_(float(i))
        torch.cuda.synchronize(DEV)
        before = usage()
        g.replay()
        torch.cuda.synchronize(DEV)
        after = usage()
        if before and after and before["slot"] and after["slot"]:
            launches.append(after["slot"]["launches"] - before["slot"]["launches"])
        wrong += int((y != 2 * i + 1).sum())
    return {"wrong": wrong, "replay_launches": launches, **info()}


def handle(req: dict[str, Any]) -> dict[str, Any]:
    op = req["op"]
    if op == "info":
        return info()
    if op == "alloc":
        return alloc(req["name"], int(req["bytes"]), req.get("seed"))
    if op == "free":
        del tensors[req["name"]]
        torch.cuda.synchronize(DEV)
        return {}
    if op == "empty_cache":
        torch.cuda.synchronize(DEV)
        torch.cuda.empty_cache()
        return {}
    if op == "launch":
        return launch()
    if op == "check":
        return check(req["name"])
    if op == "graph":
        return graph(int(req.get("replays", 5)))
    raise ValueError(f"unknown op {op!r}")


def reply(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> int:
    torch.cuda.init()
    torch.zeros(1, device=DEV)  # the context exists before the first request
    reply({"ok": True, "ready": True, "pid": os.getpid(), "device": torch.cuda.get_device_name(DEV)})
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        if req["op"] == "exit":
            reply({"ok": True})
            return 0
        try:
            out = handle(req)
        except OOM as e:
            out = {"ok": False, "oom": True, "error": str(e).splitlines()[0]}
        except Exception as e:
            out = {
                "ok": False,
                "oom": False,
                "error": f"{type(e).__name__}: {e}",
                "trace": traceback.format_exc(),
            }
        else:
            out = {"ok": True, **out}
        reply(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
