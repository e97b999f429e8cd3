"""KV wire format version 3: a suffix-only transfer names the prefix it extends (issue 20
item 3). Written only when a prefix is named; decoded strictly; older versions unchanged."""

from __future__ import annotations

import contextlib
import hashlib
import struct
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.unit.test_wire import SUM, must_refuse, resign
from transport.errors import HeaderRejectedError, WireFormatError
from transport.wire import (
    PREFIX_HASH_BYTES,
    DType,
    Expectation,
    KvCache,
    ModelSpec,
    ScaleLayout,
    check_expected,
    decode_header,
    decode_kv,
    encode_header,
    encode_kv,
    header_for,
)

DIGEST = hashlib.sha256(b"a prefix").digest()


def suffix_cache(prefix: int = 32, tokens: int = 5) -> KvCache:
    k = np.arange(2 * tokens * 4, dtype=np.float16).reshape(2, tokens, 4)
    header = replace(
        header_for("req-1", 3, "model-a", DType.FLOAT16, [(k, k), (k, k)]),
        prefix_tokens=prefix,
        prefix_hash=DIGEST,
    )
    return KvCache(header, ((k, k), (k, k)))


def test_a_prefix_is_written_as_version_3_and_round_trips() -> None:
    cache = suffix_cache()
    head = encode_header(cache.header)
    assert struct.unpack_from("<4sH", head) == (b"PDKV", 3)
    # the v1 header + scales byte + prefix length + hash, before the header checksum
    whole = encode_header(replace(cache.header, prefix_tokens=0, prefix_hash=b""))
    assert len(head) == len(whole) + 1 + 4 + PREFIX_HASH_BYTES
    assert head[-SUM.size - PREFIX_HASH_BYTES : -SUM.size] == DIGEST
    got = decode_kv(b"".join(bytes(b) for b in encode_kv(cache)), Expectation(1 << 20))
    assert (got.header.prefix_tokens, got.header.prefix_hash) == (32, DIGEST)
    assert got.header.total_tokens == 37
    assert got.header == cache.header
    assert struct.unpack_from("<4sH", whole) == (b"PDKV", 1)  # no prefix: as before


def test_a_scaled_suffix_keeps_its_scales() -> None:
    k = np.ones((2, 3, 4), np.uint8)
    h = replace(
        header_for("r", 0, "f", DType.FLOAT8_E4M3, [(k, k)]),
        scales=ScaleLayout.PER_HEAD_F32,
        prefix_tokens=16,
        prefix_hash=DIGEST,
    )
    got = decode_header(encode_header(h), 1 << 20)
    assert got == h
    assert got.version == 3


@pytest.mark.parametrize(
    ("tokens", "digest", "match"),
    [
        (16, b"short", "prefix hash is 32 bytes"),
        (16, bytes(PREFIX_HASH_BYTES), "zeros names no prefix"),
        (0, DIGEST, "without prefix tokens"),
        (1 << 32, DIGEST, "does not fit 32 bits"),
    ],
)
def test_malformed_prefixes_are_refused_at_encode(tokens: int, digest: bytes, match: str) -> None:
    h = replace(suffix_cache().header, prefix_tokens=tokens, prefix_hash=digest)
    with pytest.raises(WireFormatError, match=match):
        encode_header(h)


def test_a_version_3_header_naming_no_prefix_is_refused() -> None:
    head = bytearray(encode_header(suffix_cache().header))
    at = len(head) - SUM.size - PREFIX_HASH_BYTES - 4
    struct.pack_into("<I", head, at, 0)
    with pytest.raises(WireFormatError, match="must name a prefix"):
        decode_header(bytes(resign(head)), 1 << 20)


def test_a_version_3_header_without_its_prefix_field_is_refused() -> None:
    v1 = bytearray(encode_header(replace(suffix_cache().header, prefix_tokens=0, prefix_hash=b"")))
    struct.pack_into("<H", v1, 4, 3)  # a v1 body under version 3
    must_refuse(lambda: decode_header(bytes(resign(v1)), 1 << 20))


@given(st.integers(0, 200), st.integers(0, 255))
def test_mutated_and_resigned_v3_headers_only_raise_wire_format_errors(at: int, value: int) -> None:
    head = bytearray(encode_header(suffix_cache().header))
    at %= len(head) - SUM.size
    head[at] = value
    with contextlib.suppress(WireFormatError):  # anything else fails the test
        decode_header(bytes(resign(head)), 1 << 20)


def test_the_prefix_counts_against_the_models_context() -> None:
    h = suffix_cache(prefix=100, tokens=5).header
    model = ModelSpec("model-a", n_layers=2, kv_heads=2, head_dim=4, max_tokens=104)
    with pytest.raises(HeaderRejectedError, match="exceeds 104"):
        check_expected(h, Expectation(1 << 20, model=model))
    check_expected(h, Expectation(1 << 20, model=replace(model, max_tokens=105)))
