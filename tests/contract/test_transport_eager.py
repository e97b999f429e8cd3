"""Eager KVs up to the sender's bound (`control.eager_bytes`: 128 KiB one-sided, 4 MiB on the
tag path and TCP; 128 KiB everywhere before, 64 before the copies were cut), on
every backend and both event loops: the KV goes folded into its OPEN, written from its own
memory (no joined copy of the payload), nothing registered; it arrives verified layer by
layer, and a byte flipped after the checksum is caught on both ends. One payload byte past
the bound, the KV goes the way a large one goes."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterable

import numpy as np
import pytest

from transport import control, errors, testing, wire
from transport.backends import UCX_READ, make_receiver, make_sender
from transport.base import TransportSettings
from transport.link import Link
from transport.sender import KvSender
from transport.ucx import ucx_available

_UCX = [pytest.mark.ucx, pytest.mark.skipif(not ucx_available(), reason="ucxx not installed")]
BACKENDS = [
    pytest.param("ucx", "asyncio", marks=_UCX),
    pytest.param(UCX_READ, "asyncio", marks=_UCX),
    pytest.param("tcp", "asyncio"),
    pytest.param("tcp", "uvloop"),
]
LAYERS = 32
OLD_EAGER_BYTES = 64 * testing.KIB
BOUNDS = {"ucx": 4096 * testing.KIB, UCX_READ: 128 * testing.KIB, "tcp": 4096 * testing.KIB}
"""Each backend's eager bound (`control.eager_bytes`), as the README states them."""


@dataclasses.dataclass
class Writes:
    """What each write of a `Link` carried: its control messages' kinds (folded ones
    included) and its pieces."""

    kinds: list[list[control.Kind]] = dataclasses.field(default_factory=list)
    pieces: list[list[bytes | memoryview]] = dataclasses.field(default_factory=list)

    def opens(self) -> list[tuple[list[control.Kind], list[bytes | memoryview]]]:
        return [
            (k, p)
            for k, p in zip(self.kinds, self.pieces, strict=True)
            if k[:1] == [control.Kind.OPEN_READ2]
        ]


@pytest.fixture
def writes(monkeypatch: pytest.MonkeyPatch) -> Writes:
    seen = Writes()
    original = Link._write

    async def write(self: Link, chunks: Iterable[bytes | memoryview], timeout_s: float) -> None:
        chunks = list(chunks)
        kinds = []
        for msg in control.split(b"".join(chunks)):
            kinds.append(msg.kind)
            if isinstance(msg, control.Message) and msg.kind is control.Kind.OPEN_READ2:
                kinds.extend(m.kind for m in control.parse_open_read2(msg.body)[3])
        seen.kinds.append(kinds)
        seen.pieces.append(chunks)
        await original(self, chunks, timeout_s)

    monkeypatch.setattr(Link, "_write", write)
    return seen


def _shares(piece: bytes | memoryview, cache: wire.KvCache) -> bool:
    if not isinstance(piece, memoryview):
        return False
    view = np.frombuffer(piece, dtype=np.uint8)
    return any(np.shares_memory(view, t) for k, v in cache.layers for t in (k, v))


def _run(backend: str, body: object) -> None:
    async def main() -> None:
        settings = TransportSettings()
        receiver = make_receiver(backend, settings)
        address = await receiver.start()
        sender = make_sender(backend, settings)
        try:
            await body(sender, receiver, address)  # type: ignore[operator]
        finally:
            await sender.close()
            await receiver.close()

    asyncio.run(main())


@pytest.mark.parametrize(("backend", "event_loop_kind"), BACKENDS, indirect=["event_loop_kind"])
def test_a_kv_at_its_senders_bound_goes_eager_from_its_own_memory(
    backend: str, event_loop_kind: str, writes: Writes
) -> None:
    bound = BOUNDS[backend]
    contiguous = testing.synthetic_cache("c", 1, bound, n_layers=LAYERS)
    apart = testing.apart(testing.synthetic_cache("a", 1, bound, n_layers=LAYERS, seed=3))
    assert OLD_EAGER_BYTES < contiguous.header.payload_bytes == bound

    async def body(sender: KvSender, receiver: object, address: str) -> None:
        for cache in (contiguous, apart):
            await sender.send(address, cache)
            got = await receiver.take(cache.header.request_id, 1, 5)  # type: ignore[attr-defined]
            assert testing.digest(got) == testing.digest(cache)
            got.release()
        assert sender.registry.registrations == 0  # nothing registered, nothing read
        assert sender.eager_bytes == bound

    _run(backend, body)
    opens = writes.opens()
    assert [k for k, _ in opens] == [
        [control.Kind.OPEN_READ2, control.Kind.PAYLOAD, control.Kind.LAYERS]
    ] * 2
    # Written from the KV's memory: the payload is not joined into the message first.
    # (Layers apart, 4 KiB each here, are joined: a write each would cost more.)
    (_, pieces), _ = opens
    assert sum(p.nbytes for p in pieces if _shares(p, contiguous)) == bound


