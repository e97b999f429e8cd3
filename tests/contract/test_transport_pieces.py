"""Layers sent in pieces (issue 16 item 1): K and V of each layer given as the memoryviews of
a paged cache's blocks — a memory region registered once, as vLLM's KV cache is — land
byte-identical to the gathered layout. Large pieces are read one-sided straight out of the
region (adjacent pieces as one descriptor; the region registered once however many
transfers use it); small ones, or more than one READ names, are staged: copied after their
checksums into a pooled buffer, registered once, read as one region. A byte changed after
the checksums were taken (memory re-used under a late read) is refused either way; pieces
sent over a backend without one-sided reads are joined (one copy) and still land right."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import numpy as np
import pytest

from transport import control, errors, incoming, kv_bytes, outgoing, testing, wire
from transport.backends import UCX_READ, make_receiver, make_sender
from transport.base import TransportSettings
from transport.link import Link
from transport.receiver import KvReceiver
from transport.sender import KvSender
from transport.ucx import UcxDataPlane, ucx_available

pytestmark = [pytest.mark.ucx, pytest.mark.skipif(not ucx_available(), reason="no ucxx")]

LAYERS, BLOCKS, HEADS, BS, HD = 4, 32, 3, 16, 64
"""The pool: a paged cache of LAYERS x BLOCKS blocks, HEADS heads, BS tokens, HD dims."""


def _pool(seed: int) -> np.ndarray:
    """vLLM's CPU layout ("cpu-LBHNC"): per layer and block, per head, BS rows of K then
    BS rows of V — so each (block, head) K chunk lies between two V chunks."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((LAYERS, BLOCKS, HEADS, 2, BS, HD), np.float32)


def _flash_pool(seed: int) -> np.ndarray:
    """The flash layout ("2BNHC"): per layer, every block's K, then every block's V."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((LAYERS, 2, BLOCKS, BS, HEADS, HD), np.float32)


def _bytes(a: np.ndarray) -> memoryview:
    return memoryview(a).cast("B")


def _pieces(pool: np.ndarray, layer: int, ids: list[int]) -> tuple[list[memoryview], ...]:
    """K's and V's pieces of ``ids``, in wire order."""
    if pool.shape[1] == 2:  # flash: one piece per block
        return [_bytes(pool[layer, 0, b]) for b in ids], [_bytes(pool[layer, 1, b]) for b in ids]
    k = [_bytes(pool[layer, b, j, 0]) for b in ids for j in range(HEADS)]
    v = [_bytes(pool[layer, b, j, 1]) for b in ids for j in range(HEADS)]
    return k, v


def _gathered(pool: np.ndarray, layer: int, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """What the connector's gather produces (``views.k[index][ids]``)."""
    if pool.shape[1] == 2:
        return pool[layer, 0][ids], pool[layer, 1][ids]
    return pool[layer][ids][:, :, 0], pool[layer][ids][:, :, 1]


def _header(pool: np.ndarray, rid: str, epoch: int, ids: list[int]) -> wire.KvHeader:
    k, v = _gathered(pool, 0, ids)
    layers = [(k, v)] * LAYERS
    return wire.header_for(rid, epoch, testing.FINGERPRINT, wire.DType.FLOAT32, layers)


async def _send(sender: KvSender, address: str, pool: np.ndarray, h: wire.KvHeader,
                ids: list[int], pace_s: float = 0.0) -> None:  # fmt: skip
    """Send the layers back to back, or (``pace_s``) one every ``pace_s``, as a forward
    slower than the link gives them."""
    async with await sender.open(address, h) as t:
        for i in range(LAYERS):
            if pace_s and i:
                await asyncio.sleep(pace_s)
            await t.send_layer(i, *_pieces(pool, i, ids))
        await t.finish()


async def _landed(receiver: KvReceiver, pool: np.ndarray, h: wire.KvHeader,
                  ids: list[int]) -> None:  # fmt: skip
    got = await receiver.take(h.request_id, h.epoch, 5)
    try:
        for i, (k, v) in enumerate(got.layers):
            gk, gv = _gathered(pool, i, ids)
            assert k.tobytes() == gk.tobytes(), f"layer {i} K"
            assert v.tobytes() == gv.tobytes(), f"layer {i} V"
    finally:
        got.release()


