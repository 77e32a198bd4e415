"""The arbiter on a simulated node: real processes in real cgroups ask for bursts on the real
socket; identity comes from SO_PEERCRED -> cgroup -> the pod's status in the apiserver."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpufrac.agent import arbiter as arbiter_mod
from gpufrac.agent.processes.callers import Caller, CgroupIdentity, Credentials
from gpufrac.memguard import abi, wire
from gpufrac.simgpu.nodestate import NodeState
from tests.fixtures.arbiter_harness import NODE, ArbiterNode, GiB, MiB
from tests.fixtures.kube import pod_manifest


@pytest.fixture
def node(make_node: Callable[..., ArbiterNode]) -> ArbiterNode:
    return make_node()


def test_burst_within_limit_is_granted_in_the_config_before_the_reply(node: ArbiterNode) -> None:
    a = node.add("a", 4, "8Gi")
    w = a.workload
    assert w is not None
    assert w.do(f"alloc {4 * GiB}") == "fast"  # the guarantee needs no agent
    assert a.config().grant_bytes == 0
    # The workload checks that the config already carries the grant when the reply comes.
    assert w.do(f"alloc {2 * GiB}") == "granted"
    assert a.config().grant_bytes == 2 * GiB
    assert a.used() == 6 * GiB
    assert node.arbiter.stats.granted == 1


def test_burst_past_the_limit_is_denied(node: ArbiterNode) -> None:
    a = node.add("a", 4, "8Gi")
    w = a.workload
    assert w is not None
    assert w.do(f"alloc {4 * GiB}") == "fast"
    # What the shim would never send; the agent still checks the limit itself.
    assert w.do(f"burst {5 * GiB} {9 * GiB}") == "denied"
    assert a.config().grant_bytes == 0
    # A pod without a limit annotation has limit = request: no burst at all.
    b = node.add("b", 2)
    assert b.workload is not None and b.workload.do(f"burst {GiB} {3 * GiB}") == "denied"
    assert b.config().grant_bytes == 0


def test_grants_stay_within_nvml_free_minus_margin(node: ArbiterNode) -> None:
    # Something outside gpufrac uses most of the GPU: the ledger thinks it is free, NVML knows.
    with NodeState(node.state_path) as st:  # type: ignore[arg-type]
        g = st.node.gpus[0]
        g.used_bytes += g.total_bytes - g.reserved_bytes - g.used_bytes - 6 * GiB  # NVML: 6 GiB free
        del g  # the mapping closes only without live views into it
    a = node.add("a", 2, "40Gi", wait_timeout="0s")  # denials answer at once
    w = a.workload
    assert w is not None
    assert w.do(f"alloc {2 * GiB}") == "fast"
    # 6 GiB physically free, minus the 256 MiB margin: a 6 GiB burst cannot be granted ...
    assert w.do(f"alloc {6 * GiB}") == "denied"
    assert a.config().grant_bytes == 0
    # ... one that fits under free - margin can.
    assert w.do(f"alloc {5 * GiB}") == "granted"
    assert a.config().grant_bytes == 5 * GiB
    assert a.config().grant_bytes <= 6 * GiB - node.cfg.grant_margin


def test_a_process_of_another_container_cannot_act_for_it(node: ArbiterNode) -> None:
    a = node.add("a", 2, "8Gi")
    assert a.container is not None
    forged_env = dict(a.container.env)  # a's socket, a's config dir, a's everything

    # b is a gpufrac pod without burst; its process uses a's environment (a's own socket) and
    # claims a's generation. A request on a's socket from a process the kernel places in b
    # is refused (it could act only for b, never for a): a untouched.
    b = node.add("b", 2, start=False)
    cb = node.runtime.start(
        b.uid, "main", [sys.executable, "-c", PROBE], env=forged_env, stdout=subprocess.PIPE
    )
    node.set_container_id("b", b.uid, cb.runtime_id)
    assert cb.proc.communicate(timeout=60)[0].decode().split() == ["refused"]

    # c holds no gpufrac allocation at all: refused.
    c_uid = node.v1.create_namespaced_pod("default", pod_manifest("c", node=NODE)).metadata.uid
    cc = node.runtime.start(
        c_uid, "main", [sys.executable, "-c", PROBE], env=forged_env, stdout=subprocess.PIPE
    )
    node.set_container_id("c", c_uid, cc.runtime_id)
    assert cc.proc.communicate(timeout=60)[0].decode().split() == ["refused"]

    # A process outside any kubelet container cgroup (this test process): refused.
    rep = wire.request(node.socket, wire.BURST_OP_BURST, GiB, 3 * GiB)
    assert rep is not None and rep.status == wire.BURST_REFUSED

    assert a.config().grant_bytes == 0 and b.config().grant_bytes == 0
    assert node.arbiter.stats.refused == 3


# A process that claims to be container "a" in every field the message has.
PROBE = """
import os
from gpufrac.memguard import abi, wire
d = os.environ["GPUFRAC_CONTAINER_DIR"]
rep = wire.request(wire.socket_path(d), wire.BURST_OP_BURST, 1 << 30, 3 << 30,
                      generation=abi.generation(d), timeout=30)
