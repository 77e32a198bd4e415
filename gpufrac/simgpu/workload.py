"""A GPU workload for the simulated node: a real CUDA program (cuda-python over the fake
libcuda, under the memguard shim when LD_PRELOAD says so), driven line by line on stdin.

    python -m gpufrac.simgpu.workload

Commands, one per line; each answers exactly one line:

    alloc N [V]   cuMemAlloc N bytes, fill their first FILL_WINDOW bytes with the u32 value V
                  (default 1) on the GPU
                  -> "ok <id>" or "oom" (CUDA_ERROR_OUT_OF_MEMORY) or "error <name>"
    free ID       cuMemFree buffer ID                      -> "ok"
    check ID      check_u32 kernel: do the buffer's bytes still hold their value?
                  -> "ok" or "corrupt <mismatches>"
    read ID       cuMemcpyDtoH of the buffer's first u32, nothing launched -> "value <V>"
    sync          cuCtxSynchronize alone                   -> "ok"
    busy US       launch the busy kernel for US microseconds and synchronize -> "ok"
    info          cuMemGetInfo as the app sees it          -> "free <bytes> total <bytes>"
    pool N        leave N bytes idle in the device's default memory pool: its release threshold
                  raised to the maximum (as PyTorch's and RAPIDS' pools do), cuMemAllocAsync N,
                  cuMemFreeAsync, cuStreamSynchronize      -> "ok"
    palloc N      cuMemAllocAsync N bytes on the NULL stream, nothing else -> "ok <id>" or "oom"
    vmm N         cuMemCreate N bytes, cuMemAddressReserve, cuMemMap, cuMemSetAccess (read-write)
                  -> "ok <id>" or "oom"
    vfree ID      cuMemUnmap then cuMemRelease (PyTorch expandable segments' order), then
                  cuMemAddressFree of mapping ID            -> "ok"
    nvml          nvmlDeviceGetMemoryInfo of device 0 as the app sees it, v1 then v2
                  -> "total <b> free <b> used <b> v2 total <b> free <b> used <b> reserved <b>"
    resolve F VIA find driver function F (one of ENTRY_POINTS) the way VIA says: `proc`
                  (cuGetProcAddress_v2, as cudart and cuda-python find every function), `dlsym`
                  (on the libcuda.so.1 handle, as ctypes does) or `export` (the name in the
                  global scope, what a program linked against libcuda binds to)
                  -> "ok <library the function lies in>"
    call F VIA    call it once (resolved before), nothing else -> "ok" or "error <CUresult>"
    exit          free everything and exit                 -> "bye"

It prints "ready" once CUDA is initialised; from then on it holds RESULT_BYTES of device memory
(check_u32's result) besides its buffers. Tests and the demo use it through
WorkloadProcess (below) so every scenario runs the same real driver calls.
"""

from __future__ import annotations

import contextlib
import ctypes
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from queue import Empty, Queue
from typing import Any

MODULE_IMAGE = b"SIMGPU-MODULE"  # the fake driver's built-in module (docs/simgpu.md)
# Simulated device memory is host RAM, mapped lazily: writing all of a 16 GiB buffer would
# take 16 GiB of this machine's memory. Kernels touch a window at the start instead.
FILL_WINDOW = 16 << 20
RESULT_BYTES = 8  # allocated at start-up: check_u32 writes its mismatch count there


