"""One-sided UCX: the receiver reads only into the slice it reserved, once per segment, only
by keys its link holds; the sender registers memory once and sends each key once per link.

A sender announcing descriptors that do not add up to the segment's size, that reach
outside their key, that name a key never announced or withdrawn, or a segment that does
not exist, or a one-sided OPEN to a receiver without that path (or in the retired protocol
1), is refused with a clear error before any read is issued, and the reservation released.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import struct
from collections.abc import Awaitable, Callable, Iterable

import numpy as np
import pytest

from transport import control, errors, testing, wire
from transport.backends import UCX_READ, make_receiver, make_sender
from transport.base import TransportSettings
from transport.link import Link
from transport.receiver import KvReceiver
from transport.sender import STAGE_MAX_BYTES
from transport.tcp import tcp_receiver
from transport.ucx import ucx_available

pytestmark = [pytest.mark.ucx, pytest.mark.skipif(not ucx_available(), reason="no ucxx")]

KEY = control.RemoteKey(7, 4096, 64 * testing.KIB, b"k")
EAGER_SIZE = control.EAGER_ONE_SIDED_BYTES
"""The largest KV a one-sided sender sends inline in its OPEN (eager)."""
READ_SIZE = 2 * control.EAGER_ONE_SIDED_BYTES
"""A KV the receiver reads from the sender's registered memory."""


async def _message(reader: asyncio.StreamReader) -> control.Message:
    kind, length = control.decode_head(await asyncio.wait_for(reader.readexactly(5), 5))
    return control.Message(kind, await asyncio.wait_for(reader.readexactly(length), 5))


async def _reply(reader: asyncio.StreamReader) -> control.Message:
    msg = await _message(reader)
    while msg.kind is control.Kind.LANDED:
        msg = await _message(reader)
    return msg


async def _refused(*messages: bytes, folded: bool = False) -> tuple[str, KvReceiver]:
    """Send ``messages`` around an OPEN_READ2 of a 64 KiB KV in 2 layers (one segment);
    return the receiver's ERROR text, having checked nothing was adopted or kept."""
    receiver = make_receiver(UCX_READ, TransportSettings())
    address = await receiver.start()
    try:
        reader, writer = await testing._say_hello(address)
        cache = testing.synthetic_cache("r", 1, 64 * testing.KIB, n_layers=2)
        header = wire.encode_header(cache.header)
        before, after = messages[:-1], messages[-1]
        writer.write(b"".join(before) + control.open_read2(1 << 20, header, folded=folded))
        if not folded:
            assert (await _message(reader)).kind is control.Kind.ACCEPT
        writer.write(after)
        msg = await _reply(reader)
        assert msg.kind is control.Kind.ERROR, msg.kind
        with pytest.raises(errors.WireFormatError):
            await receiver.take("r", 1, timeout_s=5)
        assert receiver.inbox.bytes_in_use == 0
        writer.close()
        return control.parse_error(msg.body).args[0], receiver
    finally:
        await receiver.close()


def _text(*messages: bytes, folded: bool = False) -> str:
    return asyncio.run(_refused(*messages, folded=folded))[0]


def test_descriptors_that_do_not_add_up_to_the_segment_are_refused() -> None:
    short = control.read(0, [control.Descriptor(KEY.key_id, 0, 64 * testing.KIB - 1)])
    assert "do not add up" in _text(control.keys([KEY]), short)


def test_a_descriptor_outside_its_key_is_refused() -> None:
    outside = control.read(0, [control.Descriptor(KEY.key_id, 1, 64 * testing.KIB)])
    assert "outside key" in _text(control.keys([KEY]), outside)


def test_a_segment_out_of_range_is_refused() -> None:
    fits = control.read(1, [control.Descriptor(KEY.key_id, 0, 64 * testing.KIB)])
    assert "out of range" in _text(control.keys([KEY]), fits)  # 64 KiB: one segment


