"""Control messages between a KV sender and receiver, and their codec. Pure: no I/O here.

Every backend runs the same small protocol over one TCP connection per transfer slot (the
connection is pooled and reused; with `transport.security.LinkTls`, over mutual TLS, the
peer's identity checked before HELLO); only where the layer *payload* travels differs
(inline on that connection for TCP, over UCX for UCX). A message is
``type u8 | length u32 | body``.

    sender                                   receiver
      HELLO(id, data address)  ──────────▶
                               ◀──────────   HELLO(id, data address) | ERROR (at its cap)
      OPEN(0, segment size, KV header) ──▶   check header, reserve memory, issue a token
                               ◀──────────   ACCEPT(token) | ERROR(code, message)
      LAYER(frame) [+ payload] ──────────▶   (repeated, one per layer, any order;
      LAYERS(frames)                          out of band, a segment's frames in one message)
      ALIVE ─────────────────────────────▶   (while the next layer is computed: a sign of life)
                               ◀──────────   DONE | ERROR(code, message)
      ABORT(message) ────────────────────▶   (at any time: discard the partial KV)

One-sided (UCX, `transport.ucx`; protocol 2 — the first one-sided protocol, OPEN_READ with
a packed remote key in every SEGMENT, is refused with "upgrade the sender"). The sender's
memory is registered once per allocation (`transport.registry`) under a *key id*; a link
carries each key once, in KEYS (key id, address, length, packed remote key), before the
first READ naming it, and WITHDRAW (key ids) before its next transfer once that memory was
freed. Per transfer only (key id, offset, length) descriptors travel:

      OPEN_READ2(FOLDED, segment size, header
                 ⊕ [WITHDRAW] [KEYS] READ(0, descriptors)… [LAYERS]) ──▶
                               ◀──────────   (LANDED…) DONE | ERROR

— one message and one reply when the whole KV exists (`KvSender.send`; LAYERS inside it up
to 4 MiB, after it beyond, computed while the receiver reads). **Eager**, on every
backend (the tag path's and TCP's senders too): a KV of at most its sender's bound
(`eager_bytes`: 128 KiB one-sided, 4 MiB on the tag path and TCP) travels inside
that message instead of being read or sent apart —

      OPEN_READ2(FOLDED, segment size, header ⊕ [WITHDRAW] PAYLOAD(bytes) LAYERS) ──▶
                               ◀──────────   DONE | ERROR

— no registration, no keys, no read, no posted receive: as UCX's own eager protocol below
its rendezvous threshold. Both ends first check that they would pair for a larger KV
(`transport.backend_names`: by their HELLOs' data-plane addresses). The receiver checks the
header (and fences the epoch, reserves the memory) as for any OPEN, refuses a PAYLOAD
whose length is not the header's payload size, copies it into its buffer and verifies
each layer against its frame as it would a read one.

Layer by layer (`open`), OPEN_READ2 without FOLDED is answered ACCEPT, then each
segment's [KEYS] READ goes as soon as its layers exist, followed by its LAYERS. The
receiver checks the header (and fences the epoch, reserves the memory) before it looks
at anything folded in (an inline payload too); it reads each
segment into its own reserved slice, only by keys this link holds and within them, and
verifies each layer as both its bytes and its frame are in; LANDED as segments land (but
the last) is the sender's sign of life.

**The transfer token.** Out-of-band payloads (UCX tag messages) are keyed by a token the
*receiver* draws at random for each transfer it accepts (48 bits, `new_token`), after it
checked the header (request id, epoch, sizes) and reserved memory, and announces only in its
ACCEPT on the control link — authenticated and encrypted under TLS. It posts a receive for
each segment under ``token | segment`` with exactly that segment's length before ACCEPT goes
out, and never issues the token again (`transport.base.TransferTokens`). So a UCX message is
delivered into KV memory only if its tag carries the token of a transfer the authenticated
link announced, and only into that transfer's (request id, epoch) reservation: a message with
an unannounced, spent (replayed) or other transfer's token matches no receive and lands
nowhere (the receiver takes such messages off UCX's queue and drops them, logging each:
`transport.ucp.discard_unexpected`); a wrong-length one fails the transfer. (Before, the
*sender* chose the tag in OPEN, so any peer that could open a transfer chose which posted
receive its bytes would match.)
The OPEN's tag field must be 0 — a sender that predates tokens is refused, not misrouted.
Integrity beyond that rests on the layer checksums the authenticated link carries.

**Refusals disclose nothing.** A refused OPEN is answered with its error class and a fixed
phrase (`refusal`), never the receiver's model fingerprint, KV shape, epochs or budget; the
details go to the receiver's log with the peer's identity and address.

Out of band, the payload moves in *segments* — runs of consecutive layers of about
``segment size`` bytes, computed by both sides from the header (`wire.segments`) — one
message each; LAYER frames (with each layer's checksum) still come one per layer.
"""