def _reads(sent: list[list[control.Descriptor]]) -> Callable[[], None]:
    """Record each READ's descriptors a `Link.send` writes; returns an undo."""
    original = Link.send

    async def send(self: Link, data: bytes, timeout_s: float) -> None:
        for msg in control.split(data):
            if msg.kind is control.Kind.READ:
                sent.append(control.parse_read(msg.body)[1])
        await original(self, data, timeout_s)

    Link.send = send  # type: ignore[method-assign]
    return lambda: setattr(Link, "send", original)


@pytest.fixture
def reads() -> Iterator[list[list[control.Descriptor]]]:
    sent: list[list[control.Descriptor]] = []
    undo = _reads(sent)
    yield sent
    undo()


@pytest.fixture
def in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pieces of any size read where they lie (staged only past one READ's descriptors)."""
    monkeypatch.setattr(kv_bytes, "STAGE_PIECE_BYTES", 0)


Body = Callable[[KvSender, KvReceiver, str], Awaitable[None]]


def _run(body: Body, backend: str = UCX_READ, hold_s: float | None = None) -> None:
    """``body`` with a receiver and a sender sending a segment per layer (``hold_s``: the
    sender's idle deadline, so the hold of a failed transfer's buffers)."""
    settings = TransportSettings(segment_bytes=control.MIN_SEGMENT_BYTES)
    if hold_s is not None:
        settings = dataclasses.replace(settings, idle_timeout_s=hold_s)

    async def main() -> None:
        receiver = make_receiver(backend, TransportSettings())
        address = await receiver.start()
        sender = make_sender(backend, settings)
        await sender.start()
        try:
            await body(sender, receiver, address)
        finally:
            await sender.close()
            await receiver.close()

    asyncio.run(main())


@pytest.mark.parametrize("make", [_pool, _flash_pool], ids=["cpu-LBHNC", "2BNHC"])
def test_pieces_land_as_the_gather_and_the_region_is_registered_once(
    make: Callable[[int], np.ndarray], reads: list[list[control.Descriptor]], in_place: None
) -> None:
    pool = make(1)
    ids = [5, 6, 7, 2, 9]  # 5, 6, 7 consecutive: adjacent when a block is one piece

    async def body(sender: KvSender, receiver: KvReceiver, address: str) -> None:
        region = sender.registry.register_region(pool.ctypes.data, pool.nbytes, pool)
        for epoch in (1, 2, 3):
            h = _header(pool, "p", epoch, ids)
            await _send(sender, address, pool, h, ids)
            await _landed(receiver, pool, h, ids)
        assert sender.registry.registrations == 1  # the region, once: nothing per transfer
        assert set(sender.registry.live) == {region.key.key_id}
        assert all(d.key_id == region.key.key_id for r in reads for d in r)

    _run(body)
    per_layer = [len(r) for r in reads]
    if make is _flash_pool:  # blocks 5-7 merged: 3 runs of K, 3 of V per layer
        assert set(per_layer) == {2 * 3}
    else:  # (block, head) chunks, K and V interleaved: nothing merges
        assert set(per_layer) == {2 * len(ids) * HEADS}
    assert len(reads) == 3 * LAYERS  # one layer per segment here (a READ each)


def test_small_pieces_are_staged_into_one_region_registered_once(
    reads: list[list[control.Descriptor]],
) -> None:
    """4 KiB pieces: each segment is copied into a staging buffer and read as one region;
    the buffers are registered by the first transfer and reused by the next ones, back in
    the sender's pool after each; the cache's region itself is never read."""
    pool = _pool(7)
    ids = [5, 6, 7, 2, 9]

    async def body(sender: KvSender, receiver: KvReceiver, address: str) -> None:
        region = sender.registry.register_region(pool.ctypes.data, pool.nbytes, pool)
        counts = []
        for epoch in (1, 2, 3):
            h = _header(pool, "s", epoch, ids)
            await _send(sender, address, pool, h, ids)
            await _landed(receiver, pool, h, ids)
            counts.append(sender.registry.registrations)
            assert sender.staging.idle_bytes >= h.payload_bytes  # every buffer given back
        assert counts[0] == counts[1] == counts[2] <= 1 + LAYERS  # one per segment at most
        assert all(d.key_id != region.key.key_id for r in reads for d in r)

    _run(body)
    assert [len(r) for r in reads] == [1] * (3 * LAYERS)  # a READ per segment, one region


@pytest.mark.parametrize("staged", [True, False], ids=["staged", "in-place"])
def test_a_piece_changed_after_its_checksum_is_refused(
    reads: list[list[control.Descriptor]], staged: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checksums are taken before the receiver learns where to read (and before a
    staging copy): memory changed after that — a late read of blocks re-used after the
    transfer failed — is refused."""
    if not staged:
        monkeypatch.setattr(kv_bytes, "STAGE_PIECE_BYTES", 0)
    pool = _pool(2)
    ids = [3, 4, 11]

    async def body(sender: KvSender, receiver: KvReceiver, address: str) -> None:
        sender.registry.register_region(pool.ctypes.data, pool.nbytes, pool)
        flat = pool.reshape(-1).view(np.uint8)
        offset = (((1 * BLOCKS + 11) * HEADS + 2) * 2 + 1) * BS * HD * 4 + 5  # layer 1, V

        def flip(seg: int) -> None:
            if seg == 1:
                flat[offset] ^= 0x40

        sender.exposed_hook = flip
        h = _header(pool, "c", 1, ids)
        with pytest.raises(errors.TransportError, match="checksum"):
            await _send(sender, address, pool, h, ids)
        with pytest.raises(errors.TransportError):
            await receiver.take("c", 1, 2)
        sender.exposed_hook = None
        h2 = _header(pool, "c", 2, ids)  # the next transfer reads the bytes as they now are
        await _send(sender, address, pool, h2, ids)
        await _landed(receiver, pool, h2, ids)

    _run(body)
    assert all((len(r) == 1) is staged for r in reads)  # staged: one region per READ


def test_pieces_too_scattered_for_one_read_are_staged_and_land(
    reads: list[list[control.Descriptor]], in_place: None
) -> None:
    pool = _pool(3)
    ids = list(range(BLOCKS - 1, -1, -1))  # 32 blocks x 3 heads x 2: 192 pieces a layer
    many = ids * 2  # 384 > control.MAX_REGIONS

    async def body(sender: KvSender, receiver: KvReceiver, address: str) -> None:
        region = sender.registry.register_region(pool.ctypes.data, pool.nbytes, pool)
        h = _header(pool, "j", 1, many)
        await _send(sender, address, pool, h, many)
        await _landed(receiver, pool, h, many)
        assert region.key.key_id in sender.registry.live
        assert sender.staging.idle_bytes >= h.payload_bytes  # the copies: back in the pool

    _run(body)
    assert all(len(r) == 1 for r in reads)  # each segment staged into one buffer


def test_pieces_over_tcp_are_joined_and_land() -> None:
    pool = _pool(4)
    ids = [0, 7, 8]

    async def body(sender: KvSender, receiver: KvReceiver, address: str) -> None:
        h = _header(pool, "t", 1, ids)
        await _send(sender, address, pool, h, ids)
        await _landed(receiver, pool, h, ids)

    _run(body, "tcp")


def test_pieces_that_do_not_add_up_to_the_layer_are_refused() -> None:
    pool = _pool(5)
    ids = [1, 2]

    async def body(sender: KvSender, receiver: KvReceiver, address: str) -> None:
        sender.registry.register_region(pool.ctypes.data, pool.nbytes, pool)
        h = _header(pool, "s", 1, ids)
        async with await sender.open(address, h) as t:
            k, v = _pieces(pool, 0, ids)
            with pytest.raises(errors.WireFormatError, match="pieces of"):
                await t.send_layer(0, k[:-1], v)
            with pytest.raises(errors.WireFormatError, match="both be arrays or pieces"):
                await t.send_layer(0, k, _gathered(pool, 0, ids)[1])

    _run(body)


def test_an_unregistered_region_is_withdrawn_before_the_next_transfer(in_place: None) -> None:
    pool = _pool(6)
    ids = [1, 2]
    sent: list[list[control.Kind]] = []
    original = Link.send

    async def spy(self: Link, data: bytes, timeout_s: float) -> None:
        sent.append([m.kind for m in control.split(data)])
        await original(self, data, timeout_s)

    async def body(sender: KvSender, receiver: KvReceiver, address: str) -> None:
        region = sender.registry.register_region(pool.ctypes.data, pool.nbytes, pool)
        h = _header(pool, "u", 1, ids)
        await _send(sender, address, pool, h, ids)
        await _landed(receiver, pool, h, ids)
        sender.registry.unregister_region(region)
        assert region.key.key_id not in sender.registry.live
        (link,) = [conn.link for conn in receiver._conns]
        assert link is not None
        assert region.key.key_id in link.keys
        h2 = _header(pool, "u", 2, ids)  # now the numpy allocation's own registration
        await _send(sender, address, pool, h2, ids)
        await _landed(receiver, pool, h2, ids)
        assert region.key.key_id not in link.keys
        assert sender.registry.registrations == 2

    Link.send = spy  # type: ignore[method-assign]
    try:
        _run(body)
    finally:
        Link.send = original  # type: ignore[method-assign]
    withdraws = [k for k in sent if control.Kind.WITHDRAW in k]
    assert withdraws
    assert withdraws[0][0] is control.Kind.WITHDRAW  # before the next OPEN


@pytest.mark.parametrize("keepalive_s", [60.0, 0.0], ids=["quiet", "every-segment"])
def test_landed_goes_out_at_most_every_keepalive(keepalive_s: float) -> None:
    """A segment per layer (as the vLLM connector sends): the receiver tells the sender
    it read segments (LANDED: the sender's sign of life while it waits for DONE) at most
    every ``keepalive_s`` — not once per segment, each a message both sides handle."""
    pool = _pool(8)
    ids = [4, 1, 9]
    landed: list[control.Kind] = []
    original = Link.send

    async def spy(self: Link, data: bytes, timeout_s: float) -> None:
        landed.extend(m.kind for m in control.split(data) if m.kind is control.Kind.LANDED)
        await original(self, data, timeout_s)

    async def main() -> None:
        receiver = make_receiver(UCX_READ, TransportSettings(keepalive_s=keepalive_s))
        address = await receiver.start()
        sender = make_sender(UCX_READ, TransportSettings(segment_bytes=control.MIN_SEGMENT_BYTES))
        try:
            sender.registry.register_region(pool.ctypes.data, pool.nbytes, pool)
            for epoch in (1, 2):
                h = _header(pool, "l", epoch, ids)
                # (paced: layers given together go, and land, together — `test_segments_
                # given_together_go_in_one_message_and_are_read_as_one`)
                await _send(sender, address, pool, h, ids, pace_s=0.05)
                await _landed(receiver, pool, h, ids)
        finally:
            await sender.close()
            await receiver.close()

    Link.send = spy  # type: ignore[method-assign]
    try:
        asyncio.run(main())
    finally:
        Link.send = original  # type: ignore[method-assign]
    if keepalive_s:
        assert landed == []
    else:  # every segment but the last (DONE follows it), in each of the two transfers
        assert LAYERS - 1 <= len(landed) <= 2 * (LAYERS - 1)


def test_a_failed_transfers_staging_buffers_stay_out_of_the_pool_for_its_hold() -> None:
    """The receiver may still be reading a failed transfer's staging buffers (it gives up
    within its idle deadline): they go back to the pool only after the sender's hold."""
    pool = _pool(9)
    ids = [2, 6]
    hold_s = 0.5

    async def main() -> None:
        receiver = make_receiver(UCX_READ, TransportSettings())
        address = await receiver.start()
        settings = TransportSettings(segment_bytes=control.MIN_SEGMENT_BYTES, idle_timeout_s=hold_s)
        sender = make_sender(UCX_READ, settings)
        try:
            sender.registry.register_region(pool.ctypes.data, pool.nbytes, pool)
            flat = pool.reshape(-1).view(np.uint8)

            def flip(seg: int) -> None:  # after the checksums, before the copy
                if seg == 0:  # layer 0, block 6, head 0, K
                    flat[6 * HEADS * 2 * BS * HD * 4 + 5] ^= 0x40

            sender.exposed_hook = flip
            h = _header(pool, "f", 1, ids)
            with pytest.raises(errors.TransportError, match="checksum"):
                await _send(sender, address, pool, h, ids)
            assert sender.staging.idle_bytes == 0  # held: none back in the pool yet
            await asyncio.sleep(hold_s * 3)
            assert sender.staging.idle_bytes >= h.payload_bytes  # the hold is over
        finally:
            await sender.close()
            await receiver.close()

    asyncio.run(main())


def test_a_segment_failing_where_it_is_read_cancels_the_reads_started_before_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A folded KV of two segments: the first is read in a task, the second (small) where
    its READ is taken — and fails its checksum. The first read is cancelled with the
    transfer, not left running into a failed transfer's buffer."""
    reads: list[asyncio.Task[Any]] = []
    create_task = asyncio.create_task

    def recorded(coro: Any, *, name: str | None = None, **kw: Any) -> asyncio.Task[Any]:
        task = create_task(coro, name=name, **kw)
        if name is not None and name.startswith("pdorch-kv-read-"):  # segment reads
            reads.append(task)
        return task

    monkeypatch.setattr(asyncio, "create_task", recorded)

    async def main() -> None:
        receiver = make_receiver(UCX_READ, TransportSettings())
        address = await receiver.start()
        sender = make_sender(UCX_READ, TransportSettings(segment_bytes=2 * testing.MIB))
        faults = testing.FaultInjector(layer=2, corrupt_offset=5, armed=False)
        faults.attach(sender)
        try:
            cache = testing.synthetic_cache("g", 1, 3 * testing.MIB, n_layers=3)
            warm = dataclasses.replace(cache, header=dataclasses.replace(cache.header, epoch=0))
            await sender.send(address, warm)  # the link's endpoint exists: reads in place
            (await receiver.take("g", 0, 2)).release()
            reads.clear()
            faults.armed = True
            with pytest.raises(errors.TransportError, match="checksum"):
                await sender.send(address, cache)
            with pytest.raises(errors.TransportError):
                await receiver.take("g", 1, 2)
            assert [t.get_name() for t in reads] == ["pdorch-kv-read-0"]
            assert reads[0].cancelled()  # before it ran: the second failed in the same step
            assert receiver.inbox.bytes_in_use == 0
        finally:
            await sender.close()
            await receiver.close()

    asyncio.run(main())


def _writes(sent: list[list[control.Kind]]) -> Callable[[], None]:
    """Record the kinds of the messages of each `Link.send` write; returns an undo."""
    original = Link.send

    async def send(self: Link, data: bytes, timeout_s: float) -> None:
        sent.append([m.kind for m in control.split(data)])
        await original(self, data, timeout_s)

    Link.send = send  # type: ignore[method-assign]
    return lambda: setattr(Link, "send", original)


@pytest.fixture
def plane_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The bytes of each read the receiver asks its data plane for (`read_now`, which
    may hand it to `read`, or `read`)."""
    sizes: list[int] = []
    inner = {"depth": 0}
    for name in ("read_now", "read"):
        original = getattr(UcxDataPlane, name)

        def spy(self: UcxDataPlane, peer: Any, regions: Any, into: memoryview, *rest: Any,
                _original: Any = original) -> Any:  # fmt: skip
            if not inner["depth"]:
                sizes.append(into.nbytes)
            inner["depth"] += 1
            try:
                return _original(self, peer, regions, into, *rest)
            finally:
                inner["depth"] -= 1

        monkeypatch.setattr(UcxDataPlane, name, spy)
    return sizes


@pytest.mark.parametrize("staged", [True, False], ids=["staged", "in-place"])
def test_segments_given_together_go_in_one_message_and_are_read_as_one(
    staged: bool, plane_reads: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A KV given faster than it moves (the bench, a fast forward): its segments (a layer
    each here) go in one write — every READ and every frame — and, staged into one buffer,
    are read as one region; the bytes land right. Read where they lie, each segment still
    gets its own descriptors (one READ each) in the same write."""
    monkeypatch.setattr(outgoing, "_GROUP_BYTES", 4 << 20)
    monkeypatch.setattr(incoming, "_JOINED_READ_BYTES", 4 << 20)
    if not staged:
        monkeypatch.setattr(kv_bytes, "STAGE_PIECE_BYTES", 0)
    pool, ids = _pool(11), [5, 6, 7, 2, 9]
    writes: list[list[control.Kind]] = []

    async def body(sender: KvSender, receiver: KvReceiver, address: str) -> None:
        h = _header(pool, "g", 1, ids)
        undo = _writes(writes)
        try:
            await _send(sender, address, pool, h, ids)
        finally:
            undo()
        await _landed(receiver, pool, h, ids)

    _run(body)
    with_reads = [w for w in writes if control.Kind.READ in w]
    assert len(with_reads) == 1
    assert with_reads[0].count(control.Kind.READ) == LAYERS
    assert with_reads[0][-1] is control.Kind.LAYERS  # every frame, after the READs
    if staged:
        assert len(plane_reads) == 1
        assert plane_reads[0] == _header(pool, "g", 1, ids).payload_bytes


def test_a_group_stops_at_its_size_and_a_paced_producer_s_segments_go_alone(
    plane_reads: list[int],
) -> None:
    """Back to back, a KV over `_GROUP_BYTES` goes in several writes, none naming more
    than that (the receiver reads the first group while the next is summed and copied);
    layers given one at a time (a forward slower than the link) go one write each — a
    segment never waits for the next."""
    pool, ids = _pool(12), [5, 6, 7, 2, 9]  # 120 KiB a layer: two per group
    h1, h2 = _header(pool, "s", 1, ids), _header(pool, "s", 2, ids)
    assert h1.layer_nbytes(0) * 2 <= outgoing._GROUP_BYTES < h1.layer_nbytes(0) * 3
    together: list[list[control.Kind]] = []
    paced: list[list[control.Kind]] = []

    async def body(sender: KvSender, receiver: KvReceiver, address: str) -> None:
        for h, writes, pace_s in ((h1, together, 0.0), (h2, paced, 0.05)):
            undo = _writes(writes)
            try:
                await _send(sender, address, pool, h, ids, pace_s=pace_s)
            finally:
                undo()
            await _landed(receiver, pool, h, ids)

    _run(body)
    assert [w.count(control.Kind.READ) for w in together if control.Kind.READ in w] == [2, 2]
    assert [w.count(control.Kind.READ) for w in paced if control.Kind.READ in w] == [1] * LAYERS
    assert all(n <= incoming._JOINED_READ_BYTES for n in plane_reads)


def test_a_registration_failing_mid_group_releases_what_the_group_took(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Pieces read in place, a group of two segments: the first lies in the registered
    region, the second's memory cannot be registered. The transfer fails, and after its
    hold the region's registration has no user left (else `unregister_region` would wait
    for it forever and its key never be withdrawn)."""
    monkeypatch.setattr(kv_bytes, "STAGE_PIECE_BYTES", 0)
    pool, other, ids = _pool(31), _pool(32), [3, 4, 11]
    hold_s = 0.3

    async def body(sender: KvSender, receiver: KvReceiver, address: str) -> None:
        region = sender.registry.register_region(pool.ctypes.data, pool.nbytes, pool)
        real = sender.registry._register

        def register(at: int, length: int) -> tuple[bytes, object]:
            if at == other.ctypes.data:
                raise errors.TransportError("cannot register")
            return real(at, length)

        monkeypatch.setattr(sender.registry, "_register", register)
        h = _header(pool, "z", 1, ids)

        async def send() -> None:
            async with await sender.open(address, h) as t:
                await t.send_layer(0, *_pieces(pool, 0, ids))  # in the region
                await t.send_layer(1, *_pieces(other, 1, ids))  # not registrable
                for i in range(2, LAYERS):
                    await t.send_layer(i, *_pieces(pool, i, ids))
                await t.finish()

        with pytest.raises(errors.TransportError, match="cannot register"):
            await send()
        await asyncio.sleep(hold_s * 3)
        assert region.users == 0

    _run(body, hold_s=hold_s)


def test_a_whole_kv_over_many_segments_of_one_region_leaves_no_user_after_done() -> None:
    """A KV sent whole (`KvSender.send`, folded) whose layers lie apart in one registered
    region, a segment each: every segment's descriptors take a user of the region's
    registration, and DONE gives every one back — else `unregister_region` would wait for
    users that never leave, and its key would never be withdrawn."""
    rng = np.random.default_rng(21)
    big = rng.standard_normal((LAYERS, 3, 2, 65536), np.float32)  # [:, 2]: a gap per layer
    layers = [(big[i, 0], big[i, 1]) for i in range(LAYERS)]

    async def body(sender: KvSender, receiver: KvReceiver, address: str) -> None:
        region = sender.registry.register_region(big.ctypes.data, big.nbytes, big)
        for epoch in (1, 2):
            h = wire.header_for("w", epoch, testing.FINGERPRINT, wire.DType.FLOAT32, layers)
            assert len(wire.segments(h, sender.settings.segment_bytes)) == LAYERS
            await sender.send(address, wire.KvCache(h, tuple(layers)))
            got = await receiver.take("w", epoch, 5)
            try:
                assert [k.tobytes() for k, _ in got.layers] == [k.tobytes() for k, _ in layers]
            finally:
                got.release()
            assert region.users == 0

    _run(body)