names = {wire.BURST_REFUSED: "refused", wire.BURST_GRANTED: "granted", wire.BURST_DENIED: "denied"}
print(names.get(rep.status, rep.status) if rep else "none")
"""


def test_socket_survives_garbage_and_answers_afterwards(node: ArbiterNode) -> None:
    a = node.add("a", 2, "8Gi")
    bad = [
        b"",
        b"\x00",
        b"x" * 39,
        b"\xff" * 40,
        bytes(wire.BurstRequest(0xDEADBEEF, 1, 1, 0, 0, 1, 1, 0)),
        bytes(wire.BurstRequest(wire.BURST_MAGIC, 99, 1, 0, 0, 1, 1, 0)),
        bytes(wire.BurstRequest(wire.BURST_MAGIC, 1, 77, 0, 0, 1, 1, 0)),
        os.urandom(4096),
    ]
    for payload in bad:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(30)
            s.connect(node.socket)
            s.sendall(payload)
            s.shutdown(socket.SHUT_WR)
            reply = s.recv(64)
            # Either nothing, or a well-formed refusal; never a grant.
            if reply:
                rep = wire.BurstReply.from_buffer_copy(reply.ljust(16, b"\0"))
                assert rep.magic == wire.BURST_MAGIC and rep.status != wire.BURST_GRANTED
    w = a.workload
    assert w is not None
    assert w.do(f"alloc {2 * GiB}") == "fast"
    assert w.do(f"alloc {GiB}") == "granted"


def test_a_stalled_half_request_is_dropped_and_others_are_answered_meanwhile(node: ArbiterNode) -> None:
    a = node.add("a", 2, "8Gi")
    w = a.workload
    assert w is not None
    dropped = node.arbiter.stats.dropped
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(60)
        s.connect(node.socket)
        s.sendall(b"\x00" * 10)  # a quarter of a request, then silence
        # Meanwhile a real request is served: one stalled peer holds nothing up.
        assert w.do(f"alloc {2 * GiB}") == "fast"
        assert w.do(f"alloc {GiB}") == "granted"
        assert s.recv(64) == b""  # closed by the agent after its read timeout, no reply
    assert node.arbiter.stats.dropped == dropped + 1


def test_release_gives_the_grant_back(node: ArbiterNode) -> None:
    a = node.add("a", 2, "8Gi")
    w = a.workload
    assert w is not None
    assert w.do(f"alloc {2 * GiB}") == "fast"
    assert w.do(f"alloc {3 * GiB}") == "granted"
    assert a.config().grant_bytes == 3 * GiB
    assert w.do(f"free {GiB}") == "granted"  # release op answered
    node.until(lambda: a.config().grant_bytes == 2 * GiB, what="the grant lowered")
    assert w.do(f"free {2 * GiB + 512 * MiB}") == "granted"
    node.until(lambda: a.config().grant_bytes == 0, what="the grant given back")


def test_a_release_right_after_a_grant_leaves_it_to_the_shim_that_got_it(node: ArbiterNode) -> None:
    """The shim charges a granted allocation after the reply. A RELEASE from another of the
    container's processes in between must not take the grant back before that charge shows
    (the shim would fail with OUT_OF_MEMORY after GRANTED); it is lowered once it is due."""
    a = node.add("a", 2, "8Gi")
    assert a.workload is not None and a.workload.do(f"alloc {2 * GiB}") == "fast"

    async def grant_then_release() -> int:
        await node.arbiter.resolution.refresh_memory()  # what a burst request reads first
        assert node.arbiter.resolution.grant(a.alloc, 3 * GiB)  # the GRANTED reply is on its way
        node.arbiter.resolution.release(a.alloc)  # another process frees before that shim charges
        return a.alloc.config.grant_bytes

    assert node.on_loop(grant_then_release) == 3 * GiB
    node.until(lambda: a.config().grant_bytes == 0, what="the unused grant taken back once due")


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    payload=st.one_of(
        st.binary(max_size=200),
        # Well-framed headers with random fields: the parser's edge cases, not just bad magic.
        st.builds(
            lambda v, op, n, t: bytes(wire.BurstRequest(wire.BURST_MAGIC, v, op, 0, 0, n, t, 0)),
            st.integers(0, 0xFFFF),
            st.integers(0, 0xFFFF),
            st.integers(0, 2**64 - 1),
            st.integers(0, 2**64 - 1),
        ),
    ),
    hang_up=st.booleans(),
)
def test_random_bytes_never_crash_or_stall_the_agent(
    fuzz_node: ArbiterNode, payload: bytes, hang_up: bool
) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(fuzz_node.socket)
        s.sendall(payload)
        if not hang_up:  # else: an early disconnect, the reply (if any) goes nowhere
            s.shutdown(socket.SHUT_WR)
            reply = s.recv(64)
            assert len(reply) in (0, wire.REPLY_SIZE)
            if reply:
                assert wire.BurstReply.from_buffer_copy(reply).status != wire.BURST_GRANTED
    # The agent still answers a real request at once (this test process is in no container).
    rep = wire.request(fuzz_node.socket, wire.BURST_OP_BURST, GiB, 2 * GiB, timeout=30)
    assert rep is not None and rep.status == wire.BURST_REFUSED


@pytest.fixture
def fuzz_node(node: ArbiterNode) -> ArbiterNode:
    return node


def test_a_reclaim_without_the_drivers_per_process_count_is_refused(node: ArbiterNode) -> None:
    """A RECLAIM takes memory from others, so it rests on NVML's per-process count: without
    one, a tenant that zeroed its usage counter must not have the file alone vouch for it."""
    a = node.add("a", 4, "8Gi")
    assert a.workload is not None and a.workload.do(f"alloc {2 * GiB}") == "fast"
    assert a.container is not None
    caller = Caller(Credentials(a.container.proc.pid, 0, 0), CgroupIdentity(a.uid, "0" * 64, ""), a.alloc)
    u = abi.UsageFile(a.alloc.directory)
    try:
        u.usage.total_used = 0  # "I hold nothing"
    finally:
        u.close()

    def no_processes() -> list[object]:
        raise RuntimeError("NVML process query failed")

    node.arbiter.readings.read_processes = no_processes  # type: ignore[method-assign]
    out = node.on_loop(lambda: node.arbiter._reclaim(caller, GiB, GiB))
    assert out == (wire.BURST_DENIED, 0)


def test_a_reclaim_without_an_nvml_reading_says_there_was_none(
    node: ArbiterNode, caplog: pytest.LogCaptureFixture
) -> None:
    a = node.add("a", 4, "8Gi")
    assert a.workload is not None and a.workload.do(f"alloc {2 * GiB}") == "fast"
    assert a.container is not None
    caller = Caller(Credentials(a.container.proc.pid, 0, 0), CgroupIdentity(a.uid, "0" * 64, ""), a.alloc)

    def no_reading() -> dict[str, object]:
        raise RuntimeError("NVML is down")

    node.arbiter.readings.read_memory = no_reading
    with caplog.at_level(logging.INFO, logger=arbiter_mod.__name__):
        # The driver refused 1 GiB within a's 4 GiB guarantee (the shim's RECLAIM op).
        out = node.on_loop(lambda: node.arbiter._reclaim(caller, GiB, 3 * GiB))
    assert out == (wire.BURST_DENIED, 0)
    said = [m for m in caplog.messages if "could not reclaim the guarantee" in m]
    assert len(said) == 1 and "no NVML memory reading" in said[0] and "missing" not in said[0], said