def test_a_read_by_a_key_never_announced_is_refused() -> None:
    fits = control.read(0, [control.Descriptor(KEY.key_id, 0, 64 * testing.KIB)])
    assert "does not hold" in _text(control.keys([dataclasses.replace(KEY, key_id=8)]), fits)


def test_a_read_by_a_withdrawn_key_is_refused_and_nothing_is_adopted() -> None:
    fits = control.read(0, [control.Descriptor(KEY.key_id, 0, 64 * testing.KIB)])
    withdrawn = control.keys([KEY]) + control.withdraw([KEY.key_id])
    assert "does not hold" in _text(withdrawn, fits)
    assert "does not hold" in _text(withdrawn, fits, folded=True)  # one message, one reply


def test_a_key_announced_twice_on_a_link_is_refused() -> None:
    async def run() -> None:
        receiver = make_receiver(UCX_READ, TransportSettings())
        address = await receiver.start()
        try:
            reader, writer = await testing._say_hello(address)
            cache = testing.synthetic_cache("r", 1, 64 * testing.KIB, n_layers=2)
            fits = control.read(0, [control.Descriptor(KEY.key_id, 0, 64 * testing.KIB)])
            twice = control.keys([KEY]) + control.keys([dataclasses.replace(KEY, address=8192)])
            header = wire.encode_header(cache.header)
            writer.write(control.open_read2(1 << 20, header, folded=True, then=twice + fits))
            msg = await _reply(reader)
            assert msg.kind is control.Kind.ERROR
            assert "announced twice" in str(control.parse_error(msg.body))
            assert receiver.inbox.bytes_in_use == 0
            writer.close()
        finally:
            await receiver.close()

    asyncio.run(run())


def test_the_retired_one_sided_protocol_is_refused_clearly() -> None:
    async def run() -> None:
        receiver = make_receiver(UCX_READ, TransportSettings())
        address = await receiver.start()
        try:
            reader, writer = await testing._say_hello(address)
            header = wire.encode_header(testing.synthetic_cache("v1", 1, 1024).header)
            writer.write(control.open_(0, 1 << 20, header, read=True))
            msg = await _message(reader)
            assert msg.kind is control.Kind.ERROR
            refused = control.parse_error(msg.body)
            assert isinstance(refused, errors.HeaderRejectedError)
            assert "upgrade the sender" in str(refused)
            assert receiver.inbox.bytes_in_use == 0
            writer.close()
        finally:
            await receiver.close()

    asyncio.run(run())


def test_a_one_sided_open_to_a_receiver_without_that_path_is_refused() -> None:
    async def run() -> None:
        receiver = tcp_receiver(TransportSettings())
        address = await receiver.start()
        try:
            reader, writer = await testing._say_hello(address)
            header = wire.encode_header(testing.synthetic_cache("t", 1, 1024).header)
            writer.write(control.open_read2(1 << 20, header, folded=False))
            msg = await _message(reader)
            assert msg.kind is control.Kind.ERROR
            assert isinstance(control.parse_error(msg.body), errors.HeaderRejectedError)
            writer.close()
        finally:
            await receiver.close()

    asyncio.run(run())


# ------------------------------------------------------------- keys once per link, withdrawn


def _spy(sent: list[list[control.Kind]]) -> Callable[[], None]:
    """Record the kinds of the control messages each write of a `Link` carries (`send`,
    or `send_parts`: an eager OPEN in pieces); returns an undo."""
    original = Link._write

    async def write(self: Link, chunks: Iterable[bytes | memoryview], timeout_s: float) -> None:
        chunks = list(chunks)
        kinds = []
        for msg in control.split(b"".join(chunks)):
            kinds.append(msg.kind)
            if isinstance(msg, control.Message) and msg.kind is control.Kind.OPEN_READ2:
                kinds.extend(m.kind for m in control.parse_open_read2(msg.body)[3])
        sent.append(kinds)
        await original(self, chunks, timeout_s)

    Link._write = write  # type: ignore[method-assign]
    return lambda: setattr(Link, "_write", original)


