"""The driver's process checkpoint API (cuCheckpointProcess*) through cuda-python.

Swap moves a whole process's GPU memory to host RAM and back at the same
addresses (docs/cuda-facts.md section 1b): swap-out = lock(timeout) + checkpoint,
swap-in = restore + unlock, each call naming the target by its host pid. The
same code drives a real r570+ driver and simgpu's fake libcuda.so.1, both found
by cuda-python through the soname.

Every function here blocks in the driver (a checkpoint copies the process's
memory): the agent calls them through asyncio.to_thread. They keep no state of
their own beyond the driver's init.
"""

from __future__ import annotations

import enum
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

# CUDA 12.8 / driver r570 brought the checkpoint driver API and the lock timeout.
MIN_DRIVER_VERSION = 12080
SYMBOLS = (
    "cuCheckpointProcessGetState",
    "cuCheckpointProcessLock",
    "cuCheckpointProcessCheckpoint",
    "cuCheckpointProcessRestore",
    "cuCheckpointProcessUnlock",
)
CUDA_SUCCESS = 0
MAX_LOCK_TIMEOUT_MS = 2**32 - 1  # CUcheckpointLockArgs.timeoutMs is an unsigned int
# Seconds before an API found unavailable is looked for again, when the agent next needs it
# (arbiter.swap.resolver: a driver still starting must not strand what an earlier agent swapped).
DETECT_RETRY = 10.0
CUDA_ERROR_NOT_FOUND = 500  # the driver holds no CUDA state of that pid (it exited, or never had any)
CUDA_ERROR_NOT_PERMITTED = 800
CUDA_ERROR_NOT_SUPPORTED = 801


class ProcessState(enum.IntEnum):
    """CUprocessState."""

    RUNNING = 0
    LOCKED = 1
    CHECKPOINTED = 2
    FAILED = 3
    CHECKPOINTING = 4
    RESTORING = 5


class CheckpointError(RuntimeError):
    """A checkpoint call failed; the message names the call, the pid and the driver's reason."""

    def __init__(self, message: str, code: int = -1) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Support:
    """Whether this node can swap, and if not, why (said once in the agent's log)."""

    available: bool
    reason: str = ""
    driver_version: int = 0


def _code(result: Any) -> int:
    return int(result[0] if isinstance(result, tuple) else result)


def _error_name(driver: Any, code: int) -> str:
    try:
        err, name = driver.cuGetErrorName(driver.CUresult(code))
        if _code(err) == CUDA_SUCCESS and name:
            return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # an unknown code has no name: the number will do
        pass
    return f"CUresult {code}"


