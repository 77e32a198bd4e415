"""memguard: a layered or cubemap mipmapped array keeps every layer at every level.

For CUDA_ARRAY3D_LAYERED and CUDA_ARRAY3D_CUBEMAP arrays, Depth is the number of
layers (6 faces, or 6 x layers for a layered cubemap), not a dimension: each mip
level halves width and height and keeps all the layers. Halving the layers too
would under-count such an array, letting a tenant past its limit and the count
drift from what NVML shows for the process.

Real processes under the real shim on a simulated node, release and ASan+UBSan builds.
"""

from __future__ import annotations

from collections.abc import Callable

from tests.fixtures.memguard import NVML, Container, MiB, Shim

LAYERED, CUBEMAP = 0x01, 0x04

BODY = (
    NVML
    + """
def desc(side, layers, flags):
    d = cu.CUDA_ARRAY3D_DESCRIPTOR()
    d.Width = side
    d.Height = side
    d.Depth = layers
    d.Format = cu.CUarray_format.CU_AD_FORMAT_FLOAT
    d.NumChannels = 1
    d.Flags = flags
    return d
for name, side, layers, flags, levels in CASES:
    m = chk(cu.cuMipmappedArrayCreate(desc(side, layers, flags), levels))
    out[name] = [used(), nvml()]
    chk(cu.cuMipmappedArrayDestroy(m))
out["destroyed"] = [used(), nvml()]
"""
)

CASES = [
    ("layered", 256, 8, LAYERED, 9),
    ("cubemap", 128, 6, CUBEMAP, 8),
    ("layered_cubemap", 64, 12, LAYERED | CUBEMAP, 7),
]


def size(side: int, layers: int, levels: int) -> int:
    """Every level: (side >> l)^2 floats per layer, all layers, 512-byte aligned."""
    return sum(-(-(max(side >> lv, 1) ** 2 * 4 * layers) // 512) * 512 for lv in range(levels))


def test_layered_and_cubemap_mipmaps_count_every_layer_at_every_level(
    shim: Shim, container: Callable[..., Container]
) -> None:
    """Each array is charged all its layers at every level, as NVML shows for
    the process, and nothing stays counted once destroyed."""
    out = shim.python(container(request=96 * MiB, limit=96 * MiB), f"CASES = {CASES!r}\n" + BODY)
    want = {name: [size(side, layers, levels)] * 2 for name, side, layers, _, levels in CASES}
    assert out == {**want, "destroyed": [0, 0]}