async def _with_pair(body: Callable[..., Awaitable[None]]) -> None:
    receiver = make_receiver(UCX_READ, TransportSettings())
    address = await receiver.start()
    sender = make_sender(UCX_READ, TransportSettings())
    try:
        await body(sender, receiver, address)
    finally:
        await sender.close()
        await receiver.close()


async def _send_and_take(sender: object, receiver: KvReceiver, address: str, cache: object) -> None:
    assert isinstance(cache, wire.KvCache)
    await sender.send(address, cache)  # type: ignore[attr-defined]
    got = await receiver.take(cache.header.request_id, cache.header.epoch, 5)
    assert testing.digest(got) == testing.digest(cache)
    got.release()


@pytest.mark.parametrize("layerwise", [False, True], ids=["folded", "layerwise"])
def test_keys_travel_once_per_link_and_memory_is_registered_once(layerwise: bool) -> None:
    sent: list[list[control.Kind]] = []

    async def body(sender: object, receiver: KvReceiver, address: str) -> None:
        from transport.sender import KvSender  # noqa: PLC0415

        assert isinstance(sender, KvSender)
        cache = testing.synthetic_cache("k", 1, 256 * testing.KIB, n_layers=4)
        for n in range(3):
            c = dataclasses.replace(cache, header=dataclasses.replace(cache.header, epoch=n + 1))
            if layerwise:
                async with await sender.open(address, c.header) as t:
                    for i, (k, v) in enumerate(c.layers):
                        await t.send_layer(i, k, v)
                    await t.finish()
                got = await receiver.take("k", n + 1, 5)
                assert testing.digest(got) == testing.digest(c)
                got.release()
            else:
                await _send_and_take(sender, receiver, address, c)
        assert sender.registry.registrations == 1  # the KV's allocation, once
        assert receiver.connections == 1  # one pooled link carried all three

    undo = _spy(sent)
    try:
        asyncio.run(_with_pair(body))
    finally:
        undo()
    with_keys = [kinds for kinds in sent if control.Kind.KEYS in kinds]
    assert len(with_keys) == 1  # the first transfer's; later ones carry no packed key
    opens = [k for k in sent if control.Kind.OPEN_READ2 in k or control.Kind.READ in k]
    assert with_keys[0] == opens[0 if not layerwise else 1]


def test_a_freed_buffers_key_is_withdrawn_on_the_link_before_its_next_transfer() -> None:
    sent: list[list[control.Kind]] = []

    async def body(sender: object, receiver: KvReceiver, address: str) -> None:
        from transport.sender import KvSender  # noqa: PLC0415

        assert isinstance(sender, KvSender)
        first = testing.synthetic_cache("w", 1, READ_SIZE, n_layers=2)
        await _send_and_take(sender, receiver, address, first)
        (old,) = sender.registry.live
        (link,) = [conn.link for conn in receiver._conns]
        assert link is not None
        assert old in link.keys  # the receiver holds it for the link's life
        del first
        gc.collect()
        await _send_and_take(
            sender, receiver, address, testing.synthetic_cache("w", 2, READ_SIZE, seed=3)
        )
        assert old not in sender.registry.live
        assert old not in link.keys  # withdrawn: a READ naming it would now be refused
        assert len(link.keys) == 1

    undo = _spy(sent)
    try:
        asyncio.run(_with_pair(body))
    finally:
        undo()
    opens = [k for k in sent if control.Kind.OPEN_READ2 in k]
    assert opens[1][:3] == [control.Kind.OPEN_READ2, control.Kind.WITHDRAW, control.Kind.KEYS]