class Checkpointer:
    """Thin, blocking wrapper over cuCheckpointProcess*. Create it once; call detect()
    (in a thread) before anything else."""

    def __init__(self) -> None:
        self._driver: Any = None
        self.support = Support(False, "not detected yet")

    # -- detection ---------------------------------------------------------------------------

    def detect(self) -> Support:
        """Is the checkpoint API usable here? Driver API >= 12.8, the five symbols resolve,
        and GetState on the agent's own pid answers (the feature is not switched off)."""
        self.support = self._detect()
        return self.support

    def _detect(self) -> Support:
        try:
            from cuda.bindings import driver  # cuda-python ships no types
        except ImportError as e:
            return Support(False, f"cuda-python is not installed ({e})")
        try:
            rc = _code(driver.cuInit(0))
        except Exception as e:  # cuda-python raises when libcuda.so.1 cannot be loaded
            return Support(False, f"no CUDA driver (libcuda.so.1): {e}")
        if rc != CUDA_SUCCESS:
            return Support(False, f"cuInit failed: {_error_name(driver, rc)}")
        err, version = driver.cuDriverGetVersion()
        if _code(err) != CUDA_SUCCESS:
            return Support(False, f"cuDriverGetVersion failed: {_error_name(driver, _code(err))}")
        version = int(version)
        if version < MIN_DRIVER_VERSION:
            return Support(
                False,
                f"driver API version {version} is older than {MIN_DRIVER_VERSION} (CUDA 12.8, driver r570)",
                version,
            )
        missing = [s for s in SYMBOLS if not self._resolves(driver, s, version)]
        if missing:
            return Support(False, f"the driver does not export {', '.join(missing)}", version)
        try:
            rc = _code(driver.cuCheckpointProcessGetState(os.getpid()))
        except RuntimeError as e:
            return Support(False, f"cuCheckpointProcessGetState unusable: {e}", version)
        if rc == CUDA_ERROR_NOT_SUPPORTED:
            return Support(False, "the driver says the checkpoint API is not supported here", version)
        if rc == CUDA_ERROR_NOT_PERMITTED:
            return Support(False, "the agent may not checkpoint processes (needs CAP_SYS_PTRACE)", version)
        # Any other answer (a state, or "this process has no CUDA context") means the API works.
        self._driver = driver
        return Support(True, "", version)

    @staticmethod
    def _resolves(driver: Any, symbol: str, version: int) -> bool:
        try:
            r = driver.cuGetProcAddress(symbol.encode(), version, driver.CUdriverProcAddress_flags(0))
        except Exception:
            return False
        return _code(r) == CUDA_SUCCESS and bool(r[1]) and int(r[2]) == 0

    @property
    def available(self) -> bool:
        return self.support.available

    # -- calls ---------------------------------------------------------------------------------

    def _call(self, what: str, pid: int, fn: Callable[..., Any] | None, *args: Any) -> Any:
        if self._driver is None or fn is None:
            raise CheckpointError(f"{what}({pid}): checkpoint API unavailable: {self.support.reason}")
        try:
            r = fn(pid, *args)
        except RuntimeError as e:
            raise CheckpointError(f"{what}({pid}): {e}") from None
        rc = _code(r)
        if rc != CUDA_SUCCESS:
            raise CheckpointError(f"{what}(pid {pid}): {_error_name(self._driver, rc)}", rc)
        return r[1] if isinstance(r, tuple) and len(r) > 1 else None

    def state(self, pid: int) -> ProcessState:
        d = self._driver
        raw = self._call("cuCheckpointProcessGetState", pid, d.cuCheckpointProcessGetState if d else None)
        return ProcessState(int(raw))

    def lock(self, pid: int, timeout_ms: int) -> None:
        """RUNNING -> LOCKED: the target's further CUDA calls block. On timeout it stays RUNNING.
        The driver's timeout is a u32 of milliseconds in which 0 means none: anything outside
        1..2^32-1 is refused here (the node config refuses it first, config.validate)."""
        if not 1 <= int(timeout_ms) <= MAX_LOCK_TIMEOUT_MS:
            raise CheckpointError(
                f"cuCheckpointProcessLock({pid}): lock timeout {timeout_ms} ms is outside "
                f"1..{MAX_LOCK_TIMEOUT_MS}"
            )
        d = self._driver
        args = d.CUcheckpointLockArgs() if d else None
        if args is not None:
            args.timeoutMs = int(timeout_ms)
        self._call("cuCheckpointProcessLock", pid, d.cuCheckpointProcessLock if d else None, args)

    def checkpoint(self, pid: int) -> None:
        """LOCKED -> CHECKPOINTED: device memory copied to host, the GPU released."""
        d = self._driver
        self._call("cuCheckpointProcessCheckpoint", pid, d.cuCheckpointProcessCheckpoint if d else None, None)

    def restore(self, pid: int) -> None:
        """CHECKPOINTED -> LOCKED: memory back on the GPU at the same addresses."""
        d = self._driver
        self._call("cuCheckpointProcessRestore", pid, d.cuCheckpointProcessRestore if d else None, None)

    def unlock(self, pid: int) -> None:
        """LOCKED -> RUNNING."""
        d = self._driver
        self._call("cuCheckpointProcessUnlock", pid, d.cuCheckpointProcessUnlock if d else None, None)

    # -- the two halves of a swap ---------------------------------------------------------------

    def swap_out(self, pids: list[int], lock_timeout_ms: int) -> None:
        """Lock every process, then checkpoint every one (a consistent cut across the
        container's processes). On any failure everything done is undone and the error
        raised: the processes end RUNNING as they were."""
        locked: list[int] = []
        saved: list[int] = []
        try:
            for pid in pids:
                self.lock(pid, lock_timeout_ms)
                locked.append(pid)
            for pid in pids:
                self.checkpoint(pid)
                saved.append(pid)
        except CheckpointError:
            self._undo(locked, saved)
            raise

    def swap_in(self, pids: list[int], gone: Callable[[int], bool] = lambda pid: False) -> list[int]:
        """Restore every process, then unlock every one; the pids brought back. If a restore
        fails (e.g. the GPU filled up meanwhile), the restored ones are checkpointed again so
        the container stays consistently swapped, and the error is raised. A process the
        driver no longer knows (NOT_FOUND) that `gone` says has exited is left out, not an
        error: the driver freed what it held when it exited, and the rest comes back."""
        restored: list[int] = []
        try:
            for pid in pids:
                if self._unless_gone(gone, pid, self._restore_if_checkpointed):
                    restored.append(pid)
        except CheckpointError:
            for pid in restored:
                self._quietly(self.checkpoint, pid)
            raise
        return [pid for pid in restored if self._unless_gone(gone, pid, self._unlock_if_locked)]

    def _restore_if_checkpointed(self, pid: int) -> None:
        if self.state(pid) == ProcessState.CHECKPOINTED:
            self.restore(pid)

    def _unlock_if_locked(self, pid: int) -> None:
        if self.state(pid) == ProcessState.LOCKED:
            self.unlock(pid)

    @staticmethod
    def _unless_gone(gone: Callable[[int], bool], pid: int, step: Callable[[int], None]) -> bool:
        """`step(pid)`; False when the driver answers NOT_FOUND for a process that has exited."""
        try:
            step(pid)
        except CheckpointError as e:
            if e.code == CUDA_ERROR_NOT_FOUND and gone(pid):
                log.info("swap-in: process %d exited while swapped out; the driver freed what it held", pid)
                return False
            raise
        return True

    def _undo(self, locked: list[int], saved: list[int]) -> None:
        for pid in saved:
            self._quietly(self.restore, pid)
        for pid in locked:
            self._quietly(self.unlock, pid)

    @staticmethod
    def _quietly(fn: Callable[[int], None], pid: int) -> None:
        try:
            fn(pid)
        except CheckpointError as e:
            log.error("undoing a partial swap: %s", e)


def process_state(pid: int, checkpointer: Checkpointer) -> ProcessState | None:
    """A process's checkpoint state, or None when it is no CUDA process (or gone)."""
    try:
        return checkpointer.state(pid)
    except CheckpointError:
        return None