from __future__ import annotations

import enum
import secrets
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from transport import errors
from transport.wire import LAYER_FRAME_SIZE, MAX_HEADER_BYTES

_HEAD = struct.Struct("<BI")
HEAD_SIZE = _HEAD.size
EAGER_BYTES = 4 * 1024 * 1024
"""Eager: a KV of at most its sender's bound (`eager_bytes`), whole at hand, goes inline in its
OPEN_READ2 (PAYLOAD) rather than read from registered memory or sent layer by layer. This is
the largest bound (the tag path's and TCP's), the receiver's: it refuses a PAYLOAD longer
than this (its head is checked before its body is taken). The payload is written from the
KV's own memory (`open_read2_parts`) and copied out of the OPEN once, into the receiver's
buffer (`Inline`); before, ~6 copies out and 3 in (each a fresh allocation whose pages fault
in) made eager cost 2–4× a ucx-read at 256 KiB–1 MiB. Measured on this 2-core VM, `pdorch
bench transport`, 32 layers, 100 transfers × 2 rounds, medians in µs, before/after
alternated in separate runs (load 1–6, noisy): at 128 KiB, now eager, v1 1,431 / 2,405 /
1,372 → 743 / 527 / 845, tcp 1,510 / 2,081 / 1,638 → 542 / 664 / 606, ucx-read 495 / 681 /
562 → 571 / 777 / 591 (level with its read); 4 KiB unchanged (v1 639 / 498 / 636 / 693 → 478
/ 470 / 484 / 495). Past its bound each backend's own path wins; from 64 KiB the receiver
reads the OPEN's body in place (`link.read_message`), which made 1 MiB pay on the tag path
too; into a recycled buffer (`transport.buffers`), which made 4 MiB pay (`eager_bytes`)."""
EAGER_ONE_SIDED_BYTES = 128 * 1024
"""The one-sided path's (UCX v2) bound: past it a read wins (256 KiB eager 555 / 728 / 662
against a read's 456 / 498 / 591 µs, 512 KiB ~1,000 against ~650)."""


def eager_bytes(*, one_sided: bool) -> int:
    """The largest KV a sender sends eager: `EAGER_BYTES` on the tag path (UCX v1) and TCP,
    whose layered paths cost ~1–2 ms more per transfer up to it, or the one-sided path's
    bound. Eager against layered, alternated in one pair of processes (20 transfers × 4–8
    rounds, 32 layers, load ~1.5; bodies read in place, `transport.stream`), medians in µs:
    tcp 256 KiB 912 / 2,639, 1 MiB 1,686 / 2,908, 2 MiB 2,467 / 3,005, 4 MiB 5,035 / 4,542;
    ucx 256 KiB 900 / 1,962, 512 KiB 940 / 2,112, 768 KiB 1,751 / 2,685, 1 MiB 1,813 /
    2,430, 2 MiB 1,988 / 1,908 — level by 2 MiB. Then the OPEN's body and the payload were
    read into recycled buffers (a fresh 1 MiB faulted its pages in, ~250 µs): `pdorch bench
    transport --iters 30 --rounds 2 --no-nixl`, 1 MiB bound / 4 MiB bound alternated, three
    pairs, µs: tcp 2 MiB 2,076–2,213 / 1,361–1,888, 4 MiB 2,927–4,112 / 2,075–3,062; ucx 2
    MiB 2,180–2,329 / 1,706–1,926, 4 MiB 2,618–3,810 / 2,270–2,731 (32 layers apart: 2,072–
    2,570 / 1,434–1,940 and 3,216–4,385 / 2,266–2,408) — hence 4 MiB."""
    return EAGER_ONE_SIDED_BYTES if one_sided else EAGER_BYTES


