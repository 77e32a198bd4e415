"""What the agent image is built from, and the image name the install uses, checked offline.

* The install's image reference cannot be squatted: the kustomize base points at an
  unresolvable `.invalid` placeholder until the operator names their registry (the chart
  refuses to render without one: test_helm_chart.py).
* The Dockerfile's base images are pinned by digest, and Python packages come only from the
  lock files, installed with --require-hashes.
* The lock files agree with pyproject.toml: every runtime dependency locked at a version its
  range allows, nothing from the cuda-python metapackage, a hash on every pin.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import tomllib
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from gpufrac.core.native import REPO_ROOT

DEPLOY = REPO_ROOT / "deploy" / "daemonset"
DOCKERFILE = DEPLOY / "Dockerfile"
DIGEST = re.compile(r"@sha256:[0-9a-f]{64}$")


def _lock(path: Path) -> dict[str, tuple[str, int]]:
    """name -> (version, number of hashes) for a `uv pip compile --generate-hashes` file."""
    out: dict[str, tuple[str, int]] = {}
    current = None
    for line in path.read_text().splitlines():
        pin = re.match(r"^([A-Za-z0-9._-]+)==(\S+)", line)
        if pin:
            current = canonicalize_name(pin.group(1))
            assert current not in out, f"{path.name}: {current} pinned twice"
            out[current] = (pin.group(2), 0)
        elif current and re.match(r"^\s+--hash=sha256:[0-9a-f]{64}", line):
            out[current] = (out[current][0], out[current][1] + 1)
        elif line.strip() and not line.lstrip().startswith("#"):
            assert line.startswith(" "), f"{path.name}: unpinned line {line!r}"
    return out


def _pyproject() -> dict:
    return tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]


def _args() -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", DOCKERFILE.read_text(), re.M))


# -- the image reference -----------------------------------------------------------------------------


def test_the_install_names_no_image_anyone_could_register() -> None:
    images = []
    for doc in yaml.safe_load_all((DEPLOY / "daemonset.yaml").read_text()):
        spec = doc["spec"]["template"]["spec"]
        images += [c["image"] for c in (*spec["initContainers"], *spec["containers"])]
    kust = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    (entry,) = kust["images"]
    assert "newName" not in entry, "the shipped kustomization must not name a real registry"
    for image in [*images, entry["name"]]:
        registry = image.split("/")[0]
        # RFC 2606: .invalid never resolves, so nobody can own (or serve) this name; a pull
        # fails with the placeholder in the error until the operator sets their registry.
        assert registry.endswith(".invalid"), f"{image}: a resolvable default image could be squatted"
    assert all(img.rsplit(":", 1)[0] == entry["name"] for img in images)


# -- the Dockerfile ----------------------------------------------------------------------------------


def test_base_images_are_pinned_by_digest() -> None:
    text = DOCKERFILE.read_text()
    args = _args()
    froms = re.findall(r"^FROM (\S+)", text, re.M)
    assert len(froms) == 3
    for ref in froms:
        resolved = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], ref)
        assert DIGEST.search(resolved), f"FROM {ref} ({resolved}) is not pinned by digest"
    # The arm64 shim builder offered in the comment is pinned too.
    for alt in re.findall(r"--build-arg SHIM_BUILDER=(\S+)", text):
        assert DIGEST.search(alt), alt
    # No remote frontend pulled by tag at build time.
    assert not re.search(r"^# *syntax=", text, re.M | re.I)


def test_python_packages_come_only_from_hash_checked_locks() -> None:
    text = DOCKERFILE.read_text()
    installs = re.findall(r"pip install ([^\n&]*)", text)
    assert installs, "the Dockerfile installs nothing?"
    for args in installs:
        if "--require-hashes" in args:
            assert re.search(r"-r \S*requirements\.lock", args), args
        else:
            # The only other install is gpufrac's own wheel, built in the image, without dependencies.
            assert "--no-deps" in args and "/wheels/" in args, f"unlocked pip install {args!r}"
    assert "--no-build-isolation" in text, "the wheel must be built with the locked setuptools"
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
    for lock in ("requirements.lock", "build-requirements.lock"):
        assert f"COPY deploy/daemonset/{lock} " in text
        assert f"!deploy/daemonset/{lock}" in ignore, f"{lock} is not in the build context"


# -- the lock files ----------------------------------------------------------------------------------


def test_the_image_lock_satisfies_pyproject_and_hashes_every_pin() -> None:
    lock = _lock(DEPLOY / "requirements.lock")
    for dep in _pyproject()["dependencies"]:
        req = Requirement(dep)
        name = canonicalize_name(req.name)
        assert name in lock, f"{req.name} is a dependency but not in requirements.lock: run make image-lock"
        version, _ = lock[name]
        assert req.specifier.contains(version, prereleases=True), (
            f"{name}=={version} is outside {req.specifier}"
        )
    for name, (version, hashes) in lock.items():
        assert hashes >= 1, f"{name}=={version} has no hash"
    # Only cuda.bindings is imported: the metapackage's cuda-core and numpy stay out of the image.
    assert not {"cuda-python", "cuda-core", "numpy"} & set(lock)
    # The image keeps CUDA 12 bindings so it runs on pre-580 drivers (image-constraints.txt).
    assert lock["cuda-bindings"][0].startswith("12.")


def test_the_build_lock_holds_the_pinned_proto_generator() -> None:
    lock = _lock(DEPLOY / "build-requirements.lock")
    pinned = [Requirement(d) for d in _pyproject()["optional-dependencies"]["dev"]]
    (tools,) = [r for r in pinned if canonicalize_name(r.name) == "grpcio-tools"]
    # The generated code's version checks decide the runtime floors, so the image must be
    # generated by the same grpcio-tools as every checkout (pyproject.toml's pin).
    assert lock["grpcio-tools"][0] == str(tools.specifier).removeprefix("==")
    assert {"setuptools", "wheel"} <= set(lock)
    assert all(hashes >= 1 for _, hashes in lock.values())


def test_lock_reader_refuses_an_unpinned_line(tmp_path: Path) -> None:
    bad = tmp_path / "requirements.lock"
    bad.write_text("grpcio==1.85.3 \\\n    --hash=sha256:" + "0" * 64 + "\nkubernetes>=29\n")
    with pytest.raises(AssertionError, match="kubernetes"):
        _lock(bad)
