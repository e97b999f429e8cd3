"""The control-message codec (`transport.control`) and its error-code mapping."""

from __future__ import annotations

import contextlib
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from transport import control, errors
from transport.base import TransferTokens
from transport.control import (
    HEAD_SIZE,
    INSTANCE_ID_BYTES,
    MAX_BODY,
    ErrorCode,
    Kind,
)
from transport.incoming import MAX_KEYS_PER_LINK as _MAX_KEYS_PER_LINK
from transport.link import _IN_PLACE_BYTES
from transport.stream import STREAM_LIMIT
from transport.wire import LAYER_FRAME_SIZE, MAX_HEADER_BYTES, MAX_LAYERS

FUZZ = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)

HEAD = struct.Struct("<BI")
U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1

# Every class of the transport's tree that crosses the wire as itself, with its code.
MAPPED: list[tuple[type[errors.TransportError], ErrorCode]] = [
    (errors.WireFormatError, ErrorCode.WIRE_FORMAT),
    (errors.ChecksumMismatchError, ErrorCode.CHECKSUM),
    (errors.HeaderRejectedError, ErrorCode.REJECTED),
    (errors.StaleEpochError, ErrorCode.STALE_EPOCH),
    (errors.BudgetExceededError, ErrorCode.BUDGET),
    (errors.TransportClosedError, ErrorCode.CLOSED),
    (errors.TransferTimeoutError, ErrorCode.TIMEOUT),
    (errors.PeerLostError, ErrorCode.INTERNAL),
    (errors.PrefixMissingError, ErrorCode.PREFIX_MISSING),
    (errors.PeerRejectedError, ErrorCode.REJECTED_PEER),
]


def split(message: bytes) -> tuple[Kind, bytes]:
    """Decode one encoded message the way a reader does: fixed head, then the body."""
    kind, length = control.decode_head(message[:HEAD_SIZE])
    body = message[HEAD_SIZE:]
    assert len(body) == length
    return kind, body


# ------------------------------------------------------------------ framing


def test_head_layout() -> None:
    assert HEAD_SIZE == HEAD.size == 5
    assert control.encode(Kind.DONE) == HEAD.pack(Kind.DONE, 0)
    assert control.encode(Kind.ABORT, b"why") == HEAD.pack(Kind.ABORT, 3) + b"why"


def test_body_limit_fits_the_largest_open() -> None:
    assert MAX_BODY >= 8 + MAX_HEADER_BYTES