# The largest body: an OPEN (a maximal KV header, an eager KV's payload, every layer's
# frame — 1,024 × 24 bytes — and a WITHDRAW of every key a link holds — 4,096 × 4 bytes —
# within the last 64 KiB) or a HELLO carrying a UCX worker address (a few KiB at most).
# Anything longer is a protocol violation, refused unread. ~4.1 MiB: a body this large is
# read in place, never through the stream's buffer (`link.read_message`: from 64 KiB), into
# a buffer taken as its head arrives — a receiver holds at most one per connection, and
# the bodies being read at once are bounded over all of them (`buffers.Bodies`).
MAX_BODY = MAX_HEADER_BYTES + EAGER_BYTES + 64 * 1024
_U64 = struct.Struct("<Q")
_ERR = struct.Struct("<B")
INSTANCE_ID_BYTES = 16


class Kind(enum.IntEnum):
    HELLO = 1
    OPEN = 2
    ACCEPT = 3
    LAYER = 4
    DONE = 5
    ERROR = 6
    ABORT = 7
    LAYERS = 8
    """Several LAYER frames in one message (out of band: a segment's frames at once)."""
    OPEN_READ = 9
    """OPEN for a one-sided transfer: the receiver reads the payload (SEGMENT messages)."""
    SEGMENT = 10
    """One-sided: a segment is ready in the sender's memory — where, and its remote keys."""
    LANDED = 11
    """One-sided: the receiver read a segment. The sender, with nothing in flight, waits
    for DONE: these keep its idle deadline for a live, reading receiver."""
    KEYS = 12
    """One-sided v2: registered regions of the sender (key id, address, length, packed
    remote key), sent once per link; the receiver keeps them for the link's life."""
    WITHDRAW = 13
    """One-sided v2: key ids the sender deregistered (its memory was freed): the receiver
    forgets them, and a later READ naming one is refused."""
    OPEN_READ2 = 14
    """One-sided v2 OPEN: flags (``FOLDED``), segment size, KV header. Segments follow as
    READ messages naming keys by id; no ACCEPT when ``FOLDED`` (they follow at once)."""
    READ = 15
    """One-sided v2: a segment is ready — descriptors (key id, offset, length) into
    regions KEYS announced on this link."""
    ALIVE = 16
    """Layer by layer: the sender is alive and its next layer is still being computed (sent
    every ``keepalive_s`` while it waits for its producer, `OutgoingTransfer.hold`), so a
    forward slower than the receiver's idle deadline is not taken for a dead peer. No body."""
    PAYLOAD = 17
    """Eager (every backend): a whole KV's payload, at most `EAGER_BYTES`, in wire order.
    Taken only folded into an OPEN_READ2 (``FOLDED``), never on its own."""


class ErrorCode(enum.IntEnum):
    """Errors that cross the wire, each mapped to one class of the transport's tree."""

    WIRE_FORMAT = 1
    CHECKSUM = 2
    REJECTED = 3
    STALE_EPOCH = 4
    BUDGET = 5
    CLOSED = 6
    TIMEOUT = 7
    INTERNAL = 8
    PREFIX_MISSING = 9
    REJECTED_PEER = 10