def test_a_folded_refusal_is_raised_by_send_and_the_next_transfer_goes_through() -> None:
    async def body(sender: object, receiver: KvReceiver, address: str) -> None:
        cache = testing.synthetic_cache("f", 2, 64 * testing.KIB, n_layers=2)
        await _send_and_take(sender, receiver, address, cache)
        stale = dataclasses.replace(cache, header=dataclasses.replace(cache.header, epoch=1))
        with pytest.raises(errors.StaleEpochError):
            await sender.send(address, stale)  # type: ignore[attr-defined]
        assert receiver.inbox.bytes_in_use == 0
        newer = dataclasses.replace(cache, header=dataclasses.replace(cache.header, epoch=3))
        await _send_and_take(sender, receiver, address, newer)

    asyncio.run(_with_pair(body))


def test_a_buffer_not_owned_by_numpy_is_registered_for_one_transfer() -> None:
    async def body(sender: object, receiver: KvReceiver, address: str) -> None:
        from transport.sender import KvSender  # noqa: PLC0415

        assert isinstance(sender, KvSender)
        # past staging (`_Folded.stage`): its pieces are read where they lie
        cache = testing.synthetic_cache("b", 1, STAGE_MAX_BYTES + READ_SIZE, n_layers=2)
        raw = bytearray(b"".join(bytes(t) for k, v in cache.layers for t in (k, v)))
        layers = []
        pos = 0
        for k, v in cache.layers:
            kk = np.frombuffer(raw, np.float32, k.size, pos).reshape(k.shape)
            pos += k.nbytes
            vv = np.frombuffer(raw, np.float32, v.size, pos).reshape(v.shape)
            pos += v.nbytes
            layers.append((kk, vv))
        foreign = wire.KvCache(cache.header, tuple(layers))
        await _send_and_take(sender, receiver, address, foreign)
        assert not sender.registry.live  # withdrawn when the transfer ended

    asyncio.run(_with_pair(body))


def test_small_blocks_apart_are_staged_into_one_region_registered_once() -> None:
    """A KV of 32 layers allocated apart (64 pieces of 4 KiB) is joined into one pooled
    staging buffer and read as one region: one READ descriptor per transfer, the staging
    buffer registered once over three transfers (the pieces never), back in the pool after
    each; a KV past `STAGE_MAX_BYTES` is read where its pieces lie."""
    reads: list[int] = []

    async def body(sender: object, receiver: KvReceiver, address: str) -> None:
        from transport.sender import KvSender  # noqa: PLC0415

        assert isinstance(sender, KvSender)
        for n in range(3):
            cache = testing.apart(testing.synthetic_cache("s", n + 1, READ_SIZE * 2, n_layers=32))
            await _send_and_take(sender, receiver, address, cache)
            assert sender.staging.idle_bytes > 0  # given back once DONE came
        assert sender.registry.registrations == 1  # the staging buffer's, once
        big = testing.apart(testing.synthetic_cache("b", 1, STAGE_MAX_BYTES * 2, n_layers=2))
        await _send_and_take(sender, receiver, address, big)
        assert sender.registry.registrations == 3  # its two layers' own allocations

    original = control.parse_read

    def spy(body: bytes) -> tuple[int, list[control.Descriptor]]:
        n, descs = original(body)
        reads.append(len(descs))
        return n, descs

    control.parse_read = spy  # type: ignore[assignment]
    try:
        asyncio.run(_with_pair(body))
    finally:
        control.parse_read = original  # type: ignore[assignment]
    assert reads == [1, 1, 1, 2], reads


