"""Wire format version 2: fp8 KV with per-head scales (`transport.wire`, "Versions").

The same guarantees as version 1 (`test_wire.py`): round trips are exact, every mutation is
detected, hostile bytes only raise `WireFormatError`; plus: scales travel inside their
layer's checksummed payload, non-finite or non-positive scales raise `MalformedScalesError`,
and unscaled transfers are still written (byte for byte) as version 1.
"""

from __future__ import annotations

import contextlib
import struct
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.unit.test_wire import (
    FUZZ,
    SUM,
    Mutation,
    joined,
    mutate,
    mutations,
    raw_header,
    resign,
    xxh,
)
from transport.errors import MalformedScalesError, WireFormatError
from transport.wire import (
    FORMAT_VERSION,
    LAYER_FRAME_SIZE,
    DType,
    Expectation,
    KvCache,
    ScaleLayout,
    decode_header,
    decode_kv,
    encode_header,
    encode_kv,
    header_for,
    header_length,
)

Dims = tuple[int, ...]


def scaled_cache(
    shapes: list[tuple[Dims, Dims]], seed: int = 0, scale: float | None = None
) -> KvCache:
    rng = np.random.default_rng(seed)
    layers = tuple(
        (
            rng.integers(0, 256, size=k, dtype=np.uint8),
            rng.integers(0, 256, size=v, dtype=np.uint8),
        )
        for k, v in shapes
    )
    scales = tuple(
        tuple(
            np.full(a.shape[0], scale, "<f4")
            if scale is not None
            else rng.uniform(1e-3, 10, a.shape[0]).astype("<f4")
            for a in pair
        )
        for pair in layers
    )
    header = replace(
        header_for("req-8", 3, "model-a", DType.FLOAT8_E4M3, layers),
        scales=ScaleLayout.PER_HEAD_F32,
    )
    return KvCache(header, layers, scales=scales)  # type: ignore[arg-type]


dims = st.lists(st.integers(0, 3), min_size=1, max_size=4).map(tuple)


@st.composite
def scaled_caches(draw: st.DrawFn) -> KvCache:
    shapes = draw(st.lists(st.tuples(dims, dims), min_size=1, max_size=4))
    return scaled_cache(shapes, seed=draw(st.integers(0, 2**32 - 1)))


def loose(cache: KvCache) -> Expectation:
    return Expectation(max_kv_bytes=cache.nbytes)


def test_layout_header_is_version_2_with_a_scales_byte_and_payload_ends_with_scales() -> None:
    cache = scaled_cache([((2, 3, 4), (2, 3, 4))], seed=1)
    head = encode_header(cache.header)
    assert struct.unpack_from("<4sH", head) == (b"PDKV", 2)
    assert FORMAT_VERSION >= 2  # the scaled header is written in the oldest that fits
    # v1 header + one byte (the layout) before the header checksum
    unscaled = encode_header(replace(cache.header, scales=ScaleLayout.NONE))
    assert len(head) == len(unscaled) + 1
    assert head[-SUM.size - 1] == ScaleLayout.PER_HEAD_F32
    bufs = encode_kv(cache)
    (k, v), (ks, vs) = cache.layers[0], cache.scales[0]
    payload = k.tobytes() + v.tobytes() + ks.tobytes() + vs.tobytes()
    assert joined(bufs[1:])[LAYER_FRAME_SIZE:] == payload
    assert cache.header.layer_nbytes(0) == 2 * 24 + 4 * (2 + 2)
    frame = joined(bufs[1:])[:LAYER_FRAME_SIZE]
    assert struct.unpack_from("<Q", frame, 16)[0] == xxh(payload)  # the checksum covers scales


def test_unscaled_transfers_are_still_written_as_version_1() -> None:
    k = np.zeros((1, 2, 2), np.float16)
    head = encode_header(header_for("r", 0, "f", DType.FLOAT16, [(k, k)]))
    assert struct.unpack_from("<H", head, 4)[0] == 1
    assert head == raw_header(
        layers=[((1, 2, 2), (1, 2, 2))], rid=b"r", fp=b"f", dtype=DType.FLOAT16, epoch=0, tokens=2
    )


@FUZZ
@given(cache=scaled_caches())
def test_scaled_round_trip(cache: KvCache) -> None:
    got = decode_kv(joined(encode_kv(cache)), loose(cache))
    assert got.header == cache.header
    for (gk, gv), (wk, wv) in zip(got.layers, cache.layers, strict=True):
        assert gk.tobytes() == wk.tobytes()
        assert gv.tobytes() == wv.tobytes()
    for (gks, gvs), (wks, wvs) in zip(got.scales, cache.scales, strict=True):
        assert gks.tobytes() == wks.tobytes()
        assert gvs.tobytes() == wvs.tobytes()
    assert decode_header(encode_header(cache.header), cache.nbytes) == cache.header


