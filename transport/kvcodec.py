"""KV precision conversion: float32/bf16/fp16 to the wire dtype and back. Pure numpy.

A prefill worker may send its KV in a narrower dtype than it computes in (`orchestrator.core.
kvdtype` decides which); the decode worker converts it back to its own compute dtype on
receive. Every conversion goes through float32, which holds every value of every dtype here
exactly, so ``decode(encode(x))`` differs from ``x`` only by the one rounding to the wire
dtype:

- **fp16**: round to nearest even (numpy's cast); values beyond fp16's ±65504 saturate to
  ±65504 instead of becoming infinities (a KV entry that large is an outlier either way, and
  an infinity would poison every attention score it meets). Relative error <= 2^-11.
- **bf16**: round to nearest even on the float32 bits (the upper 16 bits); NaN stays NaN.
  Relative error <= 2^-8.
- **fp8 e4m3** (the OCP "e4m3fn" variant: max 448, no infinities, NaN = S.1111.111) with
  **one float32 scale per KV head**, separately for K and V: ``scale = amax / 448`` over that
  head's finite values (1 when they are all 0), code = round-to-nearest-even of
  ``x / scale`` on the e4m3 grid, saturating at ±448. Relative error <= 2^-4 for values
  above the head's amax / 2^14 (below that, e4m3's subnormals: absolute error <= amax·2^-18).

Why per head: KV heads differ in magnitude by orders (a few K heads carry outliers); one
scale per layer would be set by the loudest head and push the quiet heads' values into
e4m3's subnormals, where precision collapses. A scale per head costs 4 bytes per head per
tensor per layer (720 bytes per transfer for SmolLM2-135M) and adapts to that. A scale per
(head, token) would cost 4 bytes per 64-byte head row (+6%) for little more: within one head
e4m3's dynamic range (2^-6..448 normal, ratio ~2^15) already covers the spread of values.

The e4m3 encoder is exact table lookup (`np.searchsorted` over the 127 non-negative finite
codes), tested against torch's ``float8_e4m3fn`` cast; no torch is needed here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from transport.errors import WireFormatError
from transport.wire import (
    DType,
    Expectation,
    KvCache,
    KvHeader,
    ScaleLayout,
    decode_kv,
    encode_kv,
    header_for,
)

FP16_MAX = 65504.0
E4M3_MAX = 448.0
E4M3_NAN = 0x7F


def _e4m3_table() -> np.ndarray:
    """The float32 value of every e4m3fn code 0..255 (NaN for 0x7F and 0xFF)."""
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exp, man = (codes >> 3) & 0xF, codes & 0x7
    normal = (1 + man / 8) * np.exp2(exp - 7.0)
    subnormal = man / 8 * 2.0**-6
    values = sign * np.where(exp == 0, subnormal, normal)
    values[(codes & 0x7F) == E4M3_NAN] = np.nan
    return values.astype(np.float32)


E4M3_VALUES = _e4m3_table()
"""e4m3 code -> float32 value."""
_E4M3_GRID = E4M3_VALUES[:E4M3_NAN].astype(np.float64)  # codes 0..126: 0 .. 448, ascending

CONVERTIBLE = frozenset({DType.FLOAT32, DType.FLOAT16, DType.BFLOAT16})
"""Dtypes KV can be converted from (and decoded to)."""
WIRE_DTYPES = frozenset({*CONVERTIBLE, DType.FLOAT8_E4M3})
"""Dtypes KV can be converted to for the wire (FLOAT8_E4M3 always with per-head scales)."""


class KvCodecError(WireFormatError):
    """A conversion this module does not do (an unknown source or target dtype, a shape
    without a head axis)."""


@dataclass(frozen=True, slots=True)
class EncodedLayer:
    """One layer in its wire dtype: K and V, and per-head scales when the dtype is fp8."""

    k: np.ndarray
    v: np.ndarray
    scales: tuple[np.ndarray, np.ndarray] | None = None


def scale_layout(dtype: DType) -> ScaleLayout:
    """The scales a transfer in ``dtype`` carries (fp8 is always sent with scales)."""
    return ScaleLayout.PER_HEAD_F32 if dtype is DType.FLOAT8_E4M3 else ScaleLayout.NONE


# ------------------------------------------------------------------ elementwise


def to_float32(a: np.ndarray, dtype: DType, scales: np.ndarray | None = None) -> np.ndarray:
    """Values of ``a`` (a wire container of ``dtype``) as float32; fp8 needs its scales."""
    if dtype is DType.FLOAT32:
        return np.asarray(a, dtype=np.float32)
    if dtype is DType.FLOAT16:
        return a.astype(np.float32)
    if dtype is DType.BFLOAT16:
        return (a.astype(np.uint32) << 16).view(np.float32)
    if dtype is DType.FLOAT8_E4M3:
        if scales is None or a.ndim == 0 or scales.shape != a.shape[:1]:
            raise KvCodecError("fp8 KV needs one scale per slice of its first axis")
        values: np.ndarray = E4M3_VALUES[a]
        values *= scales.astype(np.float32).reshape((-1,) + (1,) * (a.ndim - 1))
        return values
    raise KvCodecError(f"cannot decode {dtype.name}")


def to_fp16(x: np.ndarray) -> np.ndarray:
    out: np.ndarray = np.clip(x, -FP16_MAX, FP16_MAX).astype(np.float16)
    return out


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits (uint16), round to nearest even; NaN stays a quiet NaN."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
    out = rounded.astype(np.uint16)
    out[np.isnan(x)] = 0x7FC0
    return out


def e4m3_codes(x: np.ndarray) -> np.ndarray:
    """float32 values (already scaled into ±448) -> e4m3fn codes, round to nearest even,
    saturating at ±448; NaN -> 0x7F."""
    x64 = np.asarray(x, dtype=np.float64)
    mag = np.minimum(np.abs(x64), E4M3_MAX)
    hi = np.minimum(np.searchsorted(_E4M3_GRID, mag, side="left"), E4M3_NAN - 1)
    lo = np.maximum(hi - 1, 0)
    d_hi, d_lo = _E4M3_GRID[hi] - mag, mag - _E4M3_GRID[lo]
    # A tie goes to the even code: the code's last bit is the mantissa's last bit.
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    codes = np.where(pick_hi, hi, lo).astype(np.uint8)
    codes |= np.signbit(x64).astype(np.uint8) << 7
    codes[np.isnan(x64)] = E4M3_NAN
    return codes


def head_scales(x: np.ndarray) -> np.ndarray:
    """One float32 scale per slice of ``x``'s first axis: amax of its finite values / 448,
    or 1 where that amax is 0 (the scale must stay finite and positive)."""
    if x.ndim == 0:
        raise KvCodecError("fp8 KV needs a head axis")
    flat = np.abs(x.reshape(x.shape[0], -1).astype(np.float32))
    flat[~np.isfinite(flat)] = 0.0
    amax = flat.max(axis=1) if flat.shape[1] else np.zeros(x.shape[0], np.float32)
    scales = (amax / E4M3_MAX).astype("<f4")
    # amax / 448 underflows to 0 for amax below ~6e-43: such a head is all but zero anyway.
    scales[~(scales > 0)] = 1.0
    return scales


def encode_fp8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 -> (e4m3 codes, per-head scales)."""
    scales = head_scales(x)
    scaled = x.astype(np.float32) / scales.reshape((-1,) + (1,) * (x.ndim - 1))
    return e4m3_codes(scaled), scales


