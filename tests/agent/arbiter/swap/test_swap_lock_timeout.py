"""swap.lockTimeout goes to the driver's cuCheckpointProcessLock as a u32 of milliseconds,
in which 0 means no timeout: a value the field cannot hold, or one that rounds to 0, is
refused rather than wrapped (a swap-out would then wait on a busy victim for ever)."""

from __future__ import annotations

import pytest

from gpufrac.agent.arbiter.swap.checkpoint import Checkpointer, CheckpointError
from gpufrac.core.config import ConfigError, load

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("value", ["0s", "0.4ms", "1200h", "-1s"])
def test_a_lock_timeout_the_drivers_field_cannot_hold_is_refused(value: str) -> None:
    with pytest.raises(ConfigError, match=r"swap\.lockTimeout"):
        load(overrides={"nodeName": "n", "swap": {"lockTimeout": value}})


@pytest.mark.parametrize(("value", "seconds"), [("1ms", 0.001), ("10s", 10.0), ("1190h", 1190 * 3600.0)])
def test_a_lock_timeout_within_the_field_is_kept(value: str, seconds: float) -> None:
    assert load(overrides={"nodeName": "n", "swap": {"lockTimeout": value}}).swap.lock_timeout == seconds


@pytest.mark.parametrize("ms", [0, -5, 2**32])
def test_the_checkpointer_refuses_a_lock_timeout_outside_the_field(ms: int) -> None:
    # Refused before the driver is asked: no wrap to a short timeout, no 0 meaning "none".
    with pytest.raises(CheckpointError, match="lock timeout"):
        Checkpointer().lock(1, ms)
