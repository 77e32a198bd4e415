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
  keep_graph                    capture y = x * 3 + 1 in a CUDA graph and keep it (graph, x, y)
  replay_graph                  replay the kept graph on new input; how many outputs were wrong
  model                         a small MLP and Adam on the GPU, kept; a copy of its weights on
                                the host (snapshot) to compare with later
  train steps                   `steps` training steps of the kept model; first and last loss
  same_weights                  the kept model's weights against the host snapshot, bit for bit
  busy seconds [streams]        a spinning kernel of about `seconds` on each of `streams` streams,
                                then y = x * 5 + 2 after it on each; answers at once, before the
                                kernels end (what a swap meets mid-kernel)
  busy_check                    waits for the busy kernels and checks every y
  pinned_bw bytes [repeats]     host<->device copies from/to pinned host memory: median GB/s
                                each way (the host link's bandwidth, for swap's to compare with)
  stage name                    one step of what a real process sets up, for its context cost:
                                cublas (a matmul), cudnn (a convolution), nccl (a one-rank
                                communicator and an all-reduce, kept), cupy (a CuPy kernel)
  generate tokens               a small transformers causal LM built from a config (random
                                weights, nothing downloaded) runs generate() for `tokens` tokens
  exit

Times ("t_*") are time.monotonic(): CLOCK_MONOTONIC, the same clock in every process of the
machine, so the tests compare them with their own.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any

import torch

DEV = torch.device("cuda", 0)
OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)
MULT = 40503  # word i of a tensor filled with seed s holds (i * MULT + s) & 0x7FFFFFFF
CHUNK = 1 << 24  # words per host<->device copy while filling and checking
# name -> (tensor, seed, data_ptr, checked on the GPU)
tensors: dict[str, tuple[torch.Tensor, int | None, int, bool]] = {}
kept: dict[str, Any] = {}  # what the ops below keep between requests (graph, model, busy, nccl)
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
        "total_memory": int(torch.cuda.get_device_properties(DEV).total_memory),
        "nvml": nvml_memory(),
        "reserved": int(torch.cuda.memory_reserved(DEV)),
        "allocated": int(torch.cuda.memory_allocated(DEV)),
    }


def device_pattern(start: int, stop: int, seed: int) -> torch.Tensor:
    """pattern(), computed on the GPU (64 MiB of scratch per chunk)."""
    t = torch.arange(start, stop, dtype=torch.int64, device=DEV)
    return t.mul_(MULT).add_(seed).bitwise_and_(0x7FFFFFFF).to(torch.int32)


def alloc(name: str, nbytes: int, seed: int | None = None, on_device: bool = False) -> dict[str, Any]:
    """on_device: fill and later check on the GPU (fast, for GiBs), which needs a chunk of
    scratch GPU memory; otherwise from host memory (nothing but the tensor on the GPU)."""
    words = nbytes // 4
    t = torch.empty(words, dtype=torch.int32, device=DEV)
    torch.cuda.synchronize(DEV)
    t_done = time.monotonic()  # the allocation returned (a waiting one: granted)
    if seed is not None:
        for a in range(0, words, CHUNK):
            b = min(words, a + CHUNK)
            t[a:b].copy_(device_pattern(a, b, seed) if on_device else pattern(a, b, seed))
        torch.cuda.synchronize(DEV)
    tensors[name] = (t, seed, t.data_ptr(), on_device)
    return {"ptr": t.data_ptr(), "t_done": t_done}


def launch() -> dict[str, Any]:
    for t, _, _, _ in tensors.values():
        (t[:1024] + 1).sum()
    torch.cuda.synchronize(DEV)
    return {}


def check(name: str) -> dict[str, Any]:
    t, seed, ptr, on_device = tensors[name]
    assert seed is not None, f"{name} was not filled with a pattern"
    (t[:1024] + 1).sum()  # a kernel first: GPU work, as an application's next step would be
    torch.cuda.synchronize(DEV)
    bad = 0
    for a in range(0, t.numel(), CHUNK):
        b = min(t.numel(), a + CHUNK)
        if on_device:
            bad += int((t[a:b] != device_pattern(a, b, seed)).sum())
        else:
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