_CODE_TO_ERROR: dict[ErrorCode, type[errors.TransportError]] = {
    ErrorCode.WIRE_FORMAT: errors.WireFormatError,
    ErrorCode.CHECKSUM: errors.ChecksumMismatchError,
    ErrorCode.REJECTED: errors.HeaderRejectedError,
    ErrorCode.STALE_EPOCH: errors.StaleEpochError,
    ErrorCode.BUDGET: errors.BudgetExceededError,
    ErrorCode.CLOSED: errors.TransportClosedError,
    ErrorCode.TIMEOUT: errors.TransferTimeoutError,
    ErrorCode.INTERNAL: errors.PeerLostError,
    ErrorCode.PREFIX_MISSING: errors.PrefixMissingError,
    ErrorCode.REJECTED_PEER: errors.PeerRejectedError,
}

_REFUSALS: dict[ErrorCode, str] = {
    ErrorCode.WIRE_FORMAT: "malformed or oversized KV header",
    ErrorCode.REJECTED: "KV header refused: it does not match this receiver",
    ErrorCode.STALE_EPOCH: "stale epoch, or a replay of a received one",
    ErrorCode.BUDGET: "no room for this KV now",
    ErrorCode.CLOSED: "receiver is closing",
    ErrorCode.REJECTED_PEER: "not authorised to send KV here",
    ErrorCode.PREFIX_MISSING: "the prefix this KV extends is not held here",
}
"""What a refused OPEN (or connection) is told: the class of the refusal, nothing of the
receiver's model, shapes, epochs or memory (issue 22: refusals disclosed the KV shape)."""


def code_for(exc: BaseException) -> ErrorCode:
    """The wire code for an error (most specific class first)."""
    for code, cls in sorted(_CODE_TO_ERROR.items(), key=lambda kv: -len(kv[1].__mro__)):
        if type(exc) is cls or isinstance(exc, cls):
            return code
    return ErrorCode.INTERNAL


def new_token() -> int:
    """A random, non-zero 48-bit transfer token in the high bits; segment tags fill the low 16."""
    return (secrets.randbits(48) or 1) << 16


def layer_tag(transfer_tag: int, index: int) -> int:
    """Data-plane tag of segment (or layer) ``index`` of a transfer."""
    return transfer_tag | index


def error_from(code: int, message: str) -> errors.TransportError:
    try:
        cls = _CODE_TO_ERROR[ErrorCode(code)]
    except ValueError:
        cls = errors.PeerLostError
    return cls(f"peer: {message}")


@dataclass(frozen=True, slots=True)
class Message:
    kind: Kind
    body: bytes


def encode(kind: Kind, body: bytes = b"") -> bytes:
    return _HEAD.pack(kind, len(body)) + body


def decode_head(head: bytes) -> tuple[Kind, int]:
    return _check_head(*_HEAD.unpack(head))


SMALL_BODY_BYTES = 32 * 1024
"""The most a HELLO (an instance id and a UCX worker address: a few hundred bytes here, a few
KiB on a host with many devices), ACCEPT, DONE, ERROR (a code and at most 1,000 characters),
ABORT, LANDED or ALIVE may carry: refused from its head, so a peer cannot make a receiver
(or a sender) take a large buffer for a message that is always small."""
_SMALL_KINDS = frozenset(
    (Kind.HELLO, Kind.ACCEPT, Kind.DONE, Kind.ERROR, Kind.ABORT, Kind.LANDED, Kind.ALIVE)
)


def _check_head(kind_code: int, length: int) -> tuple[Kind, int]:
    try:
        kind = Kind(kind_code)
    except ValueError:
        raise errors.WireFormatError(f"unknown control message type {kind_code}") from None
    if length > MAX_BODY:
        raise errors.WireFormatError(f"control message of {length} bytes exceeds {MAX_BODY}")
    if kind in _SMALL_KINDS and length > SMALL_BODY_BYTES:
        raise errors.WireFormatError(
            f"{kind.name} message of {length} bytes exceeds {SMALL_BODY_BYTES}"
        )
    if kind is Kind.LAYER and length != LAYER_FRAME_SIZE:
        raise errors.WireFormatError(f"LAYER message of {length} bytes")
    if kind is Kind.LAYERS and (length == 0 or length % LAYER_FRAME_SIZE):
        raise errors.WireFormatError(f"LAYERS message of {length} bytes")
    if kind is Kind.PAYLOAD and not 0 < length <= EAGER_BYTES:
        raise errors.WireFormatError(
            f"PAYLOAD message of {length} bytes (an eager KV is 1 to {EAGER_BYTES})"
        )
    return kind, length


