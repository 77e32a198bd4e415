"""The lowest versions of gpufrac's runtime dependencies that pyproject.toml allows, put to work.

    python tests/dependency_floors.py pins        # requirement lines: every `name>=X` as `name==X`
    python tests/dependency_floors.py import-all  # import every gpufrac module (run in the floors venv)
    python tests/dependency_floors.py smoke       # a simulated node, the real agent registering with
                                                  # the kubelet emulator, a pod allocated, a CUDA
                                                  # workload allocating under it (floors venv)

`make floors` builds build/floors-venv from `pins` (direct dependencies at their floors, their own
dependencies at whatever pip picks: what `uv --resolution lowest-direct` would do), once per
pyproject.toml; tests/integration/test_dependency_floors.py runs the other two in it. A floor that
does not work (a generated protobuf module newer than the protobuf floor, say) fails CI there.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import pkgutil
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# Modules that need the development extra by design, and what they import from it: the
# apiserver emulator is built on kmock (and its attrs).
DEV_ONLY = {"gpufrac.simgpu.apiserver": {"kmock", "attrs"}}


def pins(pyproject: Path = REPO / "pyproject.toml") -> list[str]:
    import tomllib

    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    out = []
    for dep in deps:
        req, _, marker = dep.partition(";")
        m = re.fullmatch(r"\s*([A-Za-z0-9._-]+)\s*>=\s*([0-9][0-9a-zA-Z.]*)\s*(,\s*<[^,]+)?\s*", req)
        if m is None:
            raise SystemExit(f"pyproject.toml: dependency {dep!r} has no `>=` floor to test")
        out.append(f"{m.group(1)}=={m.group(2)}" + (f"; {marker.strip()}" if marker else ""))
    return out


def import_all() -> None:
    import gpufrac

    failed = []
    names = [m.name for m in pkgutil.walk_packages(gpufrac.__path__, "gpufrac.")]
    for name in names:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name not in DEV_ONLY.get(name, ()):
                failed.append(f"{name}: {e!r}")
        except Exception as e:
            failed.append(f"{name}: {e!r}")
    if failed:
        raise SystemExit("modules that do not import at the dependency floors:\n" + "\n".join(failed))
    print(f"imported {len(names) - len(DEV_ONLY)} modules")


def smoke() -> None:
    import shutil
    import tempfile

    from gpufrac.core.native import native_dir
    from gpufrac.core.slices import MEMORY
    from gpufrac.simgpu.kubelet import AgentProcess, Container, KubeletEmulator, Pod
    from gpufrac.simgpu.spec import create_node, load_preset
    from gpufrac.simgpu.workload import WorkloadProcess

    root = Path(tempfile.mkdtemp(prefix="gff", dir="/tmp"))  # short: unix socket paths
    kubelet = agent = None
    try:
        state = root / "node.state"
        create_node(load_preset("pcie-l4x4"), state)
        kubelet = KubeletEmulator(root / "kubelet").start()
        agent = AgentProcess(root / "agent", state, root / "kubelet", None).start()
        with contextlib.suppress(TimeoutError):  # judged just below, with the agent's log
            kubelet.wait_for(lambda: kubelet.connected(MEMORY) or agent.proc.poll() is not None, 60)
        if not kubelet.connected(MEMORY):
            raise SystemExit(f"the agent never registered; its log:\n{agent.log()[-4000:]}")
        pod = Pod("default", "floor", [Container("main", {MEMORY: 2})])
        kubelet.admit(pod)
        # The GPU the agent's Allocate chose, as the container runtime would expose it.
        gpu = kubelet.container_env(pod.uid, "main")["NVIDIA_VISIBLE_DEVICES"]
        env = {**os.environ, "SIMGPU_STATE": str(state), "LD_LIBRARY_PATH": str(native_dir())}
        w = WorkloadProcess.spawn({**env, "NVIDIA_VISIBLE_DEVICES": gpu})
        try:
            reply = w.do(f"alloc {1 << 20}")
            if not reply.startswith("ok "):
                raise SystemExit(f"the CUDA workload could not allocate: {reply}")
        finally:
            w.close()
        print(f"agent registered; pod admitted on {gpu}; a CUDA workload allocated on it")
    finally:
        if agent is not None:
            agent.stop()
        if kubelet is not None:
            kubelet.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else ""
    if what == "pins":
        print("\n".join(pins()))
    elif what == "import-all":
        import_all()
    elif what == "smoke":
        smoke()
    else:
        raise SystemExit(__doc__)