def keep_graph() -> dict[str, Any]:
    """A graph captured and kept (swap must bring back its memory and its executable)."""
    x = torch.zeros(1 << 20, device=DEV)
    side = torch.cuda.Stream(DEV)
    side.wait_stream(torch.cuda.current_stream(DEV))
    with torch.cuda.stream(side):
        for _ in range(3):
            y = x * 3 + 1
    torch.cuda.current_stream(DEV).wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = x * 3 + 1
    kept["graph"] = (g, x, y)
    return replay_graph(1.0)


def replay_graph(value: float = 2.0) -> dict[str, Any]:
    g, x, y = kept["graph"]
    x.fill_(value)
    g.replay()
    torch.cuda.synchronize(DEV)
    return {"wrong": int((y != 3 * value + 1).sum())}


def model() -> dict[str, Any]:
    torch.manual_seed(1)
    net = torch.nn.Sequential(
        torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 512)
    ).to(DEV)  # fmt: skip
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    x = torch.randn(256, 512, device=DEV)
    y = torch.randn(256, 512, device=DEV)
    kept["model"] = (net, opt, x, y)
    train(5)  # Adam's state exists before the snapshot
    kept["snapshot"] = {k: v.detach().cpu().clone() for k, v in net.state_dict().items()}
    return {}