@FUZZ
@given(kind=st.sampled_from(Kind), body=st.binary(max_size=2048))
def test_encode_decode_round_trip(kind: Kind, body: bytes) -> None:
    if kind is Kind.LAYER:
        body = (body * LAYER_FRAME_SIZE)[:LAYER_FRAME_SIZE].ljust(LAYER_FRAME_SIZE, b"\0")
    if kind is Kind.LAYERS:  # a whole number of frames, at least one
        n = max(1, len(body) // LAYER_FRAME_SIZE)
        body = body[: n * LAYER_FRAME_SIZE].ljust(n * LAYER_FRAME_SIZE, b"\0")
    assert split(control.encode(kind, body)) == (kind, body)


@pytest.mark.parametrize("length", [0, 1, LAYER_FRAME_SIZE - 1, LAYER_FRAME_SIZE + 1])
def test_a_layers_message_must_hold_whole_frames(length: int) -> None:
    head = control.encode(Kind.LAYERS, b"\0" * length)[:HEAD_SIZE]
    with pytest.raises(errors.WireFormatError, match="LAYERS message"):
        control.decode_head(head)


@FUZZ
@given(head=st.binary(min_size=HEAD_SIZE, max_size=HEAD_SIZE))
def test_random_heads_are_decoded_or_refused_as_wire_format_errors(head: bytes) -> None:
    try:
        kind, length = control.decode_head(head)
    except errors.WireFormatError:
        return
    assert kind in set(Kind)
    assert 0 <= length <= MAX_BODY
    assert kind is not Kind.LAYER or length == LAYER_FRAME_SIZE


@pytest.mark.parametrize("code", [0, max(Kind) + 1, 0x80, 255])
def test_unknown_message_type(code: int) -> None:
    with pytest.raises(errors.WireFormatError, match="unknown control message type"):
        control.decode_head(HEAD.pack(code, 0))


@pytest.mark.parametrize("length", [MAX_BODY + 1, 1 << 31, U32_MAX])
@pytest.mark.parametrize("kind", [Kind.HELLO, Kind.OPEN, Kind.ERROR, Kind.ABORT])
def test_a_body_over_the_limit_is_refused_unread(kind: Kind, length: int) -> None:
    with pytest.raises(errors.WireFormatError, match="exceeds"):
        control.decode_head(HEAD.pack(kind, length))


@pytest.mark.parametrize("kind", list(Kind))
def test_a_body_at_the_limit_is_accepted(kind: Kind) -> None:
    length = {
        Kind.LAYER: LAYER_FRAME_SIZE,
        Kind.LAYERS: MAX_BODY - MAX_BODY % LAYER_FRAME_SIZE,
        Kind.PAYLOAD: control.EAGER_BYTES,
        **dict.fromkeys(SMALL, control.SMALL_BODY_BYTES),
    }.get(kind, MAX_BODY)
    assert control.decode_head(HEAD.pack(kind, length)) == (kind, length)


SMALL = (Kind.HELLO, Kind.ACCEPT, Kind.DONE, Kind.ERROR, Kind.ABORT, Kind.LANDED, Kind.ALIVE)


@pytest.mark.parametrize("kind", SMALL)
def test_a_message_that_is_always_small_is_refused_from_a_large_head(kind: Kind) -> None:
    with pytest.raises(errors.WireFormatError, match=f"{kind.name} message of"):
        control.decode_head(HEAD.pack(kind, control.SMALL_BODY_BYTES + 1))


@pytest.mark.parametrize("length", [0, 1, LAYER_FRAME_SIZE - 1, LAYER_FRAME_SIZE + 1, MAX_BODY])
def test_a_layer_message_must_carry_exactly_one_frame(length: int) -> None:
    with pytest.raises(errors.WireFormatError, match="LAYER message"):
        control.decode_head(HEAD.pack(Kind.LAYER, length))


# ------------------------------------------------------------------ HELLO / OPEN


@FUZZ
@given(
    instance_id=st.binary(min_size=INSTANCE_ID_BYTES, max_size=INSTANCE_ID_BYTES),
    address=st.binary(max_size=4096),
)
def test_hello_round_trip(instance_id: bytes, address: bytes) -> None:
    kind, body = split(control.hello(instance_id, address))
    assert kind is Kind.HELLO
    assert control.parse_hello(body) == (instance_id, address)


@pytest.mark.parametrize("size", [0, 1, INSTANCE_ID_BYTES - 1])
def test_a_short_hello_is_refused(size: int) -> None:
    with pytest.raises(errors.WireFormatError, match="HELLO too short"):
        control.parse_hello(b"i" * size)


def test_a_hello_without_a_data_address_is_valid() -> None:
    assert control.parse_hello(b"i" * INSTANCE_ID_BYTES) == (b"i" * INSTANCE_ID_BYTES, b"")


@FUZZ
@given(
    tag=st.integers(0, U64_MAX),
    segment=st.integers(control.MIN_SEGMENT_BYTES, U64_MAX),
    header=st.binary(max_size=1024),
)
def test_open_round_trip(tag: int, segment: int, header: bytes) -> None:
    kind, body = split(control.open_(tag, segment, header))
    assert kind is Kind.OPEN
    assert control.parse_open(body) == (tag, segment, header)


def test_an_open_with_a_tiny_segment_size_is_refused() -> None:
    _, body = split(control.open_(1, control.MIN_SEGMENT_BYTES - 1, b"h"))
    with pytest.raises(errors.WireFormatError, match="segment size"):
        control.parse_open(body)


@pytest.mark.parametrize("size", range(16))
def test_a_short_open_is_refused(size: int) -> None:
    with pytest.raises(errors.WireFormatError, match="OPEN too short"):
        control.parse_open(b"\xff" * size)


@FUZZ
@given(body=st.binary(max_size=64))
def test_random_hello_and_open_bodies_only_raise_wire_format_errors(body: bytes) -> None:
    for parse in (control.parse_hello, control.parse_open):
        try:
            parse(body)
        except errors.WireFormatError:
            assert len(body) < max(INSTANCE_ID_BYTES, 8)


# ------------------------------------------------------------------ tags


@FUZZ
@given(index=st.integers(0, MAX_LAYERS - 1))
def test_layer_tags_stay_inside_their_transfer(index: int) -> None:
    tag = control.new_token()
    assert tag & 0xFFFF == 0
    assert 0 <= tag < 1 << 64
    seg_tag = control.layer_tag(tag, index)
    assert seg_tag >> 16 == tag >> 16  # segments stay within this transfer's tag space


def test_layer_tags_are_distinct_for_every_segment() -> None:
    tag = control.new_token()
    tags = [control.layer_tag(tag, i) for i in range(MAX_LAYERS)]
    assert len(set(tags)) == len(tags)


def test_transfer_tags_are_random() -> None:
    # 48 random bits: a repeat among 64 draws would be a 1-in-2^36 event.
    assert len({control.new_token() for _ in range(64)}) == 64


# ------------------------------------------------------------------ errors


@pytest.mark.parametrize(("cls", "code"), MAPPED, ids=lambda v: getattr(v, "__name__", str(v)))
def test_error_code_round_trip(cls: type[errors.TransportError], code: ErrorCode) -> None:
    exc = cls("it broke")
    assert control.code_for(exc) is code
    kind, body = split(control.error(exc))
    assert kind is Kind.ERROR
    assert body[0] == code
    back = control.parse_error(body)
    assert type(back) is cls
    assert str(back) == "peer: it broke"
    assert back.retryable is cls.retryable
    assert type(control.error_from(code, "x")) is cls


def test_every_error_code_is_mapped_to_a_distinct_class() -> None:
    assert {code for _, code in MAPPED} == set(ErrorCode)
    assert len({cls for cls, _ in MAPPED}) == len(ErrorCode)
    for code in ErrorCode:
        assert control.code_for(control.error_from(code, "m")) is code


def test_the_most_specific_class_wins() -> None:
    class MyStale(errors.StaleEpochError):
        pass

    class MyChecksum(errors.ChecksumMismatchError):
        pass

    assert control.code_for(MyStale("x")) is ErrorCode.STALE_EPOCH
    assert control.code_for(MyChecksum("x")) is ErrorCode.CHECKSUM
    assert type(control.parse_error(split(control.error(MyStale("x")))[1])) is (
        errors.StaleEpochError
    )


@pytest.mark.parametrize(
    "exc",
    [
        errors.BackendUnavailableError("no ucxx"),
        errors.TransportError("root"),
        ValueError("foreign"),
        RuntimeError("foreign"),
        KeyboardInterrupt(),
        OSError(104, "reset"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_errors_without_a_code_travel_as_internal(exc: BaseException) -> None:
    assert control.code_for(exc) is ErrorCode.INTERNAL
    back = control.parse_error(split(control.error(exc))[1])
    assert type(back) is errors.PeerLostError
    assert back.retryable


@pytest.mark.parametrize("code", [0, max(ErrorCode) + 1, 200, 255])
def test_unknown_error_codes_become_peer_lost(code: int) -> None:
    back = control.parse_error(bytes((code,)) + b"mystery")
    assert type(back) is errors.PeerLostError
    assert str(back) == "peer: mystery"
    assert type(control.error_from(code, "m")) is errors.PeerLostError


def test_an_empty_error_body_is_peer_lost() -> None:
    assert type(control.parse_error(b"")) is errors.PeerLostError


@FUZZ
@given(body=st.binary(max_size=256))
def test_any_error_body_parses_to_a_transport_error(body: bytes) -> None:
    exc = control.parse_error(body)
    assert isinstance(exc, errors.TransportError)
    assert type(exc) in {cls for cls, _ in MAPPED}


@FUZZ
@given(
    cls=st.sampled_from([cls for cls, _ in MAPPED]),
    text=st.text(st.characters(exclude_categories=[]), max_size=1500),
)
def test_error_messages_survive_any_text(cls: type[errors.TransportError], text: str) -> None:
    """Any text, lone surrogates included, is carried (the first 1000 characters of it)."""
    message = control.error(cls(text))
    assert len(message) <= HEAD_SIZE + 1 + 4 * 1000
    kind, body = split(message)
    assert kind is Kind.ERROR
    back = control.parse_error(body)
    assert type(back) is cls
    want = text[:1000].encode(errors="replace").decode()
    assert str(back) == "peer: " + want


def test_error_text_is_truncated_to_1000_characters() -> None:
    body = split(control.error(errors.WireFormatError("x" * 5000)))[1]
    assert body[1:] == b"x" * 1000


def test_control_messages_built_by_helpers_all_decode() -> None:
    messages = [
        control.hello(b"i" * INSTANCE_ID_BYTES, b"addr"),
        control.open_(control.new_token(), 1 << 20, b"header"),
        control.accept(control.new_token()),
        control.encode(Kind.LAYER, b"\0" * LAYER_FRAME_SIZE),
        control.encode(Kind.DONE),
        control.error(errors.BudgetExceededError("full")),
        control.encode(Kind.ABORT, b"cancelled"),
        control.encode(Kind.LAYERS, b"\0" * (3 * LAYER_FRAME_SIZE)),
        control.open_(control.new_token(), 1 << 20, b"header", read=True),  # retired: refused
        control.encode(Kind.SEGMENT, b""),  # retired with OPEN_READ
        control.encode(Kind.LANDED),
        control.keys([control.RemoteKey(1, 4096, 64, b"rkey")]),
        control.withdraw([1, 2]),
        control.open_read2(1 << 20, b"header", folded=True),
        control.read(0, [control.Descriptor(1, 0, 64)]),
        control.encode(Kind.ALIVE),
        control.payload([memoryview(b"kv")]),
    ]
    assert [split(m)[0] for m in messages] == list(Kind)


KEYS = st.lists(
    st.builds(
        control.RemoteKey,
        st.integers(1, U32_MAX),
        st.integers(0, U64_MAX),
        st.integers(0, U64_MAX),
        st.binary(max_size=control.MAX_RKEY_BYTES),
    ),
    min_size=1,
    max_size=8,
)
DESCRIPTORS = st.lists(
    st.builds(
        control.Descriptor,
        st.integers(0, U32_MAX),
        st.integers(0, U64_MAX),
        st.integers(0, U64_MAX),
    ),
    min_size=1,
    max_size=8,
)


@FUZZ
@given(KEYS)
def test_keys_round_trip(keys: list[control.RemoteKey]) -> None:
    kind, body = split(control.keys(keys))
    assert kind is Kind.KEYS
    assert control.parse_keys(body) == keys


@FUZZ
@given(st.integers(0, U32_MAX), DESCRIPTORS)
def test_read_round_trip(index: int, descs: list[control.Descriptor]) -> None:
    kind, body = split(control.read(index, descs))
    assert kind is Kind.READ
    assert control.parse_read(body) == (index, descs)


@FUZZ
@given(st.lists(st.integers(0, U32_MAX), min_size=1, max_size=50))
def test_withdraw_round_trip(ids: list[int]) -> None:
    kind, body = split(control.withdraw(ids))
    assert kind is Kind.WITHDRAW
    assert control.parse_withdraw(body) == ids


@FUZZ
@given(st.binary(max_size=300))
def test_any_keys_read_or_withdraw_body_decodes_canonically_or_is_refused(body: bytes) -> None:
    with contextlib.suppress(errors.WireFormatError):
        assert control.keys(control.parse_keys(body))[HEAD_SIZE:] == body
    with contextlib.suppress(errors.WireFormatError):
        assert control.read(*control.parse_read(body))[HEAD_SIZE:] == body
    with contextlib.suppress(errors.WireFormatError):
        assert control.withdraw(control.parse_withdraw(body))[HEAD_SIZE:] == body


def test_open_read2_carries_its_flags_and_the_messages_folded_into_it() -> None:
    then = control.read(0, [control.Descriptor(1, 0, 64)]) + control.encode(Kind.DONE)
    kind, body = split(control.open_read2(1 << 20, b"h", folded=True, then=then))
    assert kind is Kind.OPEN_READ2
    flags, segment, header, folded = control.parse_open_read2(body)
    assert (flags, segment, header) == (control.FOLDED, 1 << 20, b"h")
    assert [m.kind for m in folded] == [Kind.READ, Kind.DONE]
    assert control.parse_read(folded[0].body) == (0, [control.Descriptor(1, 0, 64)])
    plain = split(control.open_read2(1 << 20, b"hh", folded=False))[1]
    assert control.parse_open_read2(plain) == (0, 1 << 20, b"hh", [])


def test_a_truncated_open_read2_or_folded_message_is_refused() -> None:
    body = split(control.open_read2(1 << 20, b"header", folded=True, then=control.withdraw([1])))[1]
    for bad in (body[:10], body[:25], body[:-1]):
        with pytest.raises(errors.WireFormatError, match=r"short|truncated"):
            control.parse_open_read2(bad)
    tiny = split(control.open_read2(1024, b"h", folded=False))[1]
    with pytest.raises(errors.WireFormatError, match="segment size"):
        control.parse_open_read2(tiny)


def test_keys_and_reads_out_of_bounds_are_refused() -> None:
    key = control.RemoteKey(1, 2, 3, b"k")
    desc = control.Descriptor(1, 0, 1)
    for count in (0, control.MAX_KEYS + 1):
        with pytest.raises(errors.WireFormatError):
            control.keys([key] * count)
    for count in (0, control.MAX_REGIONS + 1):
        with pytest.raises(errors.WireFormatError):
            control.read(0, [desc] * count)
    with pytest.raises(errors.WireFormatError, match="id 0"):
        control.keys([control.RemoteKey(0, 2, 3, b"k")])  # 0 is never a key id
    with pytest.raises(errors.WireFormatError):
        control.keys([control.RemoteKey(1, 2, 3, b"k" * (control.MAX_RKEY_BYTES + 1))])
    body = split(control.keys([key]))[1]
    for bad in (body[:-1], body + b"x", struct.pack("<H", 0)):
        with pytest.raises(errors.WireFormatError):
            control.parse_keys(bad)
    body = split(control.read(0, [desc]))[1]
    for bad in (body[:-1], body + b"x", struct.pack("<IH", 0, 0)):
        with pytest.raises(errors.WireFormatError):
            control.parse_read(bad)
    with pytest.raises(errors.WireFormatError):
        control.parse_withdraw(b"abc")


def test_open_read_round_trip() -> None:
    msg = control.open_(7 << 16, 1 << 20, b"hdr", read=True)
    kind, _ = control.decode_head(msg[:HEAD_SIZE])
    assert kind is Kind.OPEN_READ
    assert control.parse_open(msg[HEAD_SIZE:]) == (7 << 16, 1 << 20, b"hdr")


# ------------------------------------------------------------------ tokens and refusals


def test_accept_carries_the_receivers_token() -> None:
    token = control.new_token()
    kind, body = split(control.accept(token))
    assert kind is Kind.ACCEPT
    assert control.parse_accept(body) == token


@pytest.mark.parametrize("body", [b"", b"\0" * 8, (1).to_bytes(8, "little"), b"\1" * 9])
def test_an_accept_without_a_well_formed_token_is_refused(body: bytes) -> None:
    with pytest.raises(errors.WireFormatError):
        control.parse_accept(body)


@pytest.mark.parametrize(
    "exc",
    [
        errors.HeaderRejectedError("model fingerprint 'a' does not match 'secret-model'"),
        errors.HeaderRejectedError(
            "layer 0 shapes K(8, 5, 64) do not match the model's (4, 5, 128)"
        ),
        errors.StaleEpochError("request 'r': epoch 2 < 9"),
        errors.BudgetExceededError("100 bytes requested, 7 of 4294967296 free"),
        errors.WireFormatError("payload of 9 bytes exceeds 1073741824"),
        errors.PeerRejectedError("identity not allowed"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_a_refusal_names_its_class_and_nothing_of_the_receiver(exc: Exception) -> None:
    kind, body = split(control.refusal(exc))
    assert kind is Kind.ERROR
    back = control.parse_error(body)
    assert type(back) is type(exc)
    text = str(back)
    for secret in ("secret-model", "128", "9", "4294967296", "1073741824", "(4,"):
        assert secret not in text, text


def test_tokens_are_one_time() -> None:
    tokens = TransferTokens(memory=4)
    live = [tokens.issue() for _ in range(3)]
    assert len(set(live)) == 3
    assert all(tokens.state(t) == "live" for t in live)
    tokens.spend(live[0])
    assert tokens.state(live[0]) == "spent"
    issued = {tokens.issue() for _ in range(64)}
    assert live[0] not in issued  # never issued again while remembered
    assert all(t & 0xFFFF == 0 and t for t in issued)
    assert tokens.wants(control.layer_tag(live[1], 7))  # a live token's segment
    assert not tokens.wants(control.layer_tag(live[0], 0))  # a spent one's
    assert not tokens.wants(control.layer_tag(control.new_token(), 0))  # never issued


# ------------------------------------------------------------------ eager (PAYLOAD)


@pytest.mark.parametrize("size", [1, 4096, control.EAGER_BYTES])
def test_an_eager_payload_round_trips_its_buffers_joined(size: int) -> None:
    data = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
    kind, body = split(control.payload([memoryview(data[:7]), memoryview(data[7:])]))
    assert (kind, body) == (Kind.PAYLOAD, data)


@pytest.mark.parametrize("length", [0, control.EAGER_BYTES + 1, MAX_BODY])
def test_a_payload_head_outside_the_eager_bound_is_refused_unread(length: int) -> None:
    with pytest.raises(errors.WireFormatError, match="PAYLOAD message of"):
        control.decode_head(HEAD.pack(Kind.PAYLOAD, length))


@pytest.mark.parametrize("size", [0, control.EAGER_BYTES + 1])
def test_an_eager_payload_outside_the_bound_is_not_built(size: int) -> None:
    with pytest.raises(errors.WireFormatError, match="eager payload"):
        control.payload([memoryview(b"\0" * size)])


def test_a_maximal_eager_open_fits_the_body_limit() -> None:
    """The largest header, a maximal eager payload and every layer's frame, in one OPEN."""
    frames = control.encode(Kind.LAYERS, b"\0" * (MAX_LAYERS * LAYER_FRAME_SIZE))
    then = control.withdraw([1]) + control.payload([memoryview(b"\0" * control.EAGER_BYTES)])
    message = control.open_read2(1 << 20, b"h" * MAX_HEADER_BYTES, folded=True, then=then + frames)
    kind, body = split(message)
    assert kind is Kind.OPEN_READ2
    folded = control.parse_open_read2(body)[3]
    assert [m.kind for m in folded] == [Kind.WITHDRAW, Kind.PAYLOAD, Kind.LAYERS]


def test_an_oversized_payload_folded_into_an_open_is_refused() -> None:
    """A folded PAYLOAD past the bound is refused by its head, as on the link."""
    big = HEAD.pack(Kind.PAYLOAD, control.EAGER_BYTES + 1) + b"\0" * (control.EAGER_BYTES + 1)
    body = split(control.open_read2(1 << 20, b"header", folded=True, then=big))[1]
    with pytest.raises(errors.WireFormatError, match="PAYLOAD message of"):
        control.parse_open_read2(body)


def test_a_maximal_eager_open_with_every_key_withdrawn_fits_the_body_limit() -> None:
    """`MAX_BODY` leaves room beside the largest header and payload for every layer's frame
    and a withdrawal of every key a link may hold (`incoming.MAX_KEYS_PER_LINK`): an
    eager OPEN is never too long for its receiver, whatever the link carried before."""
    withdraw = control.withdraw(list(range(1, _MAX_KEYS_PER_LINK + 1)))
    frames = control.encode(Kind.LAYERS, b"\0" * (MAX_LAYERS * LAYER_FRAME_SIZE))
    buffers = [memoryview(b"\1" * control.EAGER_BYTES)]
    parts = control.open_read2_parts(
        1 << 20,
        b"h" * MAX_HEADER_BYTES,
        [withdraw + control.payload_head(buffers), *buffers, frames],
    )
    kind, body = split(b"".join(parts))
    assert kind is Kind.OPEN_READ2
    assert [m.kind for m in control.parse_open_read2(body)[3]] == [
        Kind.WITHDRAW,
        Kind.PAYLOAD,
        Kind.LAYERS,
    ]


def test_only_bodies_read_in_place_outgrow_the_stream_buffer() -> None:
    """A body under `link._IN_PLACE_BYTES` is read from the link's stream, whose buffer
    pauses its transport past twice its limit: such bodies stay well inside it. Larger
    ones, up to `MAX_BODY` (an eager KV's OPEN, past the stream's limit), are read in
    place (`tests/contract/test_link_stream.py`), never through that buffer."""
    assert HEAD_SIZE + _IN_PLACE_BYTES <= STREAM_LIMIT // 2
    assert MAX_BODY > STREAM_LIMIT  # what in-place reading allows


@pytest.mark.parametrize("pieces", [1, 2, 7])
def test_an_open_in_pieces_is_the_open_its_pieces_join_into(pieces: int) -> None:
    """`open_read2_parts` lays out the message `open_read2` builds, the KV's buffers passed
    through as they are (not copied)."""
    data = bytes(range(256)) * 64
    step = len(data) // pieces
    buffers = [
        memoryview(data)[i * step : (i + 1) * step if i < pieces - 1 else None]
        for i in range(pieces)
    ]
    then = [
        control.withdraw([3]) + control.payload_head(buffers),
        *buffers,
        control.encode(Kind.DONE),
    ]
    parts = control.open_read2_parts(1 << 20, b"header", then)
    assert all(any(p is b for p in parts) for b in buffers)
    assert b"".join(parts) == control.open_read2(
        1 << 20, b"header", folded=True, then=b"".join(then)
    )


@pytest.mark.parametrize("size", [0, control.EAGER_BYTES + 1])
def test_a_payload_head_outside_the_bound_is_not_built(size: int) -> None:
    with pytest.raises(errors.WireFormatError, match="eager payload"):
        control.payload_head([memoryview(b"\0" * size)])


def test_a_folded_payload_is_a_view_of_the_open_not_a_copy() -> None:
    """The receiver copies an eager payload once, from the OPEN it read into its buffer:
    `parse_open_read2` hands it over as a view of that OPEN's body (`control.Inline`)."""
    payload = bytes(range(256)) * 200
    then = control.withdraw([1]) + control.payload([memoryview(payload)])
    body = split(control.open_read2(1 << 20, b"h", folded=True, then=then))[1]
    withdraw, inline = control.parse_open_read2(body)[3]
    assert isinstance(withdraw, control.Message)
    assert withdraw.body == control.withdraw([1])[5:]
    assert isinstance(inline, control.Inline)
    assert inline.kind is Kind.PAYLOAD
    assert inline.body.obj is body  # a view into the OPEN, no slice copied out
    assert inline.body == payload
