"""`gpufrac memguard inspect`: what an operator sees for one container's files."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from gpufrac.agent.cli.commands import main
from gpufrac.memguard import abi
from gpufrac.memguard.inspector import inspect_dir

pytestmark = pytest.mark.unit

GiB = 1 << 30


@pytest.fixture
def cdir(tmp_path: Path) -> Path:
    f = abi.ConfigFile(tmp_path)
    f.write(
        abi.ContainerConfig(
            gpu_uuid="GPU-1234",
            request_bytes=8 * GiB,
            limit_bytes=24 * GiB,
            grant_bytes=4 * GiB,
            flags=abi.FLAG_POD_KNOWN | abi.FLAG_SWAPPABLE,
            workload_class=abi.CLASS_INTERACTIVE,
            priority=100,
            namespace="ml",
            pod="trainer-0",
            container="main",
        )
    )
    f.close()
    abi.create_usage(tmp_path)
    u = abi.UsageFile(tmp_path)
    slots = u.usage.slots
    slots[0].pid, slots[0].used_bytes, slots[0].peak_bytes, slots[0].launches = 41, 6 * GiB, 7 * GiB, 12
    slots[0].last_activity_ns = time.monotonic_ns() - 5_000_000_000
    slots[3].pid, slots[3].used_bytes, slots[3].oom_refusals, slots[3].swapped = 77, 3 * GiB, 2, 1
    u.usage.total_used = 9 * GiB
    del slots  # views into the mapping must go before it closes
    u.close()
    return tmp_path


def test_inspect_reports_limits_and_every_process(cdir: Path) -> None:
    d = inspect_dir(cdir)
    assert (d["request_bytes"], d["limit_bytes"], d["grant_bytes"]) == (8 * GiB, 24 * GiB, 4 * GiB)
    assert d["generation"] == 1
    assert d["flags"] == ["pod-known", "swappable"]
    assert d["workload_class"] == "interactive"
    assert d["total_used_bytes"] == 9 * GiB
    procs = {p["pid"]: p for p in d["processes"]}
    assert set(procs) == {41, 77}
    assert procs[41]["used_bytes"] == 6 * GiB and procs[41]["launches"] == 12
    assert 4.0 < procs[41]["idle_seconds"] < 60
    assert procs[77]["swapped"] and procs[77]["oom_refusals"] == 2
    assert procs[77]["idle_seconds"] is None  # never launched anything


def test_cli_text_and_json(cdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["memguard", "inspect", str(cdir)]) == 0
    text = capsys.readouterr().out
    assert "ml/trainer-0/main" in text
    assert "limit      24Gi" in text and "grant      4Gi" in text and "total      9Gi used" in text
    rows = {ln.split()[0]: ln.split() for ln in text.splitlines()[-2:]}
    assert rows["41"][1:4] == ["6Gi", "7Gi", "12"] and rows["77"][-1] == "yes"
    assert main(["memguard", "inspect", str(cdir), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["limit_bytes"] == 24 * GiB


def test_cli_names_the_bad_file(cdir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    os.truncate(cdir / abi.USAGE_FILE, 10)
    assert main(["memguard", "inspect", str(cdir)]) == 0
    assert "usage      UNREADABLE" in capsys.readouterr().out
    missing = tmp_path / "nope"
    assert main(["memguard", "inspect", str(missing)]) == 1
    assert str(missing) in capsys.readouterr().err
    (cdir / abi.CONFIG_FILE).write_bytes(b"junk")
    assert main(["memguard", "inspect", str(cdir)]) == 1
    err = capsys.readouterr().err
    assert str(cdir / abi.CONFIG_FILE) in err and "truncated" in err


def test_config_write_after_an_agent_died_mid_write_stays_consistent(tmp_path: Path) -> None:
    """An agent killed between the two seqlock bumps leaves seq odd; the next agent's
    write must end even (readers see it) and never publish a torn config as consistent."""
    cfg = abi.ConfigFile(tmp_path)
    cfg.write(abi.ContainerConfig(gpu_uuid="GPU-a", request_bytes=1 << 30, limit_bytes=2 << 30))
    cfg._s.seq += 1  # the dead agent's half-done write
    assert cfg._s.seq % 2 == 1
    cfg.write(abi.ContainerConfig(gpu_uuid="GPU-a", request_bytes=1 << 30, limit_bytes=3 << 30))
    assert cfg._s.seq % 2 == 0
    assert abi.read_config(tmp_path).limit_bytes == 3 << 30