@pytest.mark.parametrize(
    ("backend", "event_loop_kind"),
    [p for p in BACKENDS if p.values[0] != UCX_READ],  # its bound, 128 KiB: malloc's heap
    indirect=["event_loop_kind"],
)
def test_an_eager_kvs_body_and_buffer_are_recycled_and_each_kv_arrives_intact(
    backend: str, event_loop_kind: str
) -> None:
    """The receiver reads an eager OPEN's body into a buffer of its pool and gives it back
    once the payload is copied out; the payload's buffer returns when the consumer
    releases the KV: after the first transfer, KVs of that size take no fresh memory —
    and each arrives intact, though its body lands where the previous one's did."""
    bound = BOUNDS[backend]
    caches = [
        testing.synthetic_cache(f"r{i}", 1, bound - 256 * (i % 2), n_layers=LAYERS, seed=i)
        for i in range(4)
    ]

    async def body(sender: KvSender, receiver: object, address: str) -> None:
        pool = receiver.buffers  # type: ignore[attr-defined]
        for i, cache in enumerate(caches):
            await sender.send(address, cache)
            got = await receiver.take(cache.header.request_id, 1, 5)  # type: ignore[attr-defined]
            assert testing.digest(got) == testing.digest(cache)
            if i == 0:  # its OPEN's body and its payload: two buffers, both from the pool
                assert pool.fresh == 2
            got.release()
        assert pool.fresh == 2
        assert pool.idle_bytes >= 2 * bound

    _run(backend, body)


@pytest.mark.parametrize(("backend", "event_loop_kind"), BACKENDS, indirect=["event_loop_kind"])
def test_one_byte_past_the_bound_goes_as_a_large_kv(
    backend: str, event_loop_kind: str, writes: Writes
) -> None:
    # 32 layers of float32 K and V: the next size up is 256 bytes more.
    cache = testing.synthetic_cache("p", 1, BOUNDS[backend] + 256, n_layers=LAYERS)
    assert cache.header.payload_bytes > BOUNDS[backend]

    async def body(sender: KvSender, receiver: object, address: str) -> None:
        await sender.send(address, cache)
        got = await receiver.take("p", 1, 5)  # type: ignore[attr-defined]
        assert testing.digest(got) == testing.digest(cache)
        got.release()

    _run(backend, body)
    assert not any(control.Kind.PAYLOAD in k for k in writes.kinds)


@pytest.mark.parametrize(("backend", "event_loop_kind"), BACKENDS, indirect=["event_loop_kind"])
def test_a_corrupted_eager_kv_at_its_senders_bound_is_caught(
    backend: str, event_loop_kind: str, writes: Writes
) -> None:
    async def body(sender: KvSender, receiver: object, address: str) -> None:
        # Layer 20 lies past the old bound's 64 KiB: a byte flipped after its checksum.
        testing.FaultInjector(layer=20, corrupt_offset=100).attach(sender)
        cache = testing.synthetic_cache("x", 1, BOUNDS[backend], n_layers=LAYERS)
        with pytest.raises(errors.ChecksumMismatchError):
            await sender.send(address, cache)
        with pytest.raises(errors.ChecksumMismatchError):
            await receiver.take("x", 1, 5)  # type: ignore[attr-defined]
        assert receiver.inbox.bytes_in_use == 0  # type: ignore[attr-defined]

    _run(backend, body)
    assert control.Kind.PAYLOAD in writes.opens()[0][0]  # it went eager