def train(steps: int) -> dict[str, Any]:
    net, opt, x, y = kept["model"]
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(net(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    torch.cuda.synchronize(DEV)
    return {"loss_first": losses[0].item(), "loss_last": losses[-1].item()}


def same_weights() -> dict[str, Any]:
    net = kept["model"][0]
    differ = [k for k, v in net.state_dict().items() if not torch.equal(v.cpu(), kept["snapshot"][k])]
    return {"differ": differ}


def busy(seconds: float, streams: int = 1) -> dict[str, Any]:
    """Kernels in flight when this answers: torch.cuda._sleep spins for a number of GPU
    clock cycles (`seconds` at the SM clock's maximum: at least that long)."""
    hz = sm_clock_hz()
    inputs = [torch.full((1 << 20,), float(i + 1), device=DEV) for i in range(streams)]
    torch.cuda.synchronize(DEV)  # before any kernel is launched: it would wait for them
    work = []
    for i, x in enumerate(inputs):
        s = torch.cuda.Stream(DEV)
        s.wait_stream(torch.cuda.current_stream(DEV))
        with torch.cuda.stream(s):
            torch.cuda._sleep(int(seconds * hz))
            y = x * 5 + 2
        work.append((s, x, y, float(i + 1)))
    kept["busy"] = work
    t = time.monotonic()
    done = [bool(s.query()) for s, _, _, _ in work]  # False: still running as we answer
    return {"t_launched": t, "done_at_answer": done, "sm_clock_hz": hz}


def busy_check() -> dict[str, Any]:
    wrong = 0
    for s, _, y, v in kept.pop("busy"):
        s.synchronize()
        wrong += int((y != v * 5 + 2).sum())
    return {"wrong": wrong, "t_done": time.monotonic()}


def sm_clock_hz() -> float:
    """The SM clock's maximum (NVML), or the H100's boost clock where NVML says nothing
    useful: at a lower clock the spinning kernel only runs longer."""
    import pynvml

    nvml_memory()  # initialises NVML and the handle
    try:
        mhz = pynvml.nvmlDeviceGetMaxClockInfo(_nvml, pynvml.NVML_CLOCK_SM)
    except pynvml.NVMLError:
        mhz = 0
    return float(mhz or 1980) * 1e6


def pinned_bw(nbytes: int, repeats: int = 5) -> dict[str, Any]:
    """Median GB/s of pinned host -> device and device -> host copies of `nbytes`, timed
    with CUDA events (the host link as the checkpoint's copies could at best use it)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host.fill_(7)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=DEV)
    out: dict[str, Any] = {"bytes": nbytes}
    for name, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
        dst.copy_(src, non_blocking=True)  # warm-up
        torch.cuda.synchronize(DEV)
        rates = []
        for _ in range(repeats):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src, non_blocking=True)
            b.record()
            b.synchronize()
            rates.append(nbytes / (a.elapsed_time(b) / 1e3) / 1e9)
        out[f"{name}_gbps"] = sorted(rates)[len(rates) // 2]
        out[f"{name}_samples"] = rates
    del host, dev
    torch.cuda.synchronize(DEV)
    torch.cuda.empty_cache()
    return out


def stage(name: str) -> dict[str, Any]:
    if name == "cublas":
        a = torch.randn(2048, 2048, device=DEV)
        b = (a @ a).float().sum()
        torch.cuda.synchronize(DEV)
        return {"check": bool(torch.isfinite(b))}
    if name == "cudnn":
        assert torch.backends.cudnn.is_available(), "cuDNN is not available to PyTorch"
        x = torch.randn(8, 16, 64, 64, device=DEV)
        conv = torch.nn.Conv2d(16, 32, 3, padding=1).to(DEV)
        y = conv(x).sum()
        torch.cuda.synchronize(DEV)
        return {"check": bool(torch.isfinite(y)), "cudnn": torch.backends.cudnn.version()}
    if name == "nccl":
        return nccl()
    if name == "cupy":
        import cupy

        with cupy.cuda.Device(0):
            x = cupy.arange(1 << 20, dtype=cupy.float64)
            square = cupy.ElementwiseKernel("float64 x", "float64 y", "y = x * x", "gpufrac_square")
            total = float(square(x).sum())
            cupy.cuda.Device(0).synchronize()
        n = (1 << 20) - 1
        want = n * (n + 1) * (2 * n + 1) / 6
        return {"check": abs(total - want) <= want * 1e-9, "cupy": cupy.__version__}
    raise ValueError(f"unknown stage {name!r}")


def nccl() -> dict[str, Any]:
    """A one-rank NCCL communicator (init and an all-reduce), kept until exit."""
    import tempfile

    import torch.distributed as dist

    store = dist.FileStore(tempfile.mktemp(prefix="gpufrac-nccl-"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=DEV)
    t = torch.full((1 << 20,), 3.0, device=DEV)
    dist.all_reduce(t)
    torch.cuda.synchronize(DEV)
    kept["nccl"] = store
    return {"check": bool((t == 3.0).all()), "nccl": ".".join(map(str, torch.cuda.nccl.version()))}


def generate(tokens: int) -> dict[str, Any]:
    """A small Llama-style causal LM from a config (random weights, nothing downloaded)."""
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=4096,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=1024,
    )
    torch.manual_seed(0)
    lm = transformers.LlamaForCausalLM(cfg).to(DEV, dtype=torch.bfloat16).eval()
    prompt = torch.randint(0, cfg.vocab_size, (4, 32), device=DEV)
    with torch.no_grad():
        out = lm.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=tokens, min_new_tokens=tokens,
            do_sample=False, pad_token_id=0,
        )  # fmt: skip
    torch.cuda.synchronize(DEV)
    return {"shape": list(out.shape), "transformers": transformers.__version__, **info()}


def handle(req: dict[str, Any]) -> dict[str, Any]:
    op = req["op"]
    if op == "info":
        return info()
    if op == "alloc":
        return alloc(req["name"], int(req["bytes"]), req.get("seed"), bool(req.get("on_device")))
    if op == "free":
        del tensors[req["name"]]
        torch.cuda.synchronize(DEV)
        return {}
    if op == "empty_cache":
        torch.cuda.synchronize(DEV)
        t_before = time.monotonic()
        torch.cuda.empty_cache()
        return {"t_before": t_before, "t_after": time.monotonic()}
    if op == "launch":
        return launch()
    if op == "check":
        return check(req["name"])
    if op == "graph":
        return graph(int(req.get("replays", 5)))
    simple = {
        "keep_graph": keep_graph,
        "replay_graph": replay_graph,
        "model": model,
        "same_weights": same_weights,
        "busy_check": busy_check,
    }
    if op in simple:
        return simple[op]()
    if op == "train":
        return train(int(req["steps"]))
    if op == "busy":
        return busy(float(req["seconds"]), int(req.get("streams", 1)))
    if op == "pinned_bw":
        return pinned_bw(int(req["bytes"]), int(req.get("repeats", 5)))
    if op == "stage":
        return stage(req["name"])
    if op == "generate":
        return generate(int(req["tokens"]))
    raise ValueError(f"unknown op {op!r}")


def reply(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> int:
    torch.cuda.init()
    torch.zeros(1, device=DEV)  # the context exists before the first request
    torch.cuda.synchronize(DEV)
    reply(
        {
            "ok": True,
            "ready": True,
            "pid": os.getpid(),
            "t_ready": time.monotonic(),
            "device": torch.cuda.get_device_name(DEV),
            **info(),
        }
    )
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
