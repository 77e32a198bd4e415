"""A size too small for the arithmetic is refused, not taken for 0 bytes."""

from __future__ import annotations

import pytest

from gpufrac.core.units import parse_bytes

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("text", ["1e-999999999999Ki", "1.5e-999999999999999999Gi", "1e-9"])
def test_a_fraction_of_a_byte_is_refused_however_small(text: str) -> None:
    with pytest.raises(ValueError, match=text.replace(".", r"\.")):
        parse_bytes(text)


@pytest.mark.parametrize(("text", "value"), [("0.5Ki", 512), ("0Ki", 0), ("1e3", 1000), ("24Gi", 24 << 30)])
def test_ordinary_sizes_still_parse(text: str, value: int) -> None:
    assert parse_bytes(text) == value