def hello(instance_id: bytes, data_address: bytes) -> bytes:
    return encode(Kind.HELLO, instance_id + data_address)


def parse_hello(body: bytes) -> tuple[bytes, bytes]:
    if len(body) < INSTANCE_ID_BYTES:
        raise errors.WireFormatError("HELLO too short")
    return body[:INSTANCE_ID_BYTES], body[INSTANCE_ID_BYTES:]


_OPEN = struct.Struct("<QQ")
MIN_SEGMENT_BYTES = 64 * 1024


def open_(tag: int, segment_bytes: int, header: bytes, *, read: bool = False) -> bytes:
    """OPEN (or OPEN_READ, one-sided): transfer tag, segment size (out-of-band payload
    grouping), KV header."""
    return encode(Kind.OPEN_READ if read else Kind.OPEN, _OPEN.pack(tag, segment_bytes) + header)


def parse_open(body: bytes) -> tuple[int, int, bytes]:
    if len(body) < _OPEN.size:
        raise errors.WireFormatError("OPEN too short")
    tag, segment_bytes = _OPEN.unpack_from(body)
    if segment_bytes < MIN_SEGMENT_BYTES:
        raise errors.WireFormatError(f"segment size {segment_bytes} below {MIN_SEGMENT_BYTES}")
    return tag, segment_bytes, body[_OPEN.size :]


@dataclass(frozen=True, slots=True)
class RemoteRegion:
    """Memory of the sender the receiver reads (a descriptor resolved against its key):
    address, length, the packed remote key and its id on the link."""

    address: int
    length: int
    rkey: bytes
    key_id: int


_SEG = struct.Struct("<IH")
MAX_REGIONS = 256
"""Per segment: a segment of 32 layers whose K and V lie apart is 64 regions."""
MAX_RKEY_BYTES = 1024


FOLDED = 1
"""OPEN_READ2 flag: the whole KV is there; its READ and LAYERS messages follow in the same
write and the receiver answers only DONE | ERROR (one message, one reply)."""
ONE_SIDED_V1_REFUSED = (
    "one-sided protocol 1 (OPEN_READ with packed keys per segment) is no longer taken: "
    "upgrade the sender (prefill and decode workers must run the same release)"
)


@dataclass(frozen=True, slots=True)
class RemoteKey:
    """A registered region of the sender (KEYS): its id on the link, where, how long."""

    key_id: int
    address: int
    length: int
    rkey: bytes


@dataclass(frozen=True, slots=True)
class Descriptor:
    """Part of a segment (READ): ``length`` bytes at ``offset`` into key ``key_id``."""

    key_id: int
    offset: int
    length: int


_KEY = struct.Struct("<IQQH")
_DESC = struct.Struct("<IQQ")
_COUNT = struct.Struct("<H")
_ID = struct.Struct("<I")
MAX_KEYS = 256
"""Per KEYS message (a sender splits more over several)."""


def keys(entries: list[RemoteKey]) -> bytes:
    if not 0 < len(entries) <= MAX_KEYS:
        raise errors.WireFormatError(f"{len(entries)} keys in a KEYS message")
    parts = [_COUNT.pack(len(entries))]
    for k in entries:
        if not k.key_id or len(k.rkey) > MAX_RKEY_BYTES:
            raise errors.WireFormatError(f"key {k.key_id}: id 0 or remote key too long")
        parts.append(_KEY.pack(k.key_id, k.address, k.length, len(k.rkey)) + k.rkey)
    return encode(Kind.KEYS, b"".join(parts))