# ------------------------------------------------------------------ layers and caches


def encode_tensor(
    a: np.ndarray, source: DType, wire: DType
) -> tuple[np.ndarray, np.ndarray | None]:
    """One tensor from ``source`` to ``wire``: (wire container, scales or None)."""
    if wire is source:
        return a, None
    if source not in CONVERTIBLE:
        raise KvCodecError(f"cannot convert KV from {source.name}")
    x = to_float32(a, source)
    if wire is DType.FLOAT32:
        return x, None
    if wire is DType.FLOAT16:
        return to_fp16(x), None
    if wire is DType.BFLOAT16:
        return to_bf16_bits(x), None
    if wire is DType.FLOAT8_E4M3:
        return encode_fp8(x)
    raise KvCodecError(f"cannot convert KV to {wire.name}")


def encode_layer(k: np.ndarray, v: np.ndarray, source: DType, wire: DType) -> EncodedLayer:
    """A layer's K and V from the engine's ``source`` dtype to the ``wire`` dtype (C-contiguous,
    ready for the transport)."""
    ek, sk = encode_tensor(k, source, wire)
    ev, sv = encode_tensor(v, source, wire)
    ek, ev = np.ascontiguousarray(ek), np.ascontiguousarray(ev)
    if sk is None or sv is None:
        return EncodedLayer(ek, ev)
    return EncodedLayer(ek, ev, (sk, sv))