def _serve() -> int:
    from cuda.bindings import driver as cu

    def chk(result: Any) -> Any:
        err, *rest = result if isinstance(result, tuple) else (result,)
        if int(err) != 0:
            raise RuntimeError(cu.cuGetErrorName(err)[1].decode())
        return rest[0] if len(rest) == 1 else rest

    chk(cu.cuInit(0))
    dev = chk(cu.cuDeviceGet(0))
    ctx = chk(cu.cuDevicePrimaryCtxRetain(dev))
    chk(cu.cuCtxSetCurrent(ctx))
    mod = chk(cu.cuModuleLoadData(MODULE_IMAGE))
    fill, check, busy = (chk(cu.cuModuleGetFunction(mod, k)) for k in (b"fill_u32", b"check_u32", b"busy_us"))
    result = chk(cu.cuMemAlloc(RESULT_BYTES))
    u64, u32 = ctypes.c_uint64, ctypes.c_uint32
    buffers: dict[int, tuple[Any, int, int]] = {}  # id -> (device ptr, bytes, value)
    mappings: dict[int, tuple[Any, int, Any]] = {}  # id -> (reserved address, bytes, VMM handle)
    entries: dict[tuple[str, str], int] = {}  # (function, how it was found) -> its address

    def launch(func: Any, *args: Any) -> None:
        values = tuple(a for a, _ in args)
        types = tuple(t for _, t in args)
        chk(cu.cuLaunchKernel(func, 1, 1, 1, 1, 1, 1, 0, 0, (values, types), 0))
        chk(cu.cuCtxSynchronize())

    print("ready", flush=True)
    next_id = 0
    for line in sys.stdin:
        cmd, *a = line.split() or [""]
        try:
            if cmd == "alloc":
                n, v = int(a[0]), int(a[1]) if len(a) > 1 else 1
                err, ptr = cu.cuMemAlloc(n)
                if err == cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY:
                    print("oom", flush=True)
                    continue
                chk((err,))
                launch(fill, (int(ptr), u64), (min(n, FILL_WINDOW) // 4, u64), (v, u32))
                next_id += 1
                buffers[next_id] = (ptr, n, v)
                print(f"ok {next_id}", flush=True)
            elif cmd == "free":
                ptr, _, _ = buffers.pop(int(a[0]))
                chk(cu.cuMemFree(ptr))
                print("ok", flush=True)
            elif cmd == "check":
                ptr, n, v = buffers[int(a[0])]
                launch(check, (int(ptr), u64), (min(n, FILL_WINDOW) // 4, u64), (v, u32), (int(result), u64))
                out = (ctypes.c_uint64 * 1)()
                chk(cu.cuMemcpyDtoH(out, result, RESULT_BYTES))
                print("ok" if out[0] == 0 else f"corrupt {out[0]}", flush=True)
            elif cmd == "read":
                ptr, _, _ = buffers[int(a[0])]
                word = (ctypes.c_uint32 * 1)()
                chk(cu.cuMemcpyDtoH(word, ptr, 4))
                print(f"value {word[0]}", flush=True)
            elif cmd == "sync":
                chk(cu.cuCtxSynchronize())
                print("ok", flush=True)
            elif cmd == "busy":
                launch(busy, (int(a[0]), u64))
                print("ok", flush=True)
            elif cmd == "info":
                free, total = chk(cu.cuMemGetInfo())
                print(f"free {free} total {total}", flush=True)
            elif cmd == "nvml":
                print(_nvml_memory(), flush=True)
            elif cmd == "resolve":
                entries[(a[0], a[1])] = _resolve(a[0], a[1])
                print(f"ok {_library_of(entries[(a[0], a[1])])}", flush=True)
            elif cmd == "call":
                rc = _call(entries[(a[0], a[1])], a[0], ctx, mod, result)
                print("ok" if rc == 0 else f"error {rc}", flush=True)
            elif cmd == "pool":
                _leave_idle_in_pool(cu, chk, dev, int(a[0]))
                print("ok", flush=True)
            elif cmd == "palloc":
                n = int(a[0])
                err, ptr = cu.cuMemAllocAsync(n, 0)
                if err == cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY:
                    print("oom", flush=True)
                    continue
                chk((err,))
                next_id += 1
                buffers[next_id] = (ptr, n, 0)
                print(f"ok {next_id}", flush=True)
            elif cmd == "vmm":
                mapping = _vmm_map(cu, chk, int(dev), int(a[0]))
                if mapping is None:
                    print("oom", flush=True)
                    continue
                next_id += 1
                mappings[next_id] = mapping
                print(f"ok {next_id}", flush=True)
            elif cmd == "vfree":
                _vmm_unmap(cu, chk, *mappings.pop(int(a[0])))
                print("ok", flush=True)
            elif cmd == "exit":
                for ptr, _, _ in buffers.values():
                    chk(cu.cuMemFree(ptr))
                for mapping in mappings.values():
                    _vmm_unmap(cu, chk, *mapping)
                print("bye", flush=True)
                return 0
            else:
                print(f"error unknown command {cmd!r}", flush=True)
        except (RuntimeError, KeyError, IndexError, ValueError) as e:
            print(f"error {e}", flush=True)
    return 0


def _leave_idle_in_pool(cu: Any, chk: Any, dev: Any, n: int) -> None:
    """N bytes reserved and idle in the device's default pool, kept across synchronizes."""
    pool = chk(cu.cuDeviceGetMemPool(dev))
    never = cu.cuuint64_t(0xFFFFFFFFFFFFFFFF)
    chk(cu.cuMemPoolSetAttribute(pool, cu.CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, never))
    ptr = chk(cu.cuMemAllocAsync(n, 0))
    chk(cu.cuMemFreeAsync(ptr, 0))
    chk(cu.cuStreamSynchronize(0))


def _vmm_map(cu: Any, chk: Any, dev: int, n: int) -> tuple[Any, int, Any] | None:
    """N bytes of physical memory (cuMemCreate) mapped read-write at a reserved address;
    None if the allocation is refused for lack of memory."""
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = dev
    err, handle = cu.cuMemCreate(n, prop, 0)
    if err == cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY:
        return None
    chk((err,))
    addr = chk(cu.cuMemAddressReserve(n, 0, 0, 0))
    chk(cu.cuMemMap(addr, n, 0, handle, 0))
    access = cu.CUmemAccessDesc()
    access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    access.location.id = dev
    access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    chk(cu.cuMemSetAccess(addr, n, [access], 1))
    return addr, n, handle


def _vmm_unmap(cu: Any, chk: Any, addr: Any, n: int, handle: Any) -> None:
    chk(cu.cuMemUnmap(addr, n))
    chk(cu.cuMemRelease(handle))
    chk(cu.cuMemAddressFree(addr, n))


# Driver entry points the memguard shim does not hook (only its gate stands before them), and
# the argument types `call` passes them; every one returns a CUresult.
_P, _U, _I, _S, _U64 = ctypes.c_void_p, ctypes.c_uint, ctypes.c_int, ctypes.c_size_t, ctypes.c_uint64
ENTRY_POINTS: dict[str, tuple[Any, ...]] = {
    "cuStreamCreate": (ctypes.POINTER(_P), _U),
    "cuEventCreate": (ctypes.POINTER(_P), _U),
    "cuCtxSetCurrent": (_P,),
    "cuMemHostAlloc": (ctypes.POINTER(_P), _S, _U),
    "cuModuleGetFunction": (ctypes.POINTER(_P), _P, ctypes.c_char_p),
    "cuPointerGetAttribute": (_P, _I, _U64),
    "cuPointerGetAttributes": (_U, ctypes.POINTER(_I), ctypes.POINTER(_P), _U64),
}
_MEMORY_TYPE = 2  # CU_POINTER_ATTRIBUTE_MEMORY_TYPE


def _resolve(name: str, via: str) -> int:
    """The address of driver function `name` as a program finds it `via` (see `resolve`)."""
    if name not in ENTRY_POINTS:
        raise ValueError(f"not an entry point of this workload: {name}")
    if via == "proc":
        gpa = ctypes.CDLL("libcuda.so.1").cuGetProcAddress_v2
        gpa.argtypes = [ctypes.c_char_p, ctypes.POINTER(_P), _I, _U64, ctypes.POINTER(_I)]
        fn, status = _P(), _I()
        rc = gpa(name.encode(), ctypes.byref(fn), 12080, 0, ctypes.byref(status))
        if rc != 0 or not fn.value:
            raise RuntimeError(f"cuGetProcAddress_v2({name}) = {rc}")
        return int(fn.value)
    if via == "dlsym":
        lib = ctypes.CDLL("libcuda.so.1")
    elif via == "export":
        ctypes.CDLL("libcuda.so.1", mode=ctypes.RTLD_GLOBAL)  # as a linked program has it
        lib = ctypes.CDLL(None)
    else:
        raise ValueError(f"unknown way to find a function: {via}")
    return int(ctypes.cast(getattr(lib, name), _P).value or 0)


def _library_of(addr: int) -> str:
    class DlInfo(ctypes.Structure):
        _fields_ = [("fname", ctypes.c_char_p), ("fbase", _P), ("sname", ctypes.c_char_p), ("saddr", _P)]

    libc = ctypes.CDLL(None)
    libc.dladdr.argtypes = [_P, ctypes.POINTER(DlInfo)]
    info = DlInfo()
    if not addr or not libc.dladdr(addr, ctypes.byref(info)) or not info.fname:
        return "-"
    return str(info.fname.decode()).rsplit("/", 1)[-1]


def _call(addr: int, name: str, ctx: Any, mod: Any, buf: Any) -> int:
    """One call of entry point `name` at `addr`, with arguments that make it succeed."""
    fn = ctypes.CFUNCTYPE(_I, *ENTRY_POINTS[name])(addr)
    out, kind = _P(), _U()
    if name in ("cuStreamCreate", "cuEventCreate"):
        return int(fn(ctypes.byref(out), 0))
    if name == "cuCtxSetCurrent":
        return int(fn(int(ctx)))
    if name == "cuMemHostAlloc":
        return int(fn(ctypes.byref(out), 4096, 0))
    if name == "cuModuleGetFunction":
        return int(fn(ctypes.byref(out), int(mod), b"busy_us"))
    if name == "cuPointerGetAttribute":
        rc = int(fn(ctypes.addressof(kind), _MEMORY_TYPE, int(buf)))
    else:
        data = (_P * 1)(ctypes.addressof(kind))
        rc = int(fn(1, (_I * 1)(_MEMORY_TYPE), data, int(buf)))
    return rc if rc != 0 or kind.value == 2 else -1  # device memory, or this call misread it


def _nvml_memory() -> str:
    import pynvml  # loaded on demand: only this command needs NVML

    try:
        pynvml.nvmlInit()
        try:
            h = pynvml.nvmlDeviceGetHandleByIndex(0)
            m1 = pynvml.nvmlDeviceGetMemoryInfo(h)
            m2 = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
        finally:
            pynvml.nvmlShutdown()
    except pynvml.NVMLError as e:
        return f"error {e}"
    return (
        f"total {m1.total} free {m1.free} used {m1.used} "
        f"v2 total {m2.total} free {m2.free} used {m2.used} reserved {m2.reserved}"
    )


class WorkloadProcess:
    """Drives a running `python -m gpufrac.simgpu.workload` over its stdin/stdout."""

    def __init__(self, proc: subprocess.Popen[bytes], name: str = "workload", timeout: float = 60.0) -> None:
        self.proc = proc
        self.name = name
        self._lines: Queue[str] = Queue()
        assert proc.stdout is not None
        threading.Thread(target=self._read, args=(proc.stdout,), daemon=True).start()
        first = self.line(timeout)
        if first != "ready":
            raise RuntimeError(f"{name}: the workload did not start (said {first!r})")

    @staticmethod
    def argv() -> list[str]:
        return [sys.executable, "-m", "gpufrac.simgpu.workload"]

    @classmethod
    def spawn(cls, env: Mapping[str, str], name: str = "workload", timeout: float = 60.0) -> WorkloadProcess:
        """Start one as a plain subprocess (no container runtime) with `env`."""
        proc = subprocess.Popen(cls.argv(), env=dict(env), stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        return cls(proc, name, timeout)

    def _read(self, pipe: Any) -> None:
        for raw in pipe:
            self._lines.put(raw.decode(errors="replace").strip())
        self._lines.put("<exited>")

    def line(self, timeout: float = 60.0) -> str:
        try:
            return self._lines.get(timeout=timeout)
        except Empty:
            raise TimeoutError(f"{self.name}: no answer within {timeout:.0f}s") from None

    def send(self, cmd: str) -> None:
        """Send a command without waiting for its answer (read it later with line())."""
        assert self.proc.stdin is not None
        self.proc.stdin.write((cmd + "\n").encode())
        self.proc.stdin.flush()

    def do(self, cmd: str, timeout: float = 60.0) -> str:
        """Send a command and read its answer; "<exited>" once the process has exited (also when
        it was killed before the command reached it: the watchdog may kill it at any time)."""
        with contextlib.suppress(BrokenPipeError):  # gone: its reader answers "<exited>" after its last line
            self.send(cmd)
        return self.line(timeout)

    def do_all(self, cmds: Sequence[str], timeout: float = 60.0) -> list[str]:
        return [self.do(c, timeout) for c in cmds]

    def close(self, timeout: float = 10.0) -> None:
        if self.proc.poll() is None:
            try:
                self.do("exit", timeout)
                self.proc.wait(timeout)
            except (TimeoutError, BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(timeout)


if __name__ == "__main__":
    raise SystemExit(_serve())
