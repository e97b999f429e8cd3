"""Per-layout memos and batched frames in `transport.wire` (issue 16: a transfer's fixed cost).

The memos (a header's shape section encoded, decoded and laid out once per layout) must be
invisible: every header decodes, is refused, and is laid out exactly as without them.
"""

from __future__ import annotations

import dataclasses
import struct

import numpy as np
import pytest

from tests.unit.test_wire import BIG_LIMIT, raw_frame, raw_header
from transport import wire
from transport.errors import ChecksumMismatchError, NonFiniteError, WireFormatError
from transport.wire import DType, KvHeader, LayerFrame, LayerShape


def header(layers: tuple[LayerShape, ...], dtype: DType = DType.FLOAT32) -> KvHeader:
    return KvHeader("req", 1, "fp", dtype, 3, layers)


def test_batched_frames_round_trip_and_match_single_frames() -> None:
    sums = [7, 1 << 63, 0]
    batch = wire.encode_layer_frames(range(3), [16, 32, 0], sums)
    singles = b"".join(
        wire.encode_layer_frame(LayerFrame(i, n, c))
        for i, n, c in zip(range(3), [16, 32, 0], sums, strict=True)
    )
    assert batch == singles
    assert wire.decode_layer_frames(batch) == [
        LayerFrame(0, 16, 7),
        LayerFrame(1, 32, 1 << 63),
        LayerFrame(2, 0, 0),
    ]


@pytest.mark.parametrize(
    ("frames", "match"),
    [
        pytest.param(raw_frame(0, b"ab")[:-1], "multiple", id="truncated"),
        pytest.param(raw_frame(0, b"ab") + raw_frame(1, b"c", magic=b"XXXX"), "magic", id="magic"),
        pytest.param(struct.pack("<4sHHQQ", wire.LAYER_MAGIC, 0, 1, 2, 3), "flags", id="flags"),
    ],
)
def test_batched_frames_are_decoded_as_strictly_as_single_ones(frames: bytes, match: str) -> None:
    with pytest.raises(WireFormatError, match=match):
        wire.decode_layer_frames(frames)


def test_checking_many_frames_refuses_what_checking_one_refuses() -> None:
    h = header((LayerShape((1, 2), (1, 2)),) * 3)
    ok = [LayerFrame(0, 16, 0), LayerFrame(2, 16, 0)]
    wire.check_layer_frames(h, ok, set())
    with pytest.raises(WireFormatError, match="duplicate"):
        wire.check_layer_frames(h, [LayerFrame(1, 16, 0), LayerFrame(1, 16, 0)], set())
    with pytest.raises(WireFormatError, match="duplicate"):
        wire.check_layer_frames(h, ok, {2})
    with pytest.raises(WireFormatError, match="beyond"):
        wire.check_layer_frames(h, [LayerFrame(3, 16, 0)], set())
    with pytest.raises(WireFormatError, match="declares 16"):
        wire.check_layer_frames(h, [LayerFrame(0, 17, 0)], set())


def test_frame_sums_take_what_decoding_and_checking_frames_take() -> None:
    h = header((LayerShape((1, 2), (1, 2)),) * 3)
    batch = wire.encode_layer_frames([2, 0], [16, 16], [5, 1 << 63])
    assert wire.frame_sums(h, batch, set()) == ([2, 0], [5, 1 << 63])
    assert wire.frame_sums(h, batch, {1}) == ([2, 0], [5, 1 << 63])
    assert wire.frame_sums(h, memoryview(b"\0" + batch)[1:], set()) == ([2, 0], [5, 1 << 63])


def _frames(*rows: tuple[int, int]) -> bytes:
    return b"".join(struct.pack("<4sHHQQ", wire.LAYER_MAGIC, i, 0, n, 0) for i, n in rows)


def _decode_and_check(h: KvHeader, frames: bytes, seen: set[int]) -> None:
    wire.check_layer_frames(h, wire.decode_layer_frames(frames), seen)


