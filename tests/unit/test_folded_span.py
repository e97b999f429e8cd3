"""The folded one-sided sender takes a KV laid out as on the wire as one span
(`transport.kv_bytes.span`), and anything else layer by layer: the span must cover exactly
the layers' bytes, in wire order, inside the allocation that owns them. A small eager KV
is joined instead (`transport.kv_bytes.joined`), in wire order whatever its layout, only
when every tensor has the header's shape and item size."""

from __future__ import annotations

import numpy as np
import pytest

from transport import testing, wire
from transport.kv_bytes import joined as _joined
from transport.kv_bytes import span as _span


def _cache(layers: list[tuple[np.ndarray, np.ndarray]]) -> wire.KvCache:
    header = wire.header_for("s", 1, testing.FINGERPRINT, wire.DType.FLOAT32, layers)
    return wire.KvCache(header, tuple(layers))


def _wire_bytes(cache: wire.KvCache) -> bytes:
    return b"".join(bytes(t.data) for k, v in cache.layers for t in (k, v))


def test_a_kv_in_wire_order_is_one_span_of_exactly_its_bytes() -> None:
    cache = testing.synthetic_cache("s", 1, 64 * testing.KIB, n_layers=8)
    span = _span(cache.header, cache)
    assert span is not None
    assert bytes(span) == _wire_bytes(cache)


def test_a_kv_inside_a_larger_allocation_is_the_span_of_its_part() -> None:
    block = np.arange(1000, dtype=np.float32)
    layers = [
        (block[100 + 20 * i : 110 + 20 * i], block[110 + 20 * i : 120 + 20 * i]) for i in range(3)
    ]
    cache = _cache(layers)
    span = _span(cache.header, cache)
    assert span is not None
    assert bytes(span) == _wire_bytes(cache)
    assert isinstance(span.obj, np.ndarray)  # the registry finds the owning allocation


@pytest.mark.parametrize(
    "layout",
    ["layers-reversed", "v-before-k", "a-gap", "apart", "read-only", "not-owned", "shapes"],
)
def test_any_other_layout_goes_layer_by_layer(layout: str) -> None:
    block = np.arange(80, dtype=np.float32)
    pairs = [(block[32 * i : 32 * i + 16], block[32 * i + 16 : 32 * i + 32]) for i in range(2)]
    if layout == "layers-reversed":
        pairs = pairs[::-1]
    elif layout == "v-before-k":
        pairs = [(v, k) for k, v in pairs]
    elif layout == "a-gap":  # layer 1 starts one value late
        pairs = [pairs[0], (block[33:49], block[49:65])]
    elif layout == "apart":
        pairs = [(k.copy(), v.copy()) for k, v in pairs]
    elif layout == "read-only":
        block.flags.writeable = False
    elif layout == "not-owned":
        raw = bytearray(block.tobytes())
        flat = np.frombuffer(raw, np.float32)
        pairs = [(flat[32 * i : 32 * i + 16], flat[32 * i + 16 : 32 * i + 32]) for i in range(2)]
    cache = _cache(pairs)
    if layout == "shapes":  # the header says otherwise: the layer-by-layer path says where
        other = _cache([(k.reshape(4, 4), v.reshape(4, 4)) for k, v in pairs])
        cache = wire.KvCache(other.header, cache.layers)
    assert _span(cache.header, cache) is None


def test_scaled_or_empty_kvs_go_layer_by_layer() -> None:
    scaled = testing.scaled_cache("s", 1, 4096, n_layers=2)
    assert _span(scaled.header, scaled) is None
    empty = _cache([(np.zeros((1, 0), np.float32), np.zeros((1, 0), np.float32))])
    assert _span(empty.header, empty) is None


@pytest.mark.parametrize("layout", ["wire-order", "layers-reversed", "v-before-k", "apart"])
def test_a_small_kv_is_joined_in_wire_order_whatever_its_layout(layout: str) -> None:
    block = np.arange(80, dtype=np.float32)
    pairs = [(block[32 * i : 32 * i + 16], block[32 * i + 16 : 32 * i + 32]) for i in range(2)]
    if layout == "layers-reversed":
        pairs = pairs[::-1]
    elif layout == "v-before-k":
        pairs = [(v, k) for k, v in pairs]
    elif layout == "apart":
        pairs = [(k.copy(), v.copy()) for k, v in pairs]
    cache = _cache(pairs)
    joined = _joined(cache.header, cache)
    assert joined is not None
    assert bytes(joined) == _wire_bytes(cache)
    assert not np.shares_memory(np.frombuffer(joined, np.uint8), block)  # a copy


@pytest.mark.parametrize("fault", ["shapes", "itemsize", "not-contiguous", "scaled", "empty"])
def test_a_kv_unlike_its_header_is_not_joined(fault: str) -> None:
    block = np.arange(64, dtype=np.float32)
    pairs = [(block[32 * i : 32 * i + 16], block[32 * i + 16 : 32 * i + 32]) for i in range(2)]
    cache = _cache(pairs)
    if fault == "shapes":  # as many bytes, another shape
        other = _cache([(k.reshape(4, 4), v.reshape(4, 4)) for k, v in pairs])
        cache = wire.KvCache(other.header, cache.layers)
    elif fault == "itemsize":  # the same shapes, half the bytes
        cache = wire.KvCache(cache.header, tuple((k.astype(np.float16), v) for k, v in pairs))
    elif fault == "not-contiguous":
        wide = np.arange(32, dtype=np.float32)
        cache = wire.KvCache(cache.header, ((wide[::2], pairs[0][1]), pairs[1]))
    elif fault == "scaled":
        cache = testing.scaled_cache("s", 1, 4096, n_layers=2)
    elif fault == "empty":
        cache = _cache([(np.zeros((1, 0), np.float32), np.zeros((1, 0), np.float32))])
    assert _joined(cache.header, cache) is None