@pytest.mark.parametrize("size", [EAGER_SIZE, READ_SIZE], ids=["eager", "read"])
@pytest.mark.parametrize("layout", ["wire-order", "layers-reversed", "v-before-k", "offset"])
def test_a_folded_kv_arrives_intact_whether_or_not_it_is_one_span(layout: str, size: int) -> None:
    """In wire order in one allocation the sender describes and checksums the KV as one
    span (`transport.kv_bytes.span`); any other layout goes layer by layer. Either way the
    receiver gets every layer's own bytes, verified — inline (eager) or read."""

    async def body(sender: object, receiver: KvReceiver, address: str) -> None:
        from transport import kv_bytes as sender_module  # noqa: PLC0415

        cache = testing.synthetic_cache("o", 1, size, n_layers=4)
        block = np.concatenate(
            [np.zeros(5, np.float32), *(t.ravel() for p in cache.layers for t in p)]
        )
        pairs = []
        pos = 5
        for k, v in cache.layers:
            kk = block[pos : pos + k.size].reshape(k.shape)
            pos += k.size
            vv = block[pos : pos + v.size].reshape(v.shape)
            pos += v.size
            pairs.append((kk, vv))
        if layout == "layers-reversed":
            pairs = pairs[::-1]
        elif layout == "v-before-k":
            pairs = [(v, k) for k, v in pairs]
        elif layout == "wire-order":
            pairs = list(cache.layers)
        kv = wire.KvCache(
            wire.header_for("o", 1, testing.FINGERPRINT, wire.DType.FLOAT32, pairs), tuple(pairs)
        )
        spans: list[bool] = []
        original = sender_module.span

        def spy(h: wire.KvHeader, c: wire.KvCache) -> memoryview | None:
            got = original(h, c)
            spans.append(got is not None)
            return got

        sender_module.span = spy  # type: ignore[assignment]
        try:
            await _send_and_take(sender, receiver, address, kv)
        finally:
            sender_module.span = original  # type: ignore[assignment]
        assert spans == [layout in ("wire-order", "offset")]

    asyncio.run(_with_pair(body))


# ------------------------------------------------------------- eager: small KVs inline


def _inline(size: int) -> bytes:
    return control.payload([memoryview(b"\1" * size)])


def _folded_refusal(
    then: bytes, data_address: bytes = b"a UCX worker address", backend: str = UCX_READ
) -> str:
    """Fold ``then`` into the OPEN_READ2 of a KV of `EAGER_SIZE` in 2 layers, from a
    sender whose HELLO gave ``data_address`` (a UCX sender's, by default), to a receiver on
    ``backend``; return its ERROR text, having checked nothing was adopted or kept."""

    async def run() -> str:
        receiver = make_receiver(backend, TransportSettings())
        address = await receiver.start()
        try:
            reader, writer = await testing._say_hello(address, data_address)
            cache = testing.synthetic_cache("r", 1, EAGER_SIZE, n_layers=2)
            header = wire.encode_header(cache.header)
            writer.write(control.open_read2(1 << 20, header, folded=True, then=then))
            msg = await _reply(reader)
            assert msg.kind is control.Kind.ERROR, msg.kind
            with pytest.raises(errors.TransportError):  # refused: nothing ever filed
                await receiver.take("r", 1, timeout_s=0.5)
            assert receiver.inbox.bytes_in_use == 0
            writer.close()
            return str(control.parse_error(msg.body))
        finally:
            await receiver.close()

    return asyncio.run(run())


def test_a_small_kv_goes_inline_in_its_open_and_a_larger_one_is_read() -> None:
    """Up to `control.EAGER_ONE_SIDED_BYTES` the payload travels in the OPEN (PAYLOAD): no memory
    registered, no keys, no read; past it, the receiver reads it. Both arrive verified."""
    sent: list[list[control.Kind]] = []

    async def body(sender: object, receiver: KvReceiver, address: str) -> None:
        from transport.sender import KvSender  # noqa: PLC0415

        assert isinstance(sender, KvSender)
        await _send_and_take(sender, receiver, address, testing.synthetic_cache("s", 1, EAGER_SIZE))
        assert sender.registry.registrations == 0
        await _send_and_take(sender, receiver, address, testing.synthetic_cache("l", 1, READ_SIZE))
        assert sender.registry.registrations == 1

    undo = _spy(sent)
    try:
        asyncio.run(_with_pair(body))
    finally:
        undo()
    small, large = [k for k in sent if control.Kind.OPEN_READ2 in k]
    assert small == [control.Kind.OPEN_READ2, control.Kind.PAYLOAD, control.Kind.LAYERS]
    assert control.Kind.PAYLOAD not in large
    assert {control.Kind.KEYS, control.Kind.READ} <= set(large)