def parse_keys(body: bytes) -> list[RemoteKey]:
    if len(body) < _COUNT.size:
        raise errors.WireFormatError("KEYS too short")
    (count,) = _COUNT.unpack_from(body)
    if not 0 < count <= MAX_KEYS:
        raise errors.WireFormatError(f"KEYS with {count} keys")
    pos, out = _COUNT.size, []
    for _ in range(count):
        if pos + _KEY.size > len(body):
            raise errors.WireFormatError("KEYS truncated")
        key_id, address, length, klen = _KEY.unpack_from(body, pos)
        pos += _KEY.size
        if not key_id or klen > MAX_RKEY_BYTES or pos + klen > len(body):
            raise errors.WireFormatError("KEYS: key id 0, or remote key truncated or too long")
        out.append(RemoteKey(key_id, address, length, body[pos : pos + klen]))
        pos += klen
    if pos != len(body):
        raise errors.WireFormatError("KEYS has trailing bytes")
    return out


def withdraw(key_ids: list[int]) -> bytes:
    return encode(Kind.WITHDRAW, b"".join(_ID.pack(k) for k in key_ids))


def parse_withdraw(body: bytes) -> list[int]:
    if not body or len(body) % _ID.size:
        raise errors.WireFormatError(f"WITHDRAW of {len(body)} bytes")
    return [k for (k,) in _ID.iter_unpack(body)]


_OPEN2 = struct.Struct("<QQI")


def open_read2(segment_bytes: int, header: bytes, *, folded: bool, then: bytes = b"") -> bytes:
    """OPEN_READ2: flags, segment size, header length, KV header, then (``FOLDED``) whole
    control messages the receiver takes as if they followed: [WITHDRAW] [KEYS] READ…
    [LAYERS] — one message, read in one go."""
    flags = FOLDED if folded else 0
    body = _OPEN2.pack(flags, segment_bytes, len(header)) + header + then
    return encode(Kind.OPEN_READ2, body)


def parse_open_read2(body: bytes) -> tuple[int, int, bytes, list[Folded]]:
    """Flags, segment size, KV header and the messages folded in after it (views of
    ``body``, not copies, for an eager payload: `Inline`). ``body`` may be a memoryview
    (`transport.link.read_message` reads a large one into a recycled buffer)."""
    if len(body) < _OPEN2.size:
        raise errors.WireFormatError("OPEN_READ2 too short")
    flags, segment_bytes, header_len = _OPEN2.unpack_from(body)
    if segment_bytes < MIN_SEGMENT_BYTES:
        raise errors.WireFormatError(f"segment size {segment_bytes} below {MIN_SEGMENT_BYTES}")
    end = _OPEN2.size + header_len
    if end > len(body):
        raise errors.WireFormatError("OPEN_READ2 header truncated")
    header = bytes(body[_OPEN2.size : end])  # small; ``body`` may be a recycled buffer's view
    return flags, segment_bytes, header, split(memoryview(body)[end:])


@dataclass(frozen=True, slots=True)
class Inline:
    """A PAYLOAD folded into an OPEN_READ2, as a view of that OPEN's body: an eager KV's
    bytes are copied once on the way in, into the receiver's buffer, never sliced out
    of the message first (`split`)."""

    body: memoryview
    kind: ClassVar[Kind] = Kind.PAYLOAD


Folded = Message | Inline
"""A message folded into an OPEN_READ2 (`parse_open_read2`)."""


def split(data: bytes | memoryview) -> list[Folded]:
    """Whole control messages laid end to end (each head checked as on the link). A
    PAYLOAD comes back as a view of ``data`` (`Inline`), the rest as bytes (small)."""
    view = memoryview(data)
    out: list[Folded] = []
    pos = 0
    while pos < len(view):
        if pos + HEAD_SIZE > len(view):
            raise errors.WireFormatError("a folded message is truncated")
        kind, length = _check_head(*_HEAD.unpack_from(view, pos))
        pos += HEAD_SIZE
        if pos + length > len(view):
            raise errors.WireFormatError("a folded message is truncated")
        body = view[pos : pos + length]
        out.append(Inline(body) if kind is Kind.PAYLOAD else Message(kind, bytes(body)))
        pos += length
    return out


