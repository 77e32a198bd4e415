"""simgpu specs: `context_memory`, the device memory each CUDA context takes."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpufrac.simgpu import nodestate as ns
from gpufrac.simgpu.spec import SpecError, create_node, load_preset, load_spec

MiB = 1 << 20


def test_context_memory_reaches_the_node_state(tmp_path: Path) -> None:
    f = tmp_path / "n.yaml"
    f.write_text("preset: dgx-h100\ngpu_defaults: {context_memory: 512Mi}\n")
    spec = load_spec(f)
    assert all(g.context_memory == 512 * MiB for g in spec.gpus)
    with ns.NodeState(create_node(spec, tmp_path / "n.state")) as st:
        assert [g.ctx_mib for g in st.gpus] == [512] * len(spec.gpus)


def test_presets_leave_contexts_free() -> None:
    assert all(g.context_memory == 0 for g in load_preset("dgx-h100").gpus)


@pytest.mark.parametrize("value", ["100Ki", "90Gi", "lots"])
def test_bad_context_memory_names_key_and_value(tmp_path: Path, value: str) -> None:
    f = tmp_path / "bad.yaml"
    f.write_text(f"preset: dgx-h100\ngpu_defaults: {{context_memory: {value}}}\n")
    with pytest.raises(SpecError) as e:
        load_spec(f)
    assert "context_memory" in str(e.value) and value in str(e.value)
