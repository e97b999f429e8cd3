"""The KV-cache wire format (`transport.wire`): round trips, strict decoding, hostile input.

Hostile bytes must only ever raise `WireFormatError` (or a subclass), and must be refused
before anything close to the size they *declare* is allocated. Headers are built here by
hand from the format described in `transport/wire.py`'s docstring, independently of the
encoder, so that every check of the decoder can be reached on its own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import struct
import tracemalloc
import unicodedata
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from transport.errors import (
    ChecksumMismatchError,
    HeaderRejectedError,
    StaleEpochError,
    WireFormatError,
)
from transport.wire import (
    FORMAT_VERSION,
    HEADER_PREFIX,
    LAYER_FRAME_SIZE,
    LAYER_MAGIC,
    MAGIC,
    MAX_HEADER_BYTES,
    MAX_ID_BYTES,
    MAX_LAYERS,
    MAX_NDIM,
    ChecksumAlgo,
    DType,
    Expectation,
    KvCache,
    KvHeader,
    LayerFrame,
    LayerShape,
    ModelSpec,
    as_bytes_view,
    assemble,
    check_expected,
    check_layer_frame,
    checksum,
    decode_header,
    decode_kv,
    decode_layer_frame,
    encode_header,
    encode_kv,
    encode_layer_frame,
    header_for,
    header_length,
    layer_frame_for,
    layer_views,
    verify_layer,
)
from transport.wire import segments as wire_segments

# ------------------------------------------------------------------ the format, restated

PREFIX = struct.Struct("<4sHHI")  # magic, version, flags, header_len
BODY = struct.Struct("<QIBBHHHQ")  # epoch, tokens, dtype, algo, n_layers, rid_len, fp_len, payload
FRAME = struct.Struct("<4sHHQQ")  # magic, index, flags, nbytes, checksum
SUM = struct.Struct("<Q")
MIN_HEADER = PREFIX.size + BODY.size + SUM.size
U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1
MiB = 1 << 20
BIG_LIMIT = 1 << 62  # a max_kv_bytes that lets any hostile declared size through the limit
ADDRESSABLE = 2**63 - 1  # numpy's limit on any array's extent in bytes, even an empty one's

FUZZ = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
FUZZ_SMALL = settings(FUZZ, max_examples=60)

Dims = tuple[int, ...]


def xxh(data: bytes) -> int:
    return int(xxhash.xxh3_64_intdigest(data))


def raw_header(
    *,
    layers: Sequence[tuple[Dims, Dims]] = (((2, 3, 4), (2, 3, 4)),),
    rid: bytes = b"req-1",
    fp: bytes = b"model-a",
    dtype: int = DType.FLOAT32,
    algo: int = ChecksumAlgo.XXH3_64,
    epoch: int = 7,
    tokens: int = 3,
    payload: int | None = None,
    n_layers: int | None = None,
    rid_len: int | None = None,
    fp_len: int | None = None,
    magic: bytes = MAGIC,
    version: int = 1,
    flags: int = 0,
    total: int | None = None,
    extra: bytes = b"",
    bad_sum: bool = False,
) -> bytes:
    """A header built field by field; every field may lie. Signed unless ``bad_sum``."""
    if payload is None:
        itemsize = DType(dtype).itemsize if dtype in set(DType) else 1
        payload = min(U64_MAX, sum(math.prod(k) + math.prod(v) for k, v in layers) * itemsize)
    body = BODY.pack(
        epoch,
        tokens,
        dtype,
        algo,
        len(layers) if n_layers is None else n_layers,
        len(rid) if rid_len is None else rid_len,
        len(fp) if fp_len is None else fp_len,
        payload,
    )
    shapes = b"".join(
        bytes((len(k), len(v))) + struct.pack(f"<{len(k) + len(v)}I", *k, *v) for k, v in layers
    )
    rest = body + rid + fp + shapes + extra
    length = PREFIX.size + len(rest) + SUM.size if total is None else total
    head = PREFIX.pack(magic, version, flags, length) + rest
    digest = xxh(head) ^ (1 if bad_sum else 0)
    return head + SUM.pack(digest)


def raw_frame(
    index: int, payload: bytes, *, nbytes: int | None = None, magic: bytes = LAYER_MAGIC
) -> bytes:
    return FRAME.pack(magic, index, 0, len(payload) if nbytes is None else nbytes, xxh(payload))


def transfer(header: bytes, frames: Sequence[tuple[int, bytes]]) -> bytes:
    """A whole transfer: ``header`` then, for each (index, payload), a frame and the payload."""
    return header + b"".join(raw_frame(i, p) + p for i, p in frames)


def joined(bufs: Sequence[memoryview | bytes]) -> bytes:
    return b"".join(bytes(b) for b in bufs)


def random_tensor(rng: np.random.Generator, shape: Dims, dtype: DType) -> np.ndarray:
    nbytes = math.prod(shape) * dtype.itemsize
    raw = rng.integers(0, 256, size=nbytes, dtype=np.uint8)
    return raw.view(dtype.numpy_dtype).reshape(shape)


def make_cache(
    shapes: Sequence[tuple[Dims, Dims]],
    *,
    dtype: DType = DType.FLOAT16,
    rid: str = "req-1",
    fp: str = "model-a",
    epoch: int = 7,
    tokens: int | None = None,
    seed: int = 0,
) -> KvCache:
    rng = np.random.default_rng(seed)
    layers = tuple((random_tensor(rng, k, dtype), random_tensor(rng, v, dtype)) for k, v in shapes)
    header = header_for(rid, epoch, fp, dtype, layers)
    if tokens is not None:
        header = KvHeader(rid, epoch, fp, dtype, tokens, header.layers)
    return KvCache(header, layers)


def payload_of(cache: KvCache, index: int) -> bytes:
    k, v = cache.layers[index]
    return k.tobytes() + v.tobytes()


def assert_same_cache(got: KvCache, want: KvCache) -> None:
    assert got.header == want.header
    assert got.nbytes == want.nbytes
    assert len(got.layers) == len(want.layers)
    for (gk, gv), (wk, wv) in zip(got.layers, want.layers, strict=True):
        for g, w in ((gk, wk), (gv, wv)):
            assert g.dtype == w.dtype == want.header.dtype.numpy_dtype
            assert g.shape == w.shape
            assert g.tobytes() == w.tobytes()  # bitwise: NaN payloads must survive too


def loose(cache: KvCache) -> Expectation:
    return Expectation(max_kv_bytes=cache.nbytes)


def must_refuse(decode: Callable[[], object]) -> WireFormatError:
    """Run ``decode``; it must raise a WireFormatError (anything else fails the test)."""
    with pytest.raises(WireFormatError) as info:
        decode()
    return info.value


@contextlib.contextmanager
def traced_peak() -> Iterator[list[int]]:
    """Yields a list that holds the peak traced allocation (bytes) once the block exits."""
    out: list[int] = []
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        yield out
        out.append(tracemalloc.get_traced_memory()[1])
    finally:
        tracemalloc.stop()


# Small but complete transfer, used wherever a test walks every byte offset.
SMALL = make_cache([((1, 2, 2), (1, 2, 2)), ((1, 2, 2), (1, 2, 2))], rid="r", fp="fp", seed=1)
SMALL_BYTES = joined(encode_kv(SMALL))
SMALL_HEADER = encode_header(SMALL.header)
SMALL_EXP = Expectation(max_kv_bytes=SMALL.nbytes, request_id="r", min_epoch=SMALL.header.epoch)


def payload_offsets(cache: KvCache) -> list[int]:
    """Offsets, in the encoded transfer, of every payload byte."""
    out, pos = [], len(encode_header(cache.header))
    for i in range(len(cache.layers)):
        pos += LAYER_FRAME_SIZE
        n = cache.header.layer_nbytes(i)
        out.extend(range(pos, pos + n))
        pos += n
    return out


def frame_offsets(cache: KvCache) -> list[int]:
    out, pos = [], len(encode_header(cache.header))
    for i in range(len(cache.layers)):
        out.append(pos)
        pos += LAYER_FRAME_SIZE + cache.header.layer_nbytes(i)
    return out


# ------------------------------------------------------------------ strategies

ids = st.text(st.characters(codec="utf-8"), min_size=1, max_size=MAX_ID_BYTES // 4)
dims = st.lists(st.integers(0, 3), min_size=1, max_size=MAX_NDIM).map(tuple)
shape_pairs = st.lists(st.tuples(dims, dims), min_size=1, max_size=4)
epochs = st.integers(0, U64_MAX)


@st.composite
def caches(draw: st.DrawFn) -> KvCache:
    shapes = draw(shape_pairs)
    return make_cache(
        shapes,
        dtype=draw(st.sampled_from(DType)),
        rid=draw(ids),
        fp=draw(ids),
        epoch=draw(epochs),
        tokens=draw(st.integers(0, U32_MAX)),
        seed=draw(st.integers(0, U32_MAX)),
    )


def addressable(ds: list[int]) -> Dims:
    """Shrink dims that would take a tensor (of any dtype) past what numpy can address."""
    out, extent = [], 4
    for d in ds:
        kept = d if extent * max(d, 1) <= ADDRESSABLE else 0
        extent *= max(kept, 1)
        out.append(kept)
    return tuple(out)


wide_dims = st.lists(st.integers(0, U32_MAX), min_size=1, max_size=MAX_NDIM).map(addressable)


@st.composite
def headers(draw: st.DrawFn) -> KvHeader:
    pairs = draw(st.lists(st.tuples(wide_dims, wide_dims), min_size=1, max_size=8))
    layers = tuple(LayerShape(k, v) for k, v in pairs)
    return KvHeader(
        request_id=draw(ids),
        epoch=draw(epochs),
        fingerprint=draw(ids),
        dtype=draw(st.sampled_from(DType)),
        token_count=draw(st.integers(0, U32_MAX)),
        layers=layers,
    )


Mutation = tuple[str, int, int]
mutations = st.tuples(
    st.sampled_from(["flip", "insert", "delete", "truncate"]),
    st.integers(0, 1 << 16),
    st.integers(1, 255),
)


def mutate(buf: bytearray, m: Mutation) -> None:
    op, where, value = m
    if op == "insert":
        pos = where % (len(buf) + 1)
        buf[pos:pos] = bytes((value,))
        return
    if not buf:
        return
    pos = where % len(buf)
    if op == "flip":
        buf[pos] ^= value  # value is never 0: the byte always changes
    elif op == "delete":
        del buf[pos]
    else:
        del buf[pos:]


def resign(header: bytearray) -> bytearray:
    """Make a (mutated) header self-consistent again: fix its length and its checksum."""
    if len(header) >= PREFIX.size:
        struct.pack_into("<I", header, 8, len(header))
    if len(header) >= PREFIX.size + SUM.size:
        SUM.pack_into(header, len(header) - SUM.size, xxh(bytes(header[: -SUM.size])))
    return header


# ------------------------------------------------------------------ the format itself


def test_layout_matches_the_documented_format() -> None:
    assert HEADER_PREFIX == PREFIX.size == 12
    assert LAYER_FRAME_SIZE == FRAME.size == 24
    header = KvHeader("req-1", 7, "model-a", DType.FLOAT32, 3, (LayerShape((2, 3, 4), (2, 3, 4)),))
    assert encode_header(header) == raw_header()
    assert decode_header(raw_header(), 1 << 20) == header


def test_encoding_is_exactly_header_then_frame_and_k_and_v_per_layer() -> None:
    bufs = encode_kv(SMALL)
    assert len(bufs) == 1 + 3 * len(SMALL.layers)
    want = SMALL_HEADER + b"".join(
        raw_frame(i, payload_of(SMALL, i)) + payload_of(SMALL, i) for i in range(len(SMALL.layers))
    )
    assert want == SMALL_BYTES


def test_dtype_itemsizes_and_numpy_containers() -> None:
    assert {d: (d.itemsize, d.numpy_dtype) for d in DType} == {
        DType.FLOAT32: (4, np.dtype(np.float32)),
        DType.FLOAT16: (2, np.dtype(np.float16)),
        DType.BFLOAT16: (2, np.dtype(np.uint16)),
        DType.FLOAT8_E4M3: (1, np.dtype(np.uint8)),
    }


def test_header_sizes_and_offsets() -> None:
    h = KvHeader(
        "r", 0, "f", DType.FLOAT16, 2, (LayerShape((1, 2), (1, 2)), LayerShape((3,), (1, 1)))
    )
    assert [h.layer_nbytes(i) for i in range(2)] == [8, 8]
    assert h.layers[1].k_nbytes(h.dtype) == 6
    assert h.payload_bytes == 16
    assert h.layer_offsets() == [0, 8]


def test_header_for_takes_tokens_from_the_second_to_last_dim_of_k() -> None:
    k = np.zeros((4, 9, 2), np.float32)
    h = header_for("r", 1, "f", DType.FLOAT32, [(k, k)])
    assert h.token_count == 9
    assert h.layers == (LayerShape((4, 9, 2), (4, 9, 2)),)
    one_dim = np.zeros(5, np.float32)
    assert header_for("r", 1, "f", DType.FLOAT32, [(one_dim, one_dim)]).token_count == 0


def test_layer_frame_for_checksums_k_then_v() -> None:
    k, v = SMALL.layers[1]
    frame = layer_frame_for(1, k, v)
    assert frame == LayerFrame(1, k.nbytes + v.nbytes, xxh(k.tobytes() + v.tobytes()))
    assert checksum(k.tobytes(), v.tobytes()) == checksum(k.tobytes() + v.tobytes())


def test_non_contiguous_tensors_are_refused_at_encode() -> None:
    a = np.zeros((4, 4), np.float32)
    with pytest.raises(WireFormatError, match="C-contiguous"):
        as_bytes_view(a.T)
    with pytest.raises(WireFormatError, match="C-contiguous"):
        as_bytes_view(a[:, ::2])
    assert as_bytes_view(a[1:3]).nbytes == 32


def test_a_header_too_large_to_send_is_refused_at_encode() -> None:
    big = (1, 1, 1, 1, 1, 1)
    h = KvHeader("r", 0, "f", DType.FLOAT32, 1, (LayerShape(big, big),) * 1400)
    with pytest.raises(WireFormatError, match="exceeds"):
        encode_header(h)


def test_the_largest_valid_header_round_trips() -> None:
    big = (1, 1, 1, 1, 1, 1)
    h = KvHeader(
        "r" * MAX_ID_BYTES,
        U64_MAX,
        "f" * MAX_ID_BYTES,
        DType.FLOAT8_E4M3,
        U32_MAX,
        (LayerShape(big, big),) * MAX_LAYERS,
    )
    encoded = encode_header(h)
    assert len(encoded) <= MAX_HEADER_BYTES
    assert decode_header(encoded, h.payload_bytes) == h


# ------------------------------------------------------------------ round trips (properties)


@FUZZ
@given(cache=caches())
def test_kv_round_trip(cache: KvCache) -> None:
    bufs = encode_kv(cache)
    exp = Expectation(
        max_kv_bytes=cache.nbytes,  # the exact size is within the limit
        request_id=cache.header.request_id,
        min_epoch=cache.header.epoch,  # an equal epoch is not stale
        dtypes=frozenset({cache.header.dtype}),
    )
    decoded = decode_kv(joined(bufs), exp)
    assert_same_cache(decoded, cache)
    # Also from a memoryview and a bytearray, and the result never aliases the input.
    src = bytearray(joined(bufs))
    assert_same_cache(decode_kv(memoryview(src), exp), cache)
    again = decode_kv(src, exp)
    src[:] = bytes(len(src))
    assert_same_cache(again, cache)


@FUZZ
@given(header=headers())
def test_header_round_trip(header: KvHeader) -> None:
    encoded = encode_header(header)
    assert header_length(encoded[:HEADER_PREFIX]) == len(encoded)
    assert decode_header(encoded, header.payload_bytes) == header
    assert decode_header(memoryview(encoded), header.payload_bytes) == header


@FUZZ
@given(index=st.integers(0, 2**16 - 1), nbytes=epochs, csum=epochs)
def test_layer_frame_round_trip(index: int, nbytes: int, csum: int) -> None:
    frame = LayerFrame(index, nbytes, csum)
    encoded = encode_layer_frame(frame)
    assert len(encoded) == LAYER_FRAME_SIZE
    assert decode_layer_frame(encoded) == frame


@FUZZ
@given(cache=caches(), data=st.data())
def test_layers_may_arrive_in_any_order(cache: KvCache, data: st.DataObject) -> None:
    order = data.draw(st.permutations(range(len(cache.layers))))
    buf = transfer(encode_header(cache.header), [(i, payload_of(cache, i)) for i in order])
    assert_same_cache(decode_kv(buf, loose(cache)), cache)


@FUZZ_SMALL
@given(
    tokens=st.integers(1, 8),
    heads=st.integers(1, 3),
    head_dim=st.integers(1, 4),
    n_layers=st.integers(1, 4),
    dtype=st.sampled_from(DType),
)
def test_round_trip_against_a_model_spec(
    tokens: int, heads: int, head_dim: int, n_layers: int, dtype: DType
) -> None:
    model = ModelSpec("model-a", n_layers, heads, head_dim, max_tokens=8)
    shape = (heads, tokens, head_dim)
    cache = make_cache([(shape, shape)] * n_layers, dtype=dtype, fp="model-a")
    exp = Expectation(max_kv_bytes=cache.nbytes, model=model)
    assert_same_cache(decode_kv(joined(encode_kv(cache)), exp), cache)


# ------------------------------------------------------------------ hostile input (properties)


@FUZZ
@given(junk=st.binary(max_size=512), limit=st.sampled_from([0, 1 << 20, BIG_LIMIT]))
def test_random_bytes_only_raise_wire_format_errors(junk: bytes, limit: int) -> None:
    must_refuse(lambda: decode_kv(junk, Expectation(max_kv_bytes=limit)))
    with contextlib.suppress(WireFormatError):
        decode_header(junk, limit)
    with contextlib.suppress(WireFormatError):
        decode_layer_frame(junk)
    with contextlib.suppress(WireFormatError):
        header_length(junk)


@FUZZ
@given(junk=st.binary(min_size=MIN_HEADER, max_size=600), limit=st.sampled_from([0, BIG_LIMIT]))
def test_random_bytes_behind_a_valid_prefix_only_raise_wire_format_errors(
    junk: bytes, limit: int
) -> None:
    header = resign(bytearray(PREFIX.pack(MAGIC, FORMAT_VERSION, 0, 0) + junk))
    must_refuse(lambda: decode_kv(bytes(header), Expectation(max_kv_bytes=limit)))
    with contextlib.suppress(WireFormatError):
        decode_header(bytes(header), limit)


@FUZZ
@given(cache=caches(), m=mutations)
def test_any_single_mutation_of_a_valid_transfer_is_detected(cache: KvCache, m: Mutation) -> None:
    buf = bytearray(joined(encode_kv(cache)))
    mutate(buf, m)
    must_refuse(lambda: decode_kv(bytes(buf), loose(cache)))


@FUZZ
@given(
    cache=caches(),
    header_ops=st.lists(mutations, max_size=4),
    body_ops=st.lists(mutations, max_size=3),
    sign=st.booleans(),
    limit=st.sampled_from([0, 64, 1 << 20, BIG_LIMIT]),
)
def test_mutated_and_resigned_transfers_only_raise_wire_format_errors(
    cache: KvCache,
    header_ops: list[Mutation],
    body_ops: list[Mutation],
    sign: bool,
    limit: int,
) -> None:
    bufs = encode_kv(cache)
    header, body = bytearray(bufs[0]), bytearray(joined(bufs[1:]))
    for m in header_ops:
        mutate(header, m)
    for m in body_ops:
        mutate(body, m)
    if sign:  # get past the checksum so the mutation reaches the field parsers
        resign(header)
    exp = Expectation(max_kv_bytes=limit)
    with contextlib.suppress(WireFormatError):
        decode_kv(bytes(header + body), exp)
    with contextlib.suppress(WireFormatError):
        decode_header(bytes(header), limit)


@FUZZ
@given(
    dtype=st.one_of(st.sampled_from(DType), st.integers(0, 255)),
    algo=st.one_of(st.just(int(ChecksumAlgo.XXH3_64)), st.integers(0, 255)),
    n_layers=st.one_of(st.none(), st.integers(0, 2**16 - 1)),
    rid=st.one_of(st.just(b"r"), st.binary(max_size=8)),
    rid_len=st.one_of(st.none(), st.integers(0, 2**16 - 1)),
    fp=st.one_of(st.just(b"f"), st.binary(max_size=8)),
    layers=st.lists(
        st.tuples(
            st.lists(st.sampled_from([0, 1, 2, 3, 2**16, U32_MAX]), max_size=MAX_NDIM + 1),
            st.lists(st.sampled_from([0, 1, 2, 3, 2**16, U32_MAX]), max_size=MAX_NDIM + 1),
        ).map(lambda kv: (tuple(kv[0]), tuple(kv[1]))),
        max_size=3,
    ),
    payload=st.one_of(st.none(), st.integers(0, U64_MAX)),
    extra=st.one_of(st.just(b""), st.binary(max_size=4)),
    limit=st.sampled_from([0, 100, BIG_LIMIT]),
)
def test_headers_with_arbitrary_fields_decode_canonically_or_not_at_all(
    dtype: int,
    algo: int,
    n_layers: int | None,
    rid: bytes,
    rid_len: int | None,
    fp: bytes,
    layers: list[tuple[Dims, Dims]],
    payload: int | None,
    extra: bytes,
    limit: int,
) -> None:
    buf = raw_header(
        dtype=dtype,
        algo=algo,
        n_layers=n_layers,
        rid=rid,
        rid_len=rid_len,
        fp=fp,
        layers=layers,
        payload=payload,
        extra=extra,
    )
    try:
        header = decode_header(buf, limit)
    except WireFormatError:
        return
    # Whatever is accepted is canonical: it re-encodes to the very same bytes, and within
    # bounds that the rest of the pipeline relies on.
    assert encode_header(header) == buf
    assert header.payload_bytes <= limit
    assert 1 <= len(header.layers) <= MAX_LAYERS
    check_expected(header, Expectation(max_kv_bytes=limit))
    if header.payload_bytes <= MiB:  # arrays of the declared shapes can be made, even empty ones
        cache = assemble(header, np.zeros(header.payload_bytes, np.uint8))
        assert [(k.shape, v.shape) for k, v in cache.layers] == [
            (layer.k, layer.v) for layer in header.layers
        ]


edge_dims = st.lists(
    st.sampled_from([0, 1, 3, 1 << 30, 1 << 31, U32_MAX]), min_size=1, max_size=MAX_NDIM
).map(tuple)


@FUZZ
@given(
    layers=st.lists(st.tuples(edge_dims, edge_dims), min_size=1, max_size=3),
    dtype=st.sampled_from(DType),
)
def test_every_header_that_decodes_can_be_assembled(
    layers: list[tuple[Dims, Dims]], dtype: DType
) -> None:
    """Empty tensors (a zero dim) with huge other dims must not get past the header."""
    buf = raw_header(layers=layers, dtype=dtype)
    try:
        header = decode_header(buf, BIG_LIMIT)
    except WireFormatError:
        return
    if header.payload_bytes <= MiB:
        cache = assemble(header, np.zeros(header.payload_bytes, np.uint8))
        assert [(k.shape, v.shape) for k, v in cache.layers] == list(layers)


@FUZZ
@given(
    dims=st.lists(st.integers(1, 5), min_size=1, max_size=3).map(tuple),
    n=st.integers(1, 6),
    dtype=st.sampled_from([DType.FLOAT32, DType.FLOAT16]),
)
def test_uniform_layers_are_assembled_as_the_general_path_views_them(
    dims: Dims, n: int, dtype: DType
) -> None:
    header = decode_header(raw_header(layers=[(dims, dims)] * n, dtype=dtype), BIG_LIMIT)
    payload = np.arange(header.payload_bytes, dtype=np.uint64).astype(np.uint8)
    cache = assemble(header, payload)
    for (k, v), (_, k2, v2) in zip(cache.layers, layer_views(header, payload), strict=True):
        assert k.shape == k2.shape
        assert v.shape == v2.shape
        assert k.dtype == k2.dtype
        assert k.tobytes() == k2.tobytes()
        assert v.tobytes() == v2.tobytes()
        assert np.shares_memory(k, payload)
        assert k.flags.c_contiguous


@FUZZ_SMALL
@given(
    layers=st.lists(
        st.tuples(
            st.lists(st.integers(1, U32_MAX), min_size=1, max_size=MAX_NDIM).map(tuple),
            st.lists(st.integers(1, U32_MAX), min_size=1, max_size=MAX_NDIM).map(tuple),
        ),
        min_size=1,
        max_size=4,
    ),
    tail=st.binary(max_size=256),
)
def test_decoding_never_allocates_what_a_hostile_header_declares(
    layers: list[tuple[Dims, Dims]], tail: bytes
) -> None:
    header = raw_header(layers=layers, dtype=DType.FLOAT8_E4M3)
    declared = sum(math.prod(k) + math.prod(v) for k, v in layers)
    with traced_peak() as peak:
        must_refuse(lambda: decode_kv(header + tail, Expectation(max_kv_bytes=U64_MAX)))
    if declared > 64 * MiB:
        assert peak[0] < 4 * MiB


# ------------------------------------------------------------------ memory bounds (explicit)


def test_tracemalloc_sees_numpy_buffers() -> None:
    """The memory-bound tests below would prove nothing if numpy allocations went unseen."""
    with traced_peak() as peak:
        np.empty(32 * MiB, np.uint8)
    assert peak[0] >= 32 * MiB


@pytest.mark.parametrize(
    "layers",
    [
        pytest.param([((1 << 20, 1 << 9), (1 << 20, 1 << 9))], id="4GiB-one-layer"),
        pytest.param([((U32_MAX, U32_MAX), (U32_MAX, U32_MAX))], id="2^65-one-layer"),
        pytest.param([((8, 1 << 16, 128), (8, 1 << 16, 128))] * 64, id="64-layers-of-256MiB"),
        pytest.param([((U32_MAX,) * MAX_NDIM, (U32_MAX,) * MAX_NDIM)], id="2^193-six-dims"),
    ],
)
@pytest.mark.parametrize("tail", [b"", b"\0" * 100, raw_frame(0, b"x" * 64) + b"x" * 64])
def test_a_huge_declared_payload_is_refused_without_allocating_it(
    layers: list[tuple[Dims, Dims]], tail: bytes
) -> None:
    header = raw_header(layers=layers)
    with traced_peak() as peak:
        must_refuse(lambda: decode_kv(header + tail, Expectation(max_kv_bytes=U64_MAX)))
        must_refuse(lambda: decode_kv(header + tail, Expectation(max_kv_bytes=BIG_LIMIT)))
        with contextlib.suppress(WireFormatError):
            decode_header(header, BIG_LIMIT)  # a header alone allocates no payload either
    assert peak[0] < 4 * MiB


def test_a_header_length_at_the_limit_is_refused_without_reading_past_the_buffer() -> None:
    buf = PREFIX.pack(MAGIC, FORMAT_VERSION, 0, MAX_HEADER_BYTES) + b"\0" * 20
    with traced_peak() as peak:
        exc = must_refuse(lambda: decode_kv(buf, Expectation(max_kv_bytes=BIG_LIMIT)))
    assert "truncated" in str(exc)
    assert peak[0] < MiB


def test_a_model_mismatch_is_refused_before_the_payload_is_allocated() -> None:
    shape = (8, 1 << 16, 128)
    header = raw_header(layers=[(shape, shape)] * 4, fp=b"other", tokens=1 << 16)
    declared = 4 * 2 * math.prod(shape) * 4
    body = b"\0" * 64
    exp = Expectation(
        max_kv_bytes=declared, model=ModelSpec("model-a", 4, 8, 128, max_tokens=1 << 16)
    )
    with traced_peak() as peak, pytest.raises(HeaderRejectedError, match="fingerprint"):
        decode_kv(header + body, exp)
    assert peak[0] < 4 * MiB


# ------------------------------------------------------------------ named errors (explicit)


@pytest.mark.parametrize("magic", [b"PDKW", b"\0\0\0\0", b"VKDP", b"pdkv", LAYER_MAGIC])
def test_unknown_magic(magic: bytes) -> None:
    buf = raw_header(magic=magic)
    for decode in (
        lambda: header_length(buf[:HEADER_PREFIX]),
        lambda: decode_header(buf, 1 << 20),
        lambda: decode_kv(buf, Expectation(max_kv_bytes=1 << 20)),
    ):
        assert type(must_refuse(decode)) is WireFormatError
    with pytest.raises(WireFormatError, match="bad magic"):
        decode_kv(buf, Expectation(max_kv_bytes=1 << 20))


@pytest.mark.parametrize("version", [0, FORMAT_VERSION + 1, 0xFFFF])
def test_unknown_version(version: int) -> None:
    buf = raw_header(version=version)
    with pytest.raises(WireFormatError, match="unsupported format version"):
        header_length(buf)
    with pytest.raises(WireFormatError, match="unsupported format version"):
        decode_kv(buf, Expectation(max_kv_bytes=1 << 20))


@pytest.mark.parametrize("flags", [1, 0x8000, 0xFFFF])
def test_unknown_header_flags(flags: int) -> None:
    with pytest.raises(WireFormatError, match="flags"):
        decode_header(raw_header(flags=flags), 1 << 20)


@pytest.mark.parametrize("code", [0, max(DType) + 1, 255])
def test_unknown_dtype(code: int) -> None:
    buf = raw_header(dtype=code, payload=2 * 24)
    with pytest.raises(WireFormatError, match="unknown dtype"):
        decode_header(buf, 1 << 20)
    exc = must_refuse(lambda: decode_kv(buf, Expectation(max_kv_bytes=1 << 20)))
    assert type(exc) is WireFormatError


@pytest.mark.parametrize("algo", [0, 2, 255])
def test_unknown_checksum_algorithm(algo: int) -> None:
    with pytest.raises(WireFormatError, match="unknown checksum algorithm"):
        decode_header(raw_header(algo=algo), 1 << 20)


@pytest.mark.parametrize("dtype", list(DType))
def test_a_dtype_not_accepted_by_the_receiver_is_rejected(dtype: DType) -> None:
    cache = make_cache([((1, 2), (1, 2))], dtype=dtype)
    others = frozenset(DType) - {dtype}
    with pytest.raises(HeaderRejectedError, match="not accepted"):
        decode_kv(joined(encode_kv(cache)), Expectation(cache.nbytes, dtypes=others))


@pytest.mark.parametrize("cut", range(len(SMALL_BYTES)))
def test_truncation_at_every_offset(cut: int) -> None:
    exc = must_refuse(lambda: decode_kv(SMALL_BYTES[:cut], SMALL_EXP))
    assert type(exc) is WireFormatError
    assert "truncated" in str(exc)
    if cut < len(SMALL_HEADER):
        with pytest.raises(WireFormatError, match="truncated"):
            decode_header(SMALL_HEADER[:cut], SMALL.nbytes)


def test_the_untruncated_small_transfer_decodes() -> None:
    assert_same_cache(decode_kv(SMALL_BYTES, SMALL_EXP), SMALL)


@pytest.mark.parametrize("tail", [b"\0", b"PDLY", b"x" * LAYER_FRAME_SIZE, SMALL_BYTES])
def test_trailing_bytes(tail: bytes) -> None:
    with pytest.raises(WireFormatError, match="trailing"):
        decode_kv(SMALL_BYTES + tail, SMALL_EXP)
    with pytest.raises(WireFormatError, match="trailing"):
        decode_header(SMALL_HEADER + tail, SMALL.nbytes)


@pytest.mark.parametrize(
    "total", [0, 1, HEADER_PREFIX, MIN_HEADER - 1, MAX_HEADER_BYTES + 1, 1 << 31, U32_MAX]
)
def test_header_length_outside_its_bounds(total: int) -> None:
    buf = raw_header(total=total)
    with pytest.raises(WireFormatError, match="header length"):
        header_length(buf)
    with pytest.raises(WireFormatError, match="header length"):
        decode_kv(buf + b"\0" * 64, Expectation(max_kv_bytes=BIG_LIMIT))


@pytest.mark.parametrize("total", [MIN_HEADER, 100, MAX_HEADER_BYTES])
def test_header_length_at_its_bounds_is_read(total: int) -> None:
    assert header_length(PREFIX.pack(MAGIC, FORMAT_VERSION, 0, total)) == total


@pytest.mark.parametrize("delta", [-1, 1, 8, MIN_HEADER - len(raw_header())])
def test_a_header_whose_length_field_lies_is_refused(delta: int) -> None:
    buf = raw_header(total=len(raw_header()) + delta)
    must_refuse(lambda: decode_header(buf, 1 << 20))
    must_refuse(lambda: decode_kv(buf, Expectation(1 << 20)))
    must_refuse(lambda: decode_kv(buf + b"\0" * 64, Expectation(1 << 20)))


def test_payload_beyond_max_kv_bytes() -> None:
    cache = make_cache([((2, 3, 4), (2, 3, 4))])
    encoded = joined(encode_kv(cache))
    header = encode_header(cache.header)
    assert decode_header(header, cache.nbytes) == cache.header
    with pytest.raises(WireFormatError, match="exceeds"):
        decode_header(header, cache.nbytes - 1)
    exc = must_refuse(lambda: decode_kv(encoded, Expectation(max_kv_bytes=cache.nbytes - 1)))
    assert type(exc) is WireFormatError
    with pytest.raises(WireFormatError, match="exceeds"):
        check_expected(cache.header, Expectation(max_kv_bytes=cache.nbytes - 1))
    with pytest.raises(WireFormatError, match="exceeds"):
        decode_header(raw_header(payload=U64_MAX), BIG_LIMIT)


@pytest.mark.parametrize(
    ("layers", "payload"),
    [
        pytest.param([((U32_MAX,) * 6, (U32_MAX,) * 6)], 16, id="six-max-dims-claim-16-bytes"),
        pytest.param([((U32_MAX, U32_MAX), (1,))], 8, id="product-past-u64-claims-8"),
        pytest.param([((1 << 16, 1 << 16), (1,))], 4, id="product-past-u32-claims-4"),
        pytest.param([((2, 3), (2, 3))], 47, id="one-byte-short"),
        pytest.param([((2, 3), (2, 3))], 49, id="one-byte-long"),
        pytest.param([((2, 3), (2, 3))] * 2, 48, id="second-layer-unaccounted"),
        pytest.param([((2, 3), (2, 3))], 0, id="claims-empty"),
    ],
)
def test_dims_that_do_not_add_up_to_the_declared_payload(
    layers: list[tuple[Dims, Dims]], payload: int
) -> None:
    buf = raw_header(layers=layers, payload=payload)
    # Dims past what can be addressed at all may be refused as such, before the sum.
    with pytest.raises(WireFormatError, match=r"declared payload|too large to address"):
        decode_header(buf, BIG_LIMIT)
    must_refuse(lambda: decode_kv(buf + b"\0" * 64, Expectation(max_kv_bytes=BIG_LIMIT)))


@pytest.mark.parametrize(
    "shape",
    [
        pytest.param((0, U32_MAX, U32_MAX, U32_MAX), id="zero-then-2^96"),
        pytest.param((U32_MAX, U32_MAX, 0), id="2^64-then-zero"),
        pytest.param((0, 1 << 31, 1 << 30), id="zero-then-exactly-2^63-bytes"),
    ],
)
def test_an_empty_tensor_with_huge_dims_is_refused(shape: Dims) -> None:
    """A zero dim makes the payload 0 bytes, but such a shape cannot even be viewed."""
    buf = raw_header(layers=[(shape, (1,))], payload=4)
    with pytest.raises(WireFormatError, match="too large to address"):
        decode_header(buf, BIG_LIMIT)
    buf += raw_frame(0, b"\0" * 4) + b"\0" * 4
    exc = must_refuse(lambda: decode_kv(buf, Expectation(max_kv_bytes=BIG_LIMIT)))
    assert type(exc) is WireFormatError


def test_an_empty_tensor_with_sensible_dims_round_trips() -> None:
    cache = make_cache([((2, 0, 3), (2, 0, 3)), ((0,), (1,))], dtype=DType.FLOAT32)
    assert cache.nbytes == 4
    assert_same_cache(decode_kv(joined(encode_kv(cache)), loose(cache)), cache)


@pytest.mark.parametrize("n_layers", [0, MAX_LAYERS + 1])
def test_layer_count_outside_its_bounds(n_layers: int) -> None:
    buf = raw_header(layers=[((1,), (1,))] * n_layers)
    with pytest.raises(WireFormatError, match="layer count"):
        decode_header(buf, 1 << 20)


@pytest.mark.parametrize(
    ("k", "v"),
    [((), (1,)), ((1,), ()), ((1,) * (MAX_NDIM + 1), (1,)), ((1,), (1,) * (MAX_NDIM + 1))],
)
def test_ndim_outside_its_bounds(k: Dims, v: Dims) -> None:
    with pytest.raises(WireFormatError, match="ndim"):
        decode_header(raw_header(layers=[(k, v)]), 1 << 20)


@pytest.mark.parametrize(
    ("rid", "fp"),
    [
        (b"", b"fp"),
        (b"r", b""),
        (b"r" * (MAX_ID_BYTES + 1), b"fp"),
        (b"r", b"f" * (MAX_ID_BYTES + 1)),
    ],
)
def test_id_lengths_outside_their_bounds(rid: bytes, fp: bytes) -> None:
    with pytest.raises(WireFormatError, match=r"1\.\.256 bytes"):
        decode_header(raw_header(rid=rid, fp=fp), 1 << 20)


@pytest.mark.parametrize(
    ("rid", "fp"), [(b"\xff", b"fp"), (b"r", b"\xc3"), (b"\xed\xa0\x80", b"fp")]
)
def test_ids_that_are_not_utf8(rid: bytes, fp: bytes) -> None:
    with pytest.raises(WireFormatError, match="UTF-8"):
        decode_header(raw_header(rid=rid, fp=fp), 1 << 20)


@pytest.mark.parametrize(
    "fields",
    [
        pytest.param({"rid_len": 200}, id="rid-runs-past-the-header"),
        pytest.param({"fp_len": 200}, id="fp-runs-past-the-header"),
        pytest.param({"n_layers": 2}, id="one-layer-more-than-present"),
        pytest.param({"n_layers": MAX_LAYERS}, id="many-layers-more-than-present"),
        pytest.param({"extra": b"\x01"}, id="one-unexplained-byte"),
        pytest.param({"extra": b"\x01\x01" + b"\0" * 8}, id="an-unannounced-layer"),
    ],
)
def test_header_fields_that_disagree_with_its_length(fields: dict[str, Any]) -> None:
    must_refuse(lambda: decode_header(raw_header(**fields), 1 << 20))


def test_a_layer_shape_cut_between_its_ndims_and_dims() -> None:
    buf = raw_header(layers=[((1,), (1,))], extra=b"\x01\x01\0\0\0", n_layers=2)
    with pytest.raises(WireFormatError, match="truncated in layer 1"):
        decode_header(buf, 1 << 20)


@pytest.mark.parametrize("offset", range(HEADER_PREFIX, len(SMALL_HEADER)))
def test_header_checksum_mismatch_at_every_offset(offset: int) -> None:
    buf = bytearray(SMALL_BYTES)
    buf[offset] ^= 0x40
    with pytest.raises(ChecksumMismatchError, match="header checksum"):
        decode_kv(bytes(buf), SMALL_EXP)
    with pytest.raises(ChecksumMismatchError, match="header checksum"):
        decode_header(bytes(buf[: len(SMALL_HEADER)]), SMALL.nbytes)


def test_header_checksum_mismatch_from_a_wrong_sum() -> None:
    with pytest.raises(ChecksumMismatchError):
        decode_header(raw_header(bad_sum=True), 1 << 20)


@pytest.mark.parametrize("offset", payload_offsets(SMALL))
def test_payload_checksum_mismatch_at_every_payload_byte(offset: int) -> None:
    buf = bytearray(SMALL_BYTES)
    buf[offset] ^= 0x01
    with pytest.raises(ChecksumMismatchError, match="payload checksum"):
        decode_kv(bytes(buf), SMALL_EXP)


@pytest.mark.parametrize("layer", range(len(SMALL.layers)))
def test_payload_checksum_mismatch_from_a_wrong_frame_sum(layer: int) -> None:
    buf = bytearray(SMALL_BYTES)
    buf[frame_offsets(SMALL)[layer] + 16] ^= 0x80  # the frame's checksum field
    with pytest.raises(ChecksumMismatchError, match=f"layer {layer}"):
        decode_kv(bytes(buf), SMALL_EXP)


def test_verify_layer() -> None:
    data = b"some payload bytes"
    verify_layer(LayerFrame(0, len(data), xxh(data)), memoryview(data))
    with pytest.raises(ChecksumMismatchError):
        verify_layer(LayerFrame(0, len(data), xxh(data) ^ 1), memoryview(data))


# -------------------------------------------------------------- duplicate / missing layers

TWO = make_cache([((1, 2, 2), (1, 2, 2)), ((1, 2, 2), (1, 2, 2))], seed=2)
TWO_HEADER = encode_header(TWO.header)
P0, P1 = payload_of(TWO, 0), payload_of(TWO, 1)


def test_hand_built_transfer_equals_the_encoder_output() -> None:
    assert transfer(TWO_HEADER, [(0, P0), (1, P1)]) == joined(encode_kv(TWO))
    assert_same_cache(decode_kv(transfer(TWO_HEADER, [(1, P1), (0, P0)]), loose(TWO)), TWO)


@pytest.mark.parametrize(
    "frames", [[(0, "P0"), (0, "P0")], [(1, "P1"), (1, "P1")], [(0, "P0"), (0, "P1")]]
)
def test_duplicate_layers(frames: list[tuple[int, str]]) -> None:
    payloads = {"P0": P0, "P1": P1}
    buf = transfer(TWO_HEADER, [(i, payloads[p]) for i, p in frames])
    with pytest.raises(WireFormatError, match="duplicate layer"):
        decode_kv(buf, loose(TWO))


@pytest.mark.parametrize("index", [2, 3, 0xFFFF])
def test_a_layer_beyond_the_declared_ones_in_place_of_a_missing_one(index: int) -> None:
    buf = transfer(TWO_HEADER, [(0, P0), (index, P1)])
    with pytest.raises(WireFormatError, match="beyond"):
        decode_kv(buf, loose(TWO))


def test_a_missing_last_layer_is_truncation() -> None:
    for frames in ([(0, P0)], [(1, P1)], []):
        with pytest.raises(WireFormatError, match="truncated"):
            decode_kv(transfer(TWO_HEADER, frames), loose(TWO))


def test_a_missing_layer_replaced_by_junk_of_the_same_length() -> None:
    junk = b"J" * (LAYER_FRAME_SIZE + len(P1))
    with pytest.raises(WireFormatError, match="bad layer frame magic"):
        decode_kv(transfer(TWO_HEADER, [(0, P0)]) + junk, loose(TWO))


def test_a_layer_frame_with_another_layers_length() -> None:
    cache = make_cache([((1, 1, 2), (1, 1, 2)), ((1, 3, 2), (1, 3, 2))], seed=3)
    a, b = payload_of(cache, 0), payload_of(cache, 1)
    header = encode_header(cache.header)
    # Same total length as a valid transfer, but frame 1 comes with layer 0's size.
    buf = header + raw_frame(1, a) + a + raw_frame(0, b) + b
    with pytest.raises(WireFormatError, match="carries"):
        decode_kv(buf, loose(cache))


def test_check_layer_frame_directly() -> None:
    h = TWO.header
    n = h.layer_nbytes(0)
    check_layer_frame(h, LayerFrame(0, n, 0), set())
    check_layer_frame(h, LayerFrame(1, n, 0), {0})
    with pytest.raises(WireFormatError, match="duplicate"):
        check_layer_frame(h, LayerFrame(0, n, 0), {0})
    with pytest.raises(WireFormatError, match="beyond"):
        check_layer_frame(h, LayerFrame(2, n, 0), set())
    with pytest.raises(WireFormatError, match="carries"):
        check_layer_frame(h, LayerFrame(0, n + 1, 0), set())


@pytest.mark.parametrize("size", [0, 1, LAYER_FRAME_SIZE - 1, LAYER_FRAME_SIZE + 1])
def test_layer_frame_of_the_wrong_size(size: int) -> None:
    buf = (encode_layer_frame(LayerFrame(0, 8, 1)) * 2)[:size]
    with pytest.raises(WireFormatError, match="layer frame must be"):
        decode_layer_frame(buf)


@pytest.mark.parametrize("magic", [MAGIC, b"PDLZ", b"\0\0\0\0"])
def test_layer_frame_magic(magic: bytes) -> None:
    with pytest.raises(WireFormatError, match="bad layer frame magic"):
        decode_layer_frame(FRAME.pack(magic, 0, 0, 8, 1))


@pytest.mark.parametrize("flags", [1, 0xFFFF])
def test_layer_frame_flags(flags: int) -> None:
    with pytest.raises(WireFormatError, match="flags"):
        decode_layer_frame(FRAME.pack(LAYER_MAGIC, 0, flags, 8, 1))
    buf = TWO_HEADER + FRAME.pack(LAYER_MAGIC, 0, flags, len(P0), xxh(P0)) + P0
    buf += raw_frame(1, P1) + P1
    must_refuse(lambda: decode_kv(buf, loose(TWO)))


# ------------------------------------------------------------------ expectations


def test_wrong_request_id() -> None:
    exp = Expectation(max_kv_bytes=SMALL.nbytes, request_id="s")
    with pytest.raises(HeaderRejectedError, match="expected 's'") as info:
        decode_kv(SMALL_BYTES, exp)
    assert not isinstance(info.value, StaleEpochError)


def test_request_ids_are_compared_byte_for_byte() -> None:
    nfc = "caf\u00e9"
    nfd = unicodedata.normalize("NFD", nfc)
    assert nfc != nfd
    cache = make_cache([((1,), (1,))], rid=nfc)
    buf = joined(encode_kv(cache))
    assert decode_kv(buf, Expectation(cache.nbytes, request_id=nfc)).header.request_id == nfc
    with pytest.raises(HeaderRejectedError):
        decode_kv(buf, Expectation(cache.nbytes, request_id=nfd))


@pytest.mark.parametrize("epoch", [0, 1, 7, U64_MAX - 1])
def test_stale_epoch(epoch: int) -> None:
    cache = make_cache([((1,), (1,))], epoch=epoch)
    buf = joined(encode_kv(cache))
    assert decode_kv(buf, Expectation(cache.nbytes, min_epoch=epoch)).header.epoch == epoch
    with pytest.raises(StaleEpochError, match=f"epoch {epoch} is older"):
        decode_kv(buf, Expectation(cache.nbytes, min_epoch=epoch + 1))
    with pytest.raises(StaleEpochError):
        check_expected(cache.header, Expectation(cache.nbytes, min_epoch=U64_MAX))


MODEL = ModelSpec("model-a", n_layers=2, kv_heads=2, head_dim=4, max_tokens=16)


def model_header(
    layers: Sequence[tuple[Dims, Dims]] | None = None,
    *,
    tokens: int = 5,
    fp: str = "model-a",
) -> KvHeader:
    good = (2, tokens, 4)
    shapes = [(good, good)] * 2 if layers is None else layers
    return KvHeader("r", 1, fp, DType.FLOAT16, tokens, tuple(LayerShape(k, v) for k, v in shapes))


def test_a_header_matching_the_model_spec_is_accepted() -> None:
    for tokens in (1, 5, MODEL.max_tokens):
        check_expected(model_header(tokens=tokens), Expectation(1 << 20, model=MODEL))
    assert MODEL.layer_shape(5) == LayerShape((2, 5, 4), (2, 5, 4))


G = (2, 5, 4)


@pytest.mark.parametrize(
    ("header", "match"),
    [
        pytest.param(model_header(fp="model-b"), "fingerprint", id="fingerprint"),
        pytest.param(model_header([(G, G)]), "1 layers declared", id="too-few-layers"),
        pytest.param(model_header([(G, G)] * 3), "3 layers declared", id="too-many-layers"),
        pytest.param(
            model_header([((2, 0, 4),) * 2] * 2, tokens=0), "token count", id="zero-tokens"
        ),
        pytest.param(
            model_header([((2, 17, 4),) * 2] * 2, tokens=17), "token count", id="too-many-tokens"
        ),
        pytest.param(model_header([((2, 5, 8), G), (G, G)]), "layer 0", id="k-head-dim"),
        pytest.param(model_header([(G, (3, 5, 4)), (G, G)]), "layer 0", id="v-kv-heads"),
        pytest.param(model_header([(G, G), ((2, 6, 4), G)]), "layer 1", id="k-tokens"),
        pytest.param(model_header([(G, G), (G, (2, 5))]), "layer 1", id="v-ndim"),
        pytest.param(model_header([(G, G), ((5, 2, 4), G)]), "layer 1", id="k-transposed"),
        pytest.param(model_header([(G, G), ((1, 2, 5, 4), G)]), "layer 1", id="k-extra-dim"),
    ],
)
def test_shapes_that_do_not_match_the_model_spec(header: KvHeader, match: str) -> None:
    exp = Expectation(1 << 20, model=MODEL)
    with pytest.raises(HeaderRejectedError, match=match):
        check_expected(header, exp)
    # And the same refusal through the whole decoder, from bytes.
    rng = np.random.default_rng(0)
    frames = [
        (i, rng.integers(0, 256, header.layer_nbytes(i), dtype=np.uint8).tobytes())
        for i in range(len(header.layers))
    ]
    with pytest.raises(HeaderRejectedError, match=match):
        decode_kv(transfer(encode_header(header), frames), exp)


def test_check_expected_without_a_model_only_checks_limits_ids_and_epochs() -> None:
    odd = model_header([((9,), (1, 1, 1, 1, 1, 1))], tokens=0, fp="whatever")
    check_expected(odd, Expectation(max_kv_bytes=odd.payload_bytes))


@pytest.mark.parametrize(
    ("sizes", "target", "expected"),
    [
        ([4, 4, 4, 4], 8, [range(0, 2), range(2, 4)]),
        ([4, 4, 4], 8, [range(0, 2), range(2, 3)]),
        ([16, 1, 1], 8, [range(0, 1), range(1, 3)]),
        ([1, 1, 1], 1000, [range(0, 3)]),
        ([8], 8, [range(0, 1)]),
    ],
)
def test_segments_group_consecutive_layers(
    sizes: list[int], target: int, expected: list[range]
) -> None:
    layers = tuple(LayerShape(k=(n,), v=(n,)) for n in sizes)  # float32: 8 * n bytes
    header = KvHeader("r", 1, "fp", DType.FLOAT32, 1, layers)
    assert wire_segments(header, target * 8) == expected


@given(headers(), st.integers(min_value=1, max_value=4))
def test_cached_layout_matches_the_shapes_and_follows_replace(h: KvHeader, extra: int) -> None:
    """Sizes and offsets are cached on the (frozen) header; a replaced header recomputes."""
    sizes = [h.layer_nbytes(i) for i in range(len(h.layers))]
    assert sizes == [
        layer.nbytes(h.dtype) + 4 * sum(h.scale_counts(i)) for i, layer in enumerate(h.layers)
    ]
    assert h.layer_offsets() == [sum(sizes[:i]) for i in range(len(sizes))]
    assert h.payload_bytes == sum(sizes)
    longer = dataclasses.replace(h, layers=h.layers + h.layers[:1] * extra)
    assert longer.payload_bytes == h.payload_bytes + extra * sizes[0]
    assert longer == dataclasses.replace(longer)  # the cache takes no part in equality
    with pytest.raises(IndexError):
        h.layer_nbytes(len(h.layers))
