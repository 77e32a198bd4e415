"""Fault injection on a simulated GPU node: XIDs, a GPU falling off the bus, and
fixed utilisation.

Everything goes through the node-state file, so every process on the node (the
agent's NVML, workloads' libcuda) sees the fault at once. Events are posted
through the fake libnvidia-ml.so.1's `simgpu_post_event`, which uses the same
atomic sequence counter as the C side; single-word flags are plain aligned stores.
"""

from __future__ import annotations

import ctypes
import os
from functools import lru_cache

from gpufrac.core import native
from gpufrac.simgpu.nodestate import NVML_EVENT_XID_CRITICAL, NodeState

XID_FELL_OFF_BUS = 79  # "GPU has fallen off the bus"


class FaultError(ValueError):
    """A fault names a GPU the node does not have, or a bad value."""


@lru_cache(maxsize=1)
def _hooks() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(native.library(native.FAKE_NVML)))
    lib.simgpu_post_event.argtypes = [ctypes.c_void_p, ctypes.c_uint, ctypes.c_ulonglong, ctypes.c_ulonglong]
    lib.simgpu_post_event.restype = ctypes.c_int
    return lib


def _gpu_index(st: NodeState, gpu_index: int) -> int:
    count = st.node.gpu_count
    if isinstance(gpu_index, bool) or not isinstance(gpu_index, int) or not 0 <= gpu_index < count:
        raise FaultError(f"gpu {gpu_index!r}: the node {st.path} has GPUs 0..{st.node.gpu_count - 1}")
    return gpu_index


def _post(st: NodeState, gpu: int, event_type: int, data: int) -> None:
    if _hooks().simgpu_post_event(ctypes.addressof(st.node), gpu, event_type, data) != 0:
        raise FaultError(f"could not post event to GPU {gpu} of {st.path}")


def inject_xid(state_path: str | os.PathLike[str], gpu_index: int, xid: int = XID_FELL_OFF_BUS) -> int:
    """Post an XID critical-error event on a GPU; returns its sequence number."""
    if isinstance(xid, bool) or not isinstance(xid, int) or not 0 < xid < 1 << 32:
        raise FaultError(f"xid {xid!r} is not a positive XID number")
    with NodeState(state_path) as st:
        gpu = _gpu_index(st, gpu_index)
        _post(st, gpu, NVML_EVENT_XID_CRITICAL, xid)
        return int(st.node.gpus[gpu].event_seq)


def fall_off_bus(state_path: str | os.PathLike[str], gpu_index: int) -> None:
    """The GPU falls off the bus: XID 79 is posted, then every NVML call on it
    answers NVML_ERROR_GPU_IS_LOST until restore_gpu."""
    with NodeState(state_path) as st:
        gpu = _gpu_index(st, gpu_index)
        _post(st, gpu, NVML_EVENT_XID_CRITICAL, XID_FELL_OFF_BUS)
        st.node.gpus[gpu].lost = 1


def restore_gpu(state_path: str | os.PathLike[str], gpu_index: int) -> None:
    """The GPU is back (reset / reseated): clears the lost flag."""
    with NodeState(state_path) as st:
        st.node.gpus[_gpu_index(st, gpu_index)].lost = 0


def set_utilisation(
    state_path: str | os.PathLike[str], gpu_index: int, gpu: int | None = None, memory: int | None = None
) -> None:
    """Pin what nvmlDeviceGetUtilizationRates reports (percent); None goes back to
    deriving it from the kernel activity the fake libcuda records."""
    for name, v in (("gpu", gpu), ("memory", memory)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 100):
            raise FaultError(f"{name} utilisation {v!r} is not a percentage 0..100")
    with NodeState(state_path) as st:
        i = _gpu_index(st, gpu_index)
        st.node.gpus[i].util_gpu_override = 0 if gpu is None else gpu + 1
        st.node.gpus[i].util_mem_override = 0 if memory is None else memory + 1