def test_an_inline_payload_not_of_the_headers_size_is_refused_before_allocation() -> None:
    assert f"header declares {EAGER_SIZE}" in _folded_refusal(_inline(EAGER_SIZE - 1))


def test_an_eager_kv_from_a_sender_without_a_ucx_data_plane_is_refused(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A tcp sender (no data-plane address in its HELLO) is refused by a UCX receiver for a
    # small KV as for a large one (`backend_names.TCP_SENDER_REFUSED`), before any allocation;
    # an unauthenticated peer is told only the refusal's class, the log says why.
    caplog.set_level(logging.INFO, logger="transport.receiver")
    told = _folded_refusal(_inline(EAGER_SIZE), data_address=b"")
    assert "does not match this receiver" in told
    assert "no UCX data plane" in caplog.text


def test_an_inline_payload_in_two_messages_is_refused() -> None:
    half = _inline(EAGER_SIZE // 2)
    assert "in 2 messages" in _folded_refusal(half + half)


def test_a_read_besides_an_inline_payload_is_refused() -> None:
    fits = control.read(0, [control.Descriptor(KEY.key_id, 0, EAGER_SIZE)])
    assert "no READ or KEYS" in _folded_refusal(control.keys([KEY]) + _inline(EAGER_SIZE) + fits)


def test_a_tcp_receiver_refuses_a_read_beside_an_eager_payload() -> None:
    # A tcp receiver takes a tcp sender's eager OPEN (no one-sided path needed), but never
    # one that also asks it to read: refused before anything is reserved or read.
    fits = control.read(0, [control.Descriptor(KEY.key_id, 0, EAGER_SIZE)])
    then = control.keys([KEY]) + fits + _inline(EAGER_SIZE)  # keys and a read before it
    told = _folded_refusal(then, data_address=b"", backend="tcp")
    assert "no READ or KEYS" in told


def test_a_payload_outside_an_open_is_refused() -> None:
    assert "unexpected PAYLOAD" in _text(_inline(EAGER_SIZE))  # after ACCEPT, on its own


def test_an_oversized_inline_payload_drops_the_link_and_reserves_nothing() -> None:
    """A PAYLOAD past `control.EAGER_BYTES` folded into an OPEN is a protocol violation:
    refused by its head before the header is decoded, and the link is closed."""

    async def run() -> None:
        receiver = make_receiver(UCX_READ, TransportSettings())
        address = await receiver.start()
        try:
            reader, writer = await testing._say_hello(address)
            bound = control.EAGER_BYTES  # the receiver's, whatever the sender's own
            cache = testing.synthetic_cache("o", 1, 2 * bound, n_layers=2)
            # One byte past the bound (the whole OPEN within `control.MAX_BODY`: read).
            big = struct.pack("<BI", control.Kind.PAYLOAD, bound + 1) + b"\0" * (bound + 1)
            header = wire.encode_header(cache.header)
            writer.write(control.open_read2(1 << 20, header, folded=True, then=big))
            assert await asyncio.wait_for(reader.read(), 5) == b""  # closed, no answer
            assert receiver.inbox.bytes_in_use == 0
            writer.close()
        finally:
            await receiver.close()

    asyncio.run(run())


# ------------------------------------------------------------- large KVs: checksums, lock


def test_a_large_folded_kv_sends_each_segments_checksums_as_they_are_taken() -> None:
    """Past the size whose checksums go with the OPEN, each segment's frames follow in their
    own LAYERS message, in order, as soon as that segment was hashed: the receiver verifies
    a segment as it lands instead of waiting for the whole KV's checksums (one LAYERS for
    256 MiB left ~200 MiB to verify after the reads). The KV still arrives verified, and the
    next transfer, whose checksums go the same way, too."""
    sent: list[tuple[control.Kind, bytes]] = []
    original = Link.send

    async def spy(self: Link, data: bytes, timeout_s: float) -> None:
        for msg in control.split(data):
            sent.append((msg.kind, msg.body))
        await original(self, data, timeout_s)

    settings = TransportSettings(segment_bytes=2 * testing.MIB)

    async def body() -> None:
        receiver = make_receiver(UCX_READ, settings)
        address = await receiver.start()
        sender = make_sender(UCX_READ, settings)
        try:
            cache = testing.synthetic_cache("s", 1, 8 * testing.MIB, n_layers=8)
            segments = wire.segments(cache.header, settings.segment_bytes)
            assert len(segments) == 4
            for epoch in (1, 2):
                sent.clear()
                c = dataclasses.replace(
                    cache, header=dataclasses.replace(cache.header, epoch=epoch)
                )
                await _send_and_take(sender, receiver, address, c)
                layers = [wire.decode_layer_frames(b) for k, b in sent if k is control.Kind.LAYERS]
                assert [[f.index for f in frames] for frames in layers] == [
                    list(seg) for seg in segments
                ]
        finally:
            await sender.close()
            await receiver.close()

    Link.send = spy  # type: ignore[method-assign]
    try:
        asyncio.run(body())
    finally:
        Link.send = original  # type: ignore[method-assign]


def test_the_ucx_workers_lock_is_a_mutex() -> None:
    """A receiver's reads copy inside ``ucp_worker_progress`` (CMA, 512 KiB a call) while
    UCXX's progress thread progresses the same worker: with UCX's default spinlock that
    thread spun for as long as the reads copied, one more core's worth of CPU per transfer
    (256 MiB: receiver ~105 → ~65 ms of CPU with a mutex, load ~15)."""
    import ucxx  # noqa: PLC0415 - optional, like the module's own import

    async def body() -> None:
        receiver = make_receiver(UCX_READ, TransportSettings())
        await receiver.start()
        try:
            assert ucxx.get_config()["USE_MT_MUTEX"] == "y"
        finally:
            await receiver.close()

    asyncio.run(body())


def test_a_failed_transfers_memory_stays_registered_until_its_reader_gave_up() -> None:
    """No late read lands in freed memory: a one-sided transfer that failed (here refused
    as stale — the sender cannot know whether its receiver had reads in flight) keeps its
    buffers referenced and registered for the receiver's idle deadline, even once the
    caller dropped the KV; then both go."""
    settings = TransportSettings(idle_timeout_s=0.5)

    async def body() -> None:
        from transport.sender import KvSender  # noqa: PLC0415

        receiver = make_receiver(UCX_READ, settings)
        address = await receiver.start()
        sender = make_sender(UCX_READ, settings)
        assert isinstance(sender, KvSender)
        try:
            await _send_and_take(sender, receiver, address, testing.synthetic_cache("q", 2, 64))
            stale = testing.synthetic_cache("q", 1, READ_SIZE, n_layers=2)  # read, not inline
            with pytest.raises(errors.StaleEpochError):
                await sender.send(address, stale)
            keys = set(sender.registry.live)
            assert keys  # the stale KV's allocation
            del stale
            gc.collect()
            sender.registry.collect()
            assert set(sender.registry.live) == keys  # held: a late read finds it mapped
            await asyncio.sleep(settings.idle_timeout_s + 0.3)
            gc.collect()
            sender.registry.collect()
            assert not set(sender.registry.live) & keys  # released after the deadline
            assert receiver.inbox.bytes_in_use == 0
        finally:
            await sender.close()
            await receiver.close()

    asyncio.run(body())