@pytest.mark.parametrize(
    ("frames", "seen", "match"),
    [
        pytest.param(raw_frame(0, b"ab" * 8)[:-1], set(), "multiple", id="truncated"),
        pytest.param(b"", set(), "", id="empty"),
        pytest.param(
            raw_frame(0, b"a" * 16) + raw_frame(1, b"b" * 16, magic=b"XXXX"),
            set(),
            "magic",
            id="magic",
        ),
        pytest.param(
            struct.pack("<4sHHQQ", wire.LAYER_MAGIC, 0, 1, 16, 3), set(), "flags", id="flags"
        ),
        pytest.param(_frames((1, 16), (1, 16)), set(), "duplicate", id="repeated"),
        pytest.param(_frames((0, 16), (2, 16)), {2}, "duplicate", id="seen"),
        pytest.param(_frames((0, 16), (3, 16)), set(), "beyond", id="beyond"),
        pytest.param(_frames((0, 16), (1, 17)), set(), "declares 16", id="length"),
    ],
)
def test_frame_sums_refuse_what_decoding_and_checking_frames_refuse(
    frames: bytes, seen: set[int], match: str
) -> None:
    h = header((LayerShape((1, 2), (1, 2)),) * 3)
    if not frames:  # nothing to refuse: no frames (a LAYERS message is never empty)
        assert wire.frame_sums(h, frames, seen) == ([], [])
        return
    with pytest.raises(WireFormatError, match=match):
        _decode_and_check(h, frames, seen)
    with pytest.raises(WireFormatError, match=match):
        wire.frame_sums(h, frames, seen)


def test_verify_layers_names_the_first_layer_that_does_not_match() -> None:
    data = [memoryview(bytes([i]) * 16) for i in range(3)]
    batch = [(i, wire.checksum(d), d, 0) for i, d in enumerate(data)]
    wire.verify_layers(batch, None)
    wire.verify_layers(batch, DType.FLOAT32)  # finite values, checked in the same pass
    bad = [*batch[:1], (1, batch[1][1] ^ 1, data[1], 0), (2, 0, data[2], 0)]
    with pytest.raises(ChecksumMismatchError, match="layer 1:"):
        wire.verify_layers(bad, None)
    nan = memoryview(np.full(4, np.nan, np.float32).tobytes())
    with pytest.raises(NonFiniteError, match="layer 7"):
        wire.verify_layers([(7, wire.checksum(nan), nan, 16)], DType.FLOAT32)
    wire.verify_layers([(7, wire.checksum(nan), nan, 16)], None)  # no finite check asked


def test_a_decoded_shape_section_is_reused_and_equal() -> None:
    buf = raw_header(layers=[((2, 3), (2, 3))] * 4)
    first = wire.decode_header(buf, BIG_LIMIT)
    again = wire.decode_header(buf, BIG_LIMIT)
    assert again == first
    assert again.layers is first.layers  # memoized: no per-layer decoding the second time


def test_the_shape_memo_is_per_dtype() -> None:
    """Whether a shape is addressable depends on the item size: a section decoded for fp8
    must not be taken for float32 (the key holds the dtype)."""
    layers = [((1 << 31, 1 << 30, 2), (1,))]  # 2^62 values: 4 EiB in fp8, 2^64 B in f32
    fp8 = raw_header(layers=layers, dtype=DType.FLOAT8_E4M3, tokens=1, payload=2**62 + 1)
    assert wire.decode_header(fp8, 1 << 63).layers[0].k == (1 << 31, 1 << 30, 2)
    f32 = raw_header(layers=layers, dtype=DType.FLOAT32, tokens=1, payload=4)
    with pytest.raises(WireFormatError, match="too large to address"):
        wire.decode_header(f32, 1 << 63)


