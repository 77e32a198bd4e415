"""`arbiterTimeout` below what the agent can honour is refused, with the key, the value and the least.

The agent drops a connection whose request it has not read within arbiterTimeout of accepting
it; the shim gives up its connect and send within the same figure (memguard_abi.h
MG_MIN_ARBITER_TIMEOUT_MS, mg_arbiter.c). With `arbiterTimeout: 0s` the agent dropped any
request not read by its loop's next turn, with no reply, while the shim read 0 as 2 s: the two
did not mean the same timeout, and bursts were refused at random. Now the node config refuses
less than 100 ms (gpufrac.core.config), the agent writes no less into any container's config
(abi.ConfigFile), and the shim reads a smaller value as the least, as the agent would.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gpufrac.core.config import load
from gpufrac.memguard import abi

pytestmark = pytest.mark.security

GiB = 1 << 30


@pytest.mark.parametrize(("value", "said"), [("0s", "0s"), ("50ms", "0.05s")])
def test_the_agent_refuses_to_start_with_an_arbiter_timeout_it_cannot_honour(
    tmp_path: Path, value: str, said: str
) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(f"nodeName: n\narbiterTimeout: {value}\n")
    out = subprocess.run(
        [sys.executable, "-m", "gpufrac.agent.cli.commands", "agent", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out
    # The key, the value, the least allowed; nothing started.
    assert f"arbiterTimeout: {said} is less than the least the agent can honour, 100ms" in out.stderr
    assert "agent ready" not in out.stderr + out.stdout
    assert load(overrides={"nodeName": "n", "arbiterTimeout": "100ms"}).arbiter_timeout == 0.1


def test_no_container_config_is_written_with_less(tmp_path: Path) -> None:
    f = abi.ConfigFile(tmp_path)
    try:
        cfg = abi.ContainerConfig(gpu_uuid="GPU-x", request_bytes=GiB, limit_bytes=GiB, arbiter_timeout_ms=0)
        with pytest.raises(abi.FormatError, match="arbiter_timeout_ms: 0 does not fit"):
            f.write(cfg)
        cfg.arbiter_timeout_ms = abi.MIN_ARBITER_TIMEOUT_MS
        f.write(cfg)
        assert abi.read_config(tmp_path).arbiter_timeout_ms == 100
    finally:
        f.close()
