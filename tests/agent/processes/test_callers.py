"""Caller identity from cgroup paths: every layout the kubelet's runtimes produce, and the
ones that must not be taken for a container."""

from __future__ import annotations

import uuid

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpufrac.agent.processes.callers import PeerError, parse_cgroup, parse_cgroup_path
from gpufrac.simgpu.runtime import QOS_CLASSES, cgroup_relpath

pytestmark = pytest.mark.unit

UID = "0f1e2d3c-4b5a-6978-8877-665544332211"
CID = "4f" * 32


@pytest.mark.parametrize(
    "path",
    [
        f"/kubepods/besteffort/pod{UID}/{CID}",
        f"/kubepods/burstable/pod{UID}/{CID}",
        f"/kubepods/pod{UID}/{CID}",  # guaranteed
        f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID.replace('-', '_')}.slice/"
        f"cri-containerd-{CID}.scope",
        f"/kubepods.slice/kubepods-pod{UID.replace('-', '_')}.slice/crio-{CID}.scope",
        f"/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID.replace('-', '_')}.slice/"
        f"docker-{CID}.scope",
        # kind / nested: the kubelet's hierarchy below another one
        f"/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/x/pod{UID}/{CID}",
    ],
)
def test_kubelet_layouts_name_pod_and_container(path: str) -> None:
    ident = parse_cgroup_path(path)
    assert ident is not None and (ident.pod_uid, ident.container_id) == (UID, CID)


@pytest.mark.parametrize(
    "path",
    [
        "/",
        "/user.slice/user-0.slice/session-1.scope",
        f"/docker/{CID}",  # a container, but not a kubelet pod's
        f"/kubepods/besteffort/pod{UID}",  # the pod's own cgroup (sandbox-less process)
        f"/kubepods.slice/kubepods-pod{UID.replace('-', '_')}.slice/crio-conmon-{CID}.scope",  # CRI-O monitor
        f"/kubepods/besteffort/pod{UID}/{CID[:63]}",  # truncated container ID
        f"/kubepods/besteffort/podnot-a-uid/{CID}",
    ],
)
def test_other_cgroups_are_no_container(path: str) -> None:
    assert parse_cgroup_path(path) is None


def test_v1_and_v2_lines_and_disagreement() -> None:
    v1 = f"12:pids:/kubepods/besteffort/pod{UID}/{CID}\n4:memory:/process_api/abc\n0::/\n"
    ident = parse_cgroup(v1)
    assert ident is not None and (ident.pod_uid, ident.container_id) == (UID, CID)
    v2 = f"0::/kubepods.slice/kubepods-pod{UID.replace('-', '_')}.slice/cri-containerd-{CID}.scope\n"
    ident = parse_cgroup(v2)
    assert ident is not None and (ident.pod_uid, ident.container_id) == (UID, CID)
    # Hierarchies naming different containers: the process is not trusted at all.
    other = "ab" * 32
    with pytest.raises(PeerError, match="different containers"):
        parse_cgroup(v1 + f"3:cpu:/kubepods/besteffort/pod{UID}/{other}\n")
    assert parse_cgroup("garbage\n\n1:cpu\n") is None


@given(st.uuids(), st.binary(min_size=32, max_size=32), st.sampled_from(QOS_CLASSES),
       st.sampled_from(["cgroupfs", "systemd"]))  # fmt: skip
def test_runtime_emulator_paths_parse_back(u: uuid.UUID, raw: bytes, qos: str, driver: str) -> None:
    cid = raw.hex()
    ident = parse_cgroup_path("/" + cgroup_relpath(str(u), cid, qos, driver))
    assert ident is not None and (ident.pod_uid, ident.container_id) == (str(u), cid)
