"""KV precision conversion (`transport.kvcodec`): exact against torch's casts, bounded errors.

torch (the `engine` extra) is the reference: its ``float8_e4m3fn`` and ``bfloat16`` casts
round to nearest even like ours; the codec itself never imports torch.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from transport import kvcodec
from transport.errors import WireFormatError
from transport.wire import DType, ScaleLayout


def grid_and_midpoints() -> np.ndarray:
    """Every finite e4m3 value, every midpoint between neighbours (the ties), and a dense
    random sample: what a round-to-nearest-even encoder can get wrong."""
    grid = kvcodec.E4M3_VALUES[:127].astype(np.float64)
    mids = (grid[1:] + grid[:-1]) / 2
    rng = np.random.default_rng(0)
    dense = rng.uniform(-448, 448, 200_000) * np.exp2(rng.integers(-16, 1, 200_000))
    x = np.concatenate([grid, mids, dense, 2.0 ** np.arange(-12.0, 9.0)])
    return np.concatenate([x, -x]).astype(np.float32)


def test_e4m3_codes_equal_torch_float8_e4m3fn() -> None:
    x = grid_and_midpoints()
    ref = torch.from_numpy(x).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    np.testing.assert_array_equal(kvcodec.e4m3_codes(x), ref)


def test_e4m3_table_equals_torch_for_every_code() -> None:
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    ref = codes.view(torch.float8_e4m3fn).to(torch.float32).numpy()
    np.testing.assert_array_equal(kvcodec.E4M3_VALUES, ref)  # NaNs compare equal here


def test_e4m3_saturates_and_keeps_nan() -> None:
    codes = kvcodec.e4m3_codes(np.array([1e9, -1e9, np.inf, 500.0, np.nan], np.float32))
    assert list(codes) == [0x7E, 0xFE, 0x7E, 0x7E, 0x7F]


def test_bf16_bits_equal_torch_bfloat16() -> None:
    x = grid_and_midpoints() * np.float32(1.001)
    x = np.concatenate([x, np.array([3.4e38, -3.4e38, 1e-40, 0.0, -0.0], np.float32)])
    ref = torch.from_numpy(x).to(torch.bfloat16).view(torch.uint16).numpy()
    np.testing.assert_array_equal(kvcodec.to_bf16_bits(x), ref)
    assert np.isnan(kvcodec.to_float32(kvcodec.to_bf16_bits(np.array([np.nan])), DType.BFLOAT16))


def test_fp16_saturates_instead_of_overflowing() -> None:
    out = kvcodec.to_fp16(np.array([1e6, -1e6, 1.0], np.float32))
    assert list(out) == [65504.0, -65504.0, 1.0]


def kv(seed: int = 0, heads: int = 3, tokens: int = 40, dim: int = 16) -> np.ndarray:
    """Heads of very different magnitudes, like real K caches (one outlier head)."""
    rng = np.random.default_rng(seed)
    mags = np.array([1e-3, 1.0, 300.0, 5.0])[:heads].reshape(-1, 1, 1)
    return (rng.standard_normal((heads, tokens, dim)) * mags).astype(np.float32)


@pytest.mark.parametrize(
    ("wire", "rel"),
    [(DType.FLOAT32, 0.0), (DType.FLOAT16, 2**-11), (DType.BFLOAT16, 2**-8)],
)
def test_16_bit_round_trip_error_bounds(wire: DType, rel: float) -> None:
    x = kv()
    ((k, v),) = kvcodec.round_trip([(x, x / 7)], DType.FLOAT32, wire)
    assert k.dtype == v.dtype == np.float32
    assert np.all(np.abs(k - x) <= rel * np.abs(x) + 1e-7)
    assert np.all(np.abs(v - x / 7) <= rel * np.abs(x / 7) + 1e-7)


def test_fp8_round_trip_error_bound_is_per_head() -> None:
    x = kv()
    ((k, _),) = kvcodec.round_trip([(x, x)], DType.FLOAT32, DType.FLOAT8_E4M3)
    amax = np.abs(x).reshape(3, -1).max(axis=1).reshape(-1, 1, 1)
    # 3 mantissa bits: relative error <= 2^-4 in the normal range; below amax*2^-14 the
    # subnormal step bounds the absolute error.
    bound = np.maximum(2**-4 * np.abs(x), amax / 448 * 2**-10)
    assert np.all(np.abs(k - x) <= bound * 1.0001)
    # per head: the quiet head keeps its relative precision next to the loud one
    quiet = np.abs(k[0] - x[0]).max() / np.abs(x[0]).max()
    assert quiet < 2**-4


def test_a_per_layer_scale_would_crush_the_quiet_head() -> None:
    """Why scales are per head: one scale for the whole tensor loses the quiet head."""
    x = kv()
    amax = np.abs(x).max()
    coarse = kvcodec.E4M3_VALUES[kvcodec.e4m3_codes(x / (amax / 448))] * (amax / 448)
    ((fine, _),) = kvcodec.round_trip([(x, x)], DType.FLOAT32, DType.FLOAT8_E4M3)
    err = lambda y: np.abs(y[0] - x[0]).max() / np.abs(x[0]).max()  # noqa: E731
    assert err(coarse) > 0.5 > 0.1 > err(fine)


def test_fp8_layer_has_one_scale_per_head_and_an_all_zero_head_gets_scale_1() -> None:
    x = kv()
    x[1] = 0
    e = kvcodec.encode_layer(x, x, DType.FLOAT32, DType.FLOAT8_E4M3)
    assert e.k.dtype == np.uint8
    assert e.k.shape == x.shape
    assert e.k.flags.c_contiguous
    assert e.scales is not None
    ks, _ = e.scales
    assert ks.dtype == np.dtype("<f4")
    assert ks.shape == (3,)
    assert ks[1] == 1.0
    assert np.all(e.k[1] == 0)
    np.testing.assert_allclose(ks[[0, 2]], np.abs(x[[0, 2]]).reshape(2, -1).max(1) / 448)


def test_encode_cache_carries_a_scaled_header_only_for_fp8() -> None:
    x = kv()
    fp8 = kvcodec.encode_cache("r", 1, "f", [(x, x)], DType.FLOAT32, DType.FLOAT8_E4M3)
    fp16 = kvcodec.encode_cache("r", 1, "f", [(x, x)], DType.FLOAT32, DType.FLOAT16)
    assert fp8.header.scales is ScaleLayout.PER_HEAD_F32
    assert len(fp8.scales) == 1
    assert fp16.header.scales is ScaleLayout.NONE
    assert fp16.scales == ()
    assert fp16.nbytes * 2 == x.nbytes * 2 == 2 * fp8.nbytes * 2 - 2 * 2 * 4 * 3 * 2


def test_decoding_to_the_same_dtype_is_a_view_and_bf16_sources_round_trip() -> None:
    x = kv()
    bits = kvcodec.to_bf16_bits(x)
    ((k, _),) = kvcodec.round_trip([(bits, bits)], DType.BFLOAT16, DType.FLOAT16)
    assert k.dtype == np.uint16
    back = kvcodec.to_float32(k, DType.BFLOAT16)
    ref = kvcodec.to_float32(bits, DType.BFLOAT16)
    assert np.all(np.abs(back - ref) <= 2**-8 * np.abs(ref) + 1e-7)


def test_unsupported_conversions_raise_a_wire_format_error() -> None:
    x = np.zeros((1, 2, 2), np.uint8)
    with pytest.raises(WireFormatError):
        kvcodec.encode_tensor(x, DType.FLOAT8_E4M3, DType.FLOAT16)
    with pytest.raises(WireFormatError):
        kvcodec.to_float32(x, DType.FLOAT8_E4M3, None)