@pytest.mark.parametrize(("backend", "event_loop_kind"), BACKENDS, indirect=["event_loop_kind"])
def test_a_small_kv_is_joined_from_any_layout_and_checked_against_its_header(
    backend: str, event_loop_kind: str, writes: Writes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Up to 64 KiB an eager KV is joined from its tensors in one call (`kv_bytes.joined`)
    rather than checked address by address as one span: from one block or apart, each
    layer arrives as its own bytes, verified; a tensor unlike the header is still refused
    before anything is sent, by the layer-by-layer checks."""
    from transport import kv_bytes as sender_module  # noqa: PLC0415

    joins: list[bool] = []
    original = sender_module.joined

    def spy(h: wire.KvHeader, c: wire.KvCache) -> memoryview | None:
        got = original(h, c)
        joins.append(got is not None)
        return got

    monkeypatch.setattr(sender_module, "joined", spy)
    contiguous = testing.synthetic_cache("c", 1, 4 * testing.KIB, n_layers=LAYERS)
    kv = testing.synthetic_cache("a", 1, 64 * testing.KIB, n_layers=LAYERS, seed=3)
    apart = testing.apart(kv)
    k0, v0 = contiguous.layers[0]
    wrong = wire.KvCache(
        dataclasses.replace(contiguous.header, request_id="w"),
        ((k0.reshape(-1), v0), *contiguous.layers[1:]),
    )

    async def body(sender: KvSender, receiver: object, address: str) -> None:
        for cache in (contiguous, apart):
            await sender.send(address, cache)
            got = await receiver.take(cache.header.request_id, 1, 5)  # type: ignore[attr-defined]
            assert testing.digest(got) == testing.digest(cache)
            got.release()
        with pytest.raises(errors.WireFormatError, match="layer 0 shapes"):
            await sender.send(address, wrong)
        assert receiver.inbox.bytes_in_use == 0  # type: ignore[attr-defined]

    _run(backend, body)
    assert joins == [True, True, False]
    assert [k for k, _ in writes.opens()] == [
        [control.Kind.OPEN_READ2, control.Kind.PAYLOAD, control.Kind.LAYERS]
    ] * 2


# An eager OPEN written by hand: its payload, then its frames — whole in one LAYERS message
# (taken in one pass, `receiver._take_whole`), or split (the layer loop takes the rest).
RECEIVERS = [pytest.param("ucx", marks=_UCX), "tcp"]


async def _raw_eager(
    backend: str, cache: wire.KvCache, folded: bytes, after: bytes = b""
) -> tuple[control.Message, object]:
    """Send ``cache``'s header in an OPEN_READ2 (``FOLDED``) with ``folded`` in it and
    ``after`` behind it, from a sender of the receiver's kind; the reply, and the receiver."""
    receiver = make_receiver(backend, TransportSettings())
    address = await receiver.start()
    data_address = b"" if backend == "tcp" else b"a UCX worker address"
    reader, writer = await testing._say_hello(address, data_address)
    header = wire.encode_header(cache.header)
    writer.write(control.open_read2(1 << 20, header, folded=True, then=folded) + after)
    head = await asyncio.wait_for(reader.readexactly(control.HEAD_SIZE), 5)
    kind, length = control.decode_head(head)
    reply = control.Message(kind, await asyncio.wait_for(reader.readexactly(length), 5))
    writer.close()
    return reply, receiver


def _eager_parts(cache: wire.KvCache) -> tuple[bytes, list[int], list[int]]:
    payload = b"".join(bytes(t.data) for k, v in cache.layers for t in (k, v))
    bounds = cache.header.bounds
    sizes = [bounds[i + 1] - bounds[i] for i in range(len(cache.layers))]
    sums = [wire.checksum(payload[bounds[i] : bounds[i + 1]]) for i in range(len(sizes))]
    return control.payload([memoryview(payload)]), sizes, sums


def _layers(indices: list[int], sizes: list[int], sums: list[int]) -> bytes:
    frames = wire.encode_layer_frames(indices, [sizes[i] for i in indices], sums)
    return control.encode(control.Kind.LAYERS, frames)


def test_the_receivers_bound_is_the_largest_senders_and_one_byte_more_is_refused() -> None:
    """Every receiver takes an eager KV up to `control.EAGER_BYTES`, whichever sender's
    bound it came under; a PAYLOAD one byte longer is refused from its head."""
    assert control.eager_bytes(one_sided=False) == BOUNDS["tcp"] == BOUNDS["ucx"]
    assert control.eager_bytes(one_sided=True) == BOUNDS[UCX_READ]
    assert max(BOUNDS.values()) == control.EAGER_BYTES
    assert control.MAX_BODY > control.EAGER_BYTES + wire.MAX_HEADER_BYTES
    largest = control.payload_head([memoryview(bytes(control.EAGER_BYTES))])
    assert control.decode_head(largest) == (control.Kind.PAYLOAD, control.EAGER_BYTES)
    longer = bytes([control.Kind.PAYLOAD]) + (control.EAGER_BYTES + 1).to_bytes(4, "little")
    with pytest.raises(errors.WireFormatError, match="an eager KV is 1 to"):
        control.decode_head(longer)


def _taken_whole(backend: str, cache: wire.KvCache, folded: bytes, after: bytes = b"") -> None:
    """A hand-written eager OPEN (`_raw_eager`) is answered DONE and its KV taken intact."""

    async def body() -> None:
        reply, receiver = await _raw_eager(backend, cache, folded, after)
        try:
            assert reply.kind is control.Kind.DONE, control.parse_error(reply.body)
            got = await receiver.take(cache.header.request_id, 1, 5)  # type: ignore[attr-defined]
            assert testing.digest(got) == testing.digest(cache)
            got.release()
        finally:
            await receiver.close()  # type: ignore[attr-defined]

    asyncio.run(body())


@pytest.mark.parametrize("backend", RECEIVERS)
def test_a_tcp_senders_largest_eager_kv_is_taken(backend: str) -> None:
    """A 4 MiB eager OPEN, hand-written (the tag path's and TCP's bound, past the one-sided
    path's), is taken whole by a receiver of the sender's kind."""
    cache = testing.synthetic_cache("m", 1, control.EAGER_BYTES, n_layers=LAYERS)
    payload, sizes, sums = _eager_parts(cache)
    _taken_whole(backend, cache, payload + _layers(list(range(LAYERS)), sizes, sums))


@pytest.mark.parametrize("backend", RECEIVERS)
def test_an_eager_kv_whose_frames_follow_in_two_messages_is_taken_by_the_layer_loop(
    backend: str,
) -> None:
    cache = testing.synthetic_cache("h", 1, 4 * testing.KIB, n_layers=4)
    payload, sizes, sums = _eager_parts(cache)
    folded = payload + _layers([0, 1], sizes, sums[:2])  # two frames folded, two after
    _taken_whole(backend, cache, folded, _layers([2, 3], sizes, sums[2:]))


@pytest.mark.parametrize("backend", RECEIVERS)
@pytest.mark.parametrize(
    ("fault", "error", "match"),
    [
        ("repeated", errors.WireFormatError, "duplicate layer 1"),
        ("length", errors.WireFormatError, "declares"),
        ("beyond", errors.WireFormatError, "beyond 4 layers"),
        ("checksum", errors.ChecksumMismatchError, "layer 2: payload checksum mismatch"),
    ],
)
def test_a_whole_eager_kv_with_a_bad_frame_is_refused_and_nothing_held(
    backend: str, fault: str, error: type[errors.TransportError], match: str
) -> None:
    """Every frame of a whole eager KV is checked against the header and every layer
    against its frame, as the layer loop checks them: the sender gets the ERROR, the
    decode side's `take` the same failure, and the receiver holds no memory for it."""
    cache = testing.synthetic_cache("b", 1, 4 * testing.KIB, n_layers=4)
    payload, sizes, sums = _eager_parts(cache)
    indices = [0, 1, 2, 3]
    if fault == "repeated":
        indices = [0, 1, 1, 3]
    elif fault == "length":
        sizes = [*sizes[:3], sizes[3] + 4]
    elif fault == "beyond":
        indices = [0, 1, 2, 4]
        sizes = [*sizes, sizes[3]]
    elif fault == "checksum":
        sums = [*sums[:2], sums[2] ^ 1, sums[3]]

    async def body() -> None:
        reply, receiver = await _raw_eager(backend, cache, payload + _layers(indices, sizes, sums))
        try:
            assert reply.kind is control.Kind.ERROR
            assert isinstance(control.parse_error(reply.body), error)
            assert match in reply.body.decode(errors="replace")
            with pytest.raises(error, match=match):
                await receiver.take("b", 1, 5)  # type: ignore[attr-defined]
            assert receiver.inbox.bytes_in_use == 0  # type: ignore[attr-defined]
        finally:
            await receiver.close()  # type: ignore[attr-defined]

    asyncio.run(body())


def test_transfers_to_one_receiver_share_its_pool_and_its_cap() -> None:
    """One pool per receiver address (`KvSender._slot`): with one connection allowed per
    peer, concurrent small transfers take turns on one link, which each leaves for the next."""

    async def main() -> None:
        settings = TransportSettings(max_connections_per_peer=1)
        receiver = make_receiver("tcp", settings)
        address = await receiver.start()
        sender = make_sender("tcp", settings)
        try:
            caches = [testing.synthetic_cache(f"q{i}", 1, 4 * testing.KIB) for i in range(4)]
            await asyncio.gather(*(sender.send(address, c) for c in caches))
            for cache in caches:
                got = await receiver.take(cache.header.request_id, 1, 5)
                assert testing.digest(got) == testing.digest(cache)
                got.release()
            assert receiver.connections == 1
            assert [len(p.idle) for p in sender._pools.values()] == [1]
        finally:
            await sender.close()
            await receiver.close()

    asyncio.run(main())