def test_layouts_are_per_layers_tuple_dtype_and_scales() -> None:
    layers = (LayerShape((1, 2), (1, 2)), LayerShape((1, 4), (1, 4)))
    a = header(layers)
    assert a.layer_offsets() == [0, 16]
    assert a.payload_bytes == 48
    b = dataclasses.replace(a, dtype=DType.FLOAT16)  # the same tuple, another item size
    assert b.layer_offsets() == [0, 8]
    assert b.payload_bytes == 24
    other = (LayerShape((1, 1), (1, 1)),) * 2  # another tuple: never the first's layout
    assert header(other).layer_offsets() == [0, 8]
    for _ in range(40):  # the memo is bounded, and emptied when full
        assert header(tuple(LayerShape((1, 1), (1, 1)) for _ in range(2))).payload_bytes == 16
    assert len(wire._LAYOUTS) <= wire._CACHED_LAYOUTS
    assert header(layers).payload_bytes == 48


def test_the_encoded_shape_section_follows_its_layers() -> None:
    one = header((LayerShape((1, 2), (1, 2)),))
    two = header((LayerShape((1, 3), (1, 3)),))
    for h in (one, two, one):
        assert wire.decode_header(wire.encode_header(h), BIG_LIMIT).layers == h.layers


def test_segments_are_memoized_per_target_and_returned_as_a_fresh_list() -> None:
    h = header((LayerShape((1, 2), (1, 2)),) * 4)  # 16 bytes a layer
    assert wire.segments(h, 32) == [range(0, 2), range(2, 4)]
    got = wire.segments(h, 32)
    got.clear()  # a caller's list is its own
    assert wire.segments(h, 32) == [range(0, 2), range(2, 4)]
    assert wire.segments(h, 1 << 20) == [range(0, 4)]
    assert wire.segments(dataclasses.replace(h, dtype=DType.FLOAT16), 16) == [
        range(0, 2),
        range(2, 4),
    ]


def test_tensor_shapes_follow_their_layers_tuple() -> None:
    one = header((LayerShape((1, 2), (1, 3)), LayerShape((2, 2), (2, 3))))
    assert wire.tensor_shapes(one) == ((1, 2), (1, 3), (2, 2), (2, 3))
    assert wire.tensor_shapes(one) is wire.tensor_shapes(one)  # derived once
    two = header((LayerShape((5,), (6,)),))
    assert wire.tensor_shapes(two) == ((5,), (6,))
    for _ in range(40):  # bounded, and never another tuple's
        assert wire.tensor_shapes(header((LayerShape((7,), (7,)),))) == ((7,), (7,))
    assert len(wire._TENSOR_SHAPES) <= wire._CACHED_LAYOUTS


@pytest.mark.parametrize("little_endian", [True, False])
def test_layer_frames_are_the_frames_encoded_one_by_one(
    little_endian: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(wire, "_LITTLE_ENDIAN", little_endian)
    h = header((LayerShape((1, 2), (1, 2)), LayerShape((1, 4), (1, 4)), LayerShape((1, 1), (1, 1))))
    sums = [(1 << 64) - 1, 0, 1 << 63]
    assert wire.layer_frames(h, 0, sums) == wire.encode_layer_frames(range(3), [16, 32, 8], sums)
    assert wire.layer_frames(h, 1, sums[1:]) == wire.encode_layer_frames([1, 2], [32, 8], sums[1:])
    assert wire.layer_frames(h, 2, [7]) == wire.encode_layer_frames([2], [8], [7])
    half = dataclasses.replace(h, dtype=DType.FLOAT16)  # the same tuple, other lengths
    assert wire.layer_frames(half, 0, sums) == wire.encode_layer_frames(range(3), [8, 16, 4], sums)
    assert wire.layer_frames(h, 0, sums) == wire.encode_layer_frames(range(3), [16, 32, 8], sums)
    with pytest.raises(WireFormatError):
        wire.layer_frames(h, 2, [1, 2])