def decode_layers(cache: KvCache, to: DType) -> list[tuple[np.ndarray, np.ndarray]]:
    """A received cache's layers in the ``to`` dtype (new arrays when converted; the cache's
    own views when it already is in ``to`` and unscaled)."""
    h = cache.header
    if to not in CONVERTIBLE:
        raise KvCodecError(f"cannot decode KV to {to.name}")
    if h.dtype is to:
        return [(k, v) for k, v in cache.layers]
    if h.dtype not in WIRE_DTYPES:
        raise KvCodecError(f"cannot decode KV from {h.dtype.name}")
    scaled = h.scales is not ScaleLayout.NONE
    if h.dtype is DType.FLOAT8_E4M3 and not scaled:
        raise KvCodecError("fp8 KV without scales is not decoded here")
    out = []
    for i, (k, v) in enumerate(cache.layers):
        ks, vs = cache.scales[i] if scaled else (None, None)
        fk, fv = to_float32(k, h.dtype, ks), to_float32(v, h.dtype, vs)
        out.append((_narrow(fk, to), _narrow(fv, to)))
    return out


def _narrow(x: np.ndarray, to: DType) -> np.ndarray:
    if to is DType.FLOAT32:
        return x
    return encode_tensor(x, DType.FLOAT32, to)[0]


def encode_cache(
    request_id: str,
    epoch: int,
    fingerprint: str,
    layers: Sequence[tuple[np.ndarray, np.ndarray]],
    source: DType,
    wire: DType,
) -> KvCache:
    """A whole KV (in the engine's ``source`` dtype) converted for the wire, with its header."""
    encoded = [encode_layer(k, v, source, wire) for k, v in layers]
    return KvCache(
        wire_header(request_id, epoch, fingerprint, encoded, wire),
        tuple((e.k, e.v) for e in encoded),
        scales=tuple(e.scales for e in encoded if e.scales is not None),
    )


def wire_header(
    request_id: str, epoch: int, fingerprint: str, encoded: Sequence[EncodedLayer], wire: DType
) -> KvHeader:
    """The header of a transfer of ``encoded`` layers in ``wire`` (scaled when fp8)."""
    header = header_for(request_id, epoch, fingerprint, wire, [(e.k, e.v) for e in encoded])
    return replace(header, scales=scale_layout(wire))


def round_trip(
    layers: Sequence[tuple[np.ndarray, np.ndarray]], source: DType, wire: DType
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Exactly what a transfer in ``wire`` does to ``layers`` (in ``source``), without a
    network: convert, encode to the wire format, strictly decode, convert back to ``source``.
    `pdorch bench precision` compares generation with and without it."""
    cache = encode_cache("round-trip", 0, "round-trip", layers, source, wire)
    buf = b"".join(bytes(b) for b in encode_kv(cache))
    got = decode_kv(buf, Expectation(max_kv_bytes=cache.nbytes))
    return [(k.copy(), v.copy()) for k, v in decode_layers(got, source)]