def payload_head(buffers: Sequence[memoryview]) -> bytes:
    """The head of PAYLOAD for an eager KV's buffers, which follow it on the link as they
    lie in memory, in wire order (`open_read2_parts`): never joined into one object."""
    n = sum(b.nbytes for b in buffers)
    if not 0 < n <= EAGER_BYTES:
        raise errors.WireFormatError(f"an eager payload of {n} bytes")
    return _HEAD.pack(Kind.PAYLOAD, n)


def payload(buffers: Sequence[memoryview]) -> bytes:
    """PAYLOAD: an eager KV's bytes, its buffers joined in wire order."""
    return payload_head(buffers) + b"".join(buffers)


def open_read2_parts(
    segment_bytes: int, header: bytes, then: Sequence[bytes | memoryview]
) -> list[bytes | memoryview]:
    """OPEN_READ2 (``FOLDED``) in pieces, as `open_read2` lays it out: its head, fields
    and KV header in the first, then ``then`` — the folded messages, an eager payload's
    buffers among them (after `payload_head`) — as they are, for one gathered write
    (`transport.link.Link.send_parts`): no copy of the payload on the sender's side."""
    size = (
        _OPEN2.size + len(header) + sum(len(p) if isinstance(p, bytes) else p.nbytes for p in then)
    )
    first = (
        _HEAD.pack(Kind.OPEN_READ2, size) + _OPEN2.pack(FOLDED, segment_bytes, len(header)) + header
    )
    return [first, *then]


def read(index: int, descriptors: list[Descriptor]) -> bytes:
    if not 0 < len(descriptors) <= MAX_REGIONS:
        raise errors.WireFormatError(f"{len(descriptors)} descriptors in a segment")
    body = _SEG.pack(index, len(descriptors))
    return encode(Kind.READ, body + b"".join(_DESC.pack(*_fields(d)) for d in descriptors))


def _fields(d: Descriptor) -> tuple[int, int, int]:
    return d.key_id, d.offset, d.length


def parse_read(body: bytes) -> tuple[int, list[Descriptor]]:
    """Decode a READ body, bounds checked (the receiver checks keys and lengths)."""
    if len(body) < _SEG.size:
        raise errors.WireFormatError("READ too short")
    index, count = _SEG.unpack_from(body)
    if not 0 < count <= MAX_REGIONS or len(body) != _SEG.size + count * _DESC.size:
        raise errors.WireFormatError(f"READ with {count} descriptors in {len(body)} bytes")
    return index, [Descriptor(*f) for f in _DESC.iter_unpack(body[_SEG.size :])]


def accept(token: int) -> bytes:
    """ACCEPT with the transfer's token (`new_token`)."""
    return encode(Kind.ACCEPT, _U64.pack(token))


def parse_accept(body: bytes) -> int:
    if len(body) != _U64.size:
        raise errors.WireFormatError(
            "ACCEPT without a transfer token (the receiver predates tokens: upgrade it)"
        )
    (token,) = _U64.unpack(body)
    if not token or token & 0xFFFF:
        raise errors.WireFormatError(f"ACCEPT with a malformed transfer token {token:#x}")
    return int(token)


def refusal(exc: BaseException) -> bytes:
    """ERROR for a refused OPEN or connection: the code, and a fixed phrase (`_REFUSALS`)."""
    code = code_for(exc)
    return encode(Kind.ERROR, _ERR.pack(code) + _REFUSALS.get(code, "refused").encode())


def error(exc: BaseException) -> bytes:
    text = str(exc)[:1000].encode(errors="replace")
    return encode(Kind.ERROR, _ERR.pack(code_for(exc)) + text)


def parse_error(body: bytes) -> errors.TransportError:
    if not body:
        return errors.PeerLostError("peer sent an empty ERROR")
    return error_from(body[0], body[1:].decode(errors="replace"))