@FUZZ
@given(cache=scaled_caches(), m=mutations)
def test_any_single_mutation_of_a_scaled_transfer_is_detected(cache: KvCache, m: Mutation) -> None:
    buf = bytearray(joined(encode_kv(cache)))
    mutate(buf, m)
    with pytest.raises(WireFormatError):
        decode_kv(bytes(buf), loose(cache))


@FUZZ
@given(
    cache=scaled_caches(),
    header_ops=st.lists(mutations, max_size=4),
    body_ops=st.lists(mutations, max_size=3),
    limit=st.sampled_from([0, 64, 1 << 20, 1 << 62]),
)
def test_mutated_and_resigned_scaled_transfers_only_raise_wire_format_errors(
    cache: KvCache, header_ops: list[Mutation], body_ops: list[Mutation], limit: int
) -> None:
    bufs = encode_kv(cache)
    header, body = bytearray(bufs[0]), bytearray(joined(bufs[1:]))
    for m in header_ops:
        mutate(header, m)
    for m in body_ops:
        mutate(body, m)
    resign(header)
    with contextlib.suppress(WireFormatError):
        decode_kv(bytes(header + body), Expectation(max_kv_bytes=limit))
    with contextlib.suppress(WireFormatError):
        decode_header(bytes(header), limit)


@pytest.mark.parametrize("bad", [0.0, -1.0, np.inf, -np.inf, np.nan])
def test_scales_that_are_not_finite_and_positive_are_refused(bad: float) -> None:
    cache = scaled_cache([((2, 3, 4), (2, 3, 4)), ((2, 3, 4), (2, 3, 4))], seed=2)
    cache.scales[1][1][1] = bad  # layer 1, V, head 1: properly checksummed, still junk
    with pytest.raises(MalformedScalesError, match="layer 1 V"):
        decode_kv(joined(encode_kv(cache)), loose(cache))


def v2_header(layout: int, dtype: int = DType.FLOAT8_E4M3) -> bytes:
    shapes = [((2, 3, 4), (2, 3, 4))]
    base = raw_header(layers=shapes, dtype=dtype, version=2, extra=bytes((layout,)))
    if layout == ScaleLayout.PER_HEAD_F32 and dtype == DType.FLOAT8_E4M3:
        payload = 48 + 16
        base = raw_header(
            layers=shapes, dtype=dtype, version=2, extra=bytes((layout,)), payload=payload
        )
    return base


def test_a_well_formed_v2_header_decodes() -> None:
    h = decode_header(v2_header(ScaleLayout.PER_HEAD_F32), 1 << 20)
    assert (h.scales, h.payload_bytes, h.version) == (ScaleLayout.PER_HEAD_F32, 64, 2)


@pytest.mark.parametrize(
    ("layout", "dtype", "match"),
    [
        (ScaleLayout.NONE, DType.FLOAT8_E4M3, "must declare scales"),
        (7, DType.FLOAT8_E4M3, "unknown scale layout"),
        (ScaleLayout.PER_HEAD_F32, DType.FLOAT16, "cannot carry scales"),
        (ScaleLayout.PER_HEAD_F32, DType.FLOAT32, "cannot carry scales"),
    ],
)
def test_non_canonical_v2_headers_are_refused(layout: int, dtype: int, match: str) -> None:
    with pytest.raises(WireFormatError, match=match):
        decode_header(v2_header(layout, dtype), 1 << 20)


def test_a_v2_header_without_its_scales_byte_is_refused() -> None:
    buf = raw_header(version=2, dtype=DType.FLOAT8_E4M3)  # a v1 body under a v2 version
    with pytest.raises(WireFormatError):
        decode_header(buf, 1 << 20)


def test_scales_on_a_16_bit_payload_are_refused_at_encode() -> None:
    k = np.zeros((1, 2, 2), np.float16)
    h = replace(header_for("r", 0, "f", DType.FLOAT16, [(k, k)]), scales=ScaleLayout.PER_HEAD_F32)
    with pytest.raises(WireFormatError, match="cannot carry scales"):
        encode_header(h)


def test_a_version_after_the_newest_is_refused() -> None:
    with pytest.raises(WireFormatError, match="unsupported format version"):
        header_length(resign(bytearray(raw_header(version=FORMAT_VERSION + 1))))
