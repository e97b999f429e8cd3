"""Non-finite KV values (`transport.wire.has_nonfinite`, `verify_layer(..., finite=)`).

The bit-level scan is checked against an independent reference for every dtype — numpy's
``isfinite`` for float32/float16, bfloat16 widened to float32, the e4m3fn code table — over
every 8- and 16-bit pattern and random 32-bit ones; the fused checksum + scan against the
one-shot checksum across chunk boundaries.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transport import kvcodec
from transport.errors import ChecksumMismatchError, NonFiniteError, WireFormatError
from transport.wire import _CHUNK_BYTES, DType, LayerFrame, checksum, has_nonfinite, verify_layer


def reference_nonfinite(bits: np.ndarray, dtype: DType) -> np.ndarray:
    """Per value: NaN or infinite, decided by float arithmetic, not by bit masks."""
    if dtype is DType.FLOAT32:
        return ~np.isfinite(bits.view(np.float32))
    if dtype is DType.FLOAT16:
        return ~np.isfinite(bits.view(np.float16))
    if dtype is DType.BFLOAT16:
        return ~np.isfinite((bits.view(np.uint16).astype(np.uint32) << 16).view(np.float32))
    return ~np.isfinite(kvcodec.E4M3_VALUES[bits.view(np.uint8)])


@pytest.mark.parametrize(
    ("dtype", "container"),
    [(DType.FLOAT16, np.uint16), (DType.BFLOAT16, np.uint16), (DType.FLOAT8_E4M3, np.uint8)],
)
def test_every_bit_pattern_of_the_narrow_dtypes_is_judged_right(
    dtype: DType, container: type[np.unsignedinteger[object]]
) -> None:
    patterns = np.arange(np.iinfo(container).max + 1, dtype=container)
    expected = reference_nonfinite(patterns, dtype)
    assert expected.any()  # each of these dtypes has non-finite patterns
    finite = patterns[~expected].view(np.uint8)
    assert not has_nonfinite(finite, dtype)  # every finite pattern at once: none flagged
    for bad in patterns[expected]:  # each non-finite pattern among finite ones is flagged
        values = np.concatenate([patterns[~expected][:64], [bad], patterns[~expected][-64:]])
        assert has_nonfinite(values.astype(container).view(np.uint8), dtype), hex(bad)


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(st.lists(st.integers(0, 2**32 - 1), min_size=0, max_size=64))
def test_float32_bit_patterns_are_judged_like_isfinite(words: list[int]) -> None:
    bits = np.asarray(words, dtype=np.uint32)
    expected = bool(reference_nonfinite(bits, DType.FLOAT32).any())
    assert has_nonfinite(bits.view(np.uint8), DType.FLOAT32) == expected


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf, -np.nan])
def test_each_kind_of_non_finite_float32_is_flagged(value: float) -> None:
    values = np.array([1.0, -2.0, np.finfo(np.float32).max, -np.finfo(np.float32).max, 0.0])
    assert not has_nonfinite(values.astype(np.float32).view(np.uint8), DType.FLOAT32)
    values[2] = value
    assert has_nonfinite(values.astype(np.float32).view(np.uint8), DType.FLOAT32)


def payload_with(nbytes: int, bad_at: int | None, scales: int = 0) -> memoryview:
    """A float32 payload (finite values) of ``nbytes`` K/V bytes then ``scales`` bytes of
    NaN (scales are not the values' business), with a NaN at byte ``bad_at`` if given."""
    values = np.linspace(-3, 3, nbytes // 4, dtype=np.float32)
    if bad_at is not None:
        values[bad_at // 4] = np.nan
    tail = np.full(scales // 4, np.nan, dtype=np.float32)
    return memoryview(np.concatenate([values, tail]).view(np.uint8))


@pytest.mark.parametrize(
    "bad_at",
    [None, 0, _CHUNK_BYTES - 4, _CHUNK_BYTES, 2 * _CHUNK_BYTES + 4096, 3 * _CHUNK_BYTES - 4],
)
def test_the_fused_pass_finds_a_nan_in_any_chunk_and_keeps_the_checksum(
    bad_at: int | None,
) -> None:
    payload = payload_with(3 * _CHUNK_BYTES, bad_at, scales=64)
    frame = LayerFrame(0, len(payload), checksum(payload))
    values = 3 * _CHUNK_BYTES
    verify_layer(frame, payload)  # the checksum alone never looks at values
    if bad_at is None:
        verify_layer(frame, payload, DType.FLOAT32, values)  # NaN scales are not values
    else:
        with pytest.raises(NonFiniteError, match="layer 0"):
            verify_layer(frame, payload, DType.FLOAT32, values)


def test_a_corrupted_layer_is_a_checksum_error_even_with_a_nan_in_it() -> None:
    payload = payload_with(2 * _CHUNK_BYTES, bad_at=8)
    frame = LayerFrame(3, len(payload), checksum(payload) ^ 1)
    with pytest.raises(ChecksumMismatchError, match="layer 3"):
        verify_layer(frame, payload, DType.FLOAT32, len(payload))


def test_value_bytes_must_fit_the_payload_and_whole_values() -> None:
    payload = payload_with(64, None)
    frame = LayerFrame(0, 64, checksum(payload))
    for values in (65, 62):
        with pytest.raises(WireFormatError):
            verify_layer(frame, payload, DType.FLOAT32, values)
