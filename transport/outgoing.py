"""One KV transfer in progress on the sending side: `OutgoingTransfer`, what
`KvSender.open` returns (`transport.sender` has the whole protocol's story).

Layer by layer: `send_layer` takes layer *i* as soon as it exists — as tensors, or as
pieces of memory — and returns at once; a *segment* (consecutive layers, `wire.segments`)
starts moving as soon as its last layer is given, its checksums taken in a thread and its
frames sent after it; `send_all` gives a whole KV in batches; `hold` keeps the receiver's
idle deadline for a live producer; `finish` returns once the receiver verified every layer;
`abort` (or leaving ``async with`` on an error) tells the receiver to discard what it has.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Coroutine
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from transport import control, errors, kv_bytes, wire
from transport.kv_bytes import Parts, Pieces
from transport.link import Link
from transport.registry import Registration

if TYPE_CHECKING:
    from transport.sender import Held, KvSender

__all__ = ["OutgoingTransfer", "Pool"]

log = logging.getLogger(__name__)

T = TypeVar("T")
_ALIVE = control.encode(control.Kind.ALIVE)
"""The keepalive `OutgoingTransfer.hold` sends (no body: encoded once)."""
_BATCH_BYTES = 512 << 10
"""Inline (`OutgoingTransfer.send_all`): payload bytes per batch of layers, checksummed
together (on the loop: below the sender's thread bound) then written together. 4 MiB
batches, checksummed in a thread, leave the link idle meanwhile; at 16 MiB they measured
no better than a write per layer, and in some runs worse (`bench transport`, tcp)."""


_GROUP_BYTES = 256 << 10
"""One-sided: segments that complete before the sender's loop turns go out together
(`OutgoingTransfer._grouped`), up to this many payload bytes: one task, one checksum pass,
one staging copy, one write of READs and frames (given as arrays: the READs, then the
frames once summed) — where each segment cost a task, a pass, a copy, a registration
lookup and a write (and a read on the other side). A segment that completes alone (a
forward slower than the link) still goes at once; larger groups (4 MiB) held the receiver
idle while a group was summed and copied (16 MiB 6 → 10 ms)."""


class Pool:
    """Idle links to one receiver address, and a cap on concurrent transfers to it."""

    def __init__(self, limit: int) -> None:
        self.idle: list[tuple[Link, float]] = []
        """Links between transfers, and since when (monotonic)."""
        self.slots = asyncio.Semaphore(limit)


class OutgoingTransfer:
    """One transfer in progress. Use as ``async with``: leaving on an error aborts it."""

    def __init__(
        self, sender: KvSender, pool: Pool, link: Link, header: wire.KvHeader, tag: int
    ) -> None:
        self._sender = sender
        self._pool = pool
        self._link = link
        self.header = header
        self._tag = tag
        self._sent: set[int] = set()
        self._in_flight: list[asyncio.Task[None]] = []
        self._settings = sender.settings
        self._segments = wire.segments(header, self._settings.segment_bytes)
        self._segment_of = {i: n for n, seg in enumerate(self._segments) for i in seg}
        self._missing = [len(seg) for seg in self._segments]
        self._outgoing: dict[int, tuple[list[memoryview], list[memoryview]]] = {}
        """Layers of incomplete segments: buffers as checksummed, buffers as sent."""
        self._used: list[Registration] = []
        self._buffers: list[memoryview] = []
        """One-sided: the registrations the transfer uses and its buffers (kept alive until
        it ended: the receiver reads them)."""
        self._in_place: set[int] = set()
        """One-sided: layers given in pieces (memory the transfer does not own)."""
        self._staged: list[np.ndarray] = []
        """One-sided: staging buffers of segments of small pieces (`_expose_pieces`), back
        to the sender's pool once nothing reads them."""
        self._forming: list[tuple[int, Parts]] | None = None
        """One-sided: the newest group of complete segments, while its task has not
        started: a segment that completes meanwhile joins it (`_grouped`)."""
        self._forming_bytes = 0
        self._deadline = time.monotonic() + self._settings.transfer_timeout_s
        self._state = "open"
        self.bytes_sent = 0

    @property
    def token(self) -> int:
        """The transfer token the receiver issued (out of band, the payload's tag)."""
        return self._tag

    def _wait_s(self) -> float:
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            raise errors.TransferTimeoutError(
                f"transfer of {self.header.request_id!r} exceeded "
                f"{self._settings.transfer_timeout_s}s"
            )
        return min(remaining, self._settings.idle_timeout_s)

    async def send_layer(
        self,
        index: int,
        k: np.ndarray | Pieces,
        v: np.ndarray | Pieces,
        scales: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> None:
        """Send layer ``index``: K and V, and their float32 scales when the header is scaled
        (`wire.ScaleLayout`; one scale per slice of the first axis). K and V may instead be
        given as pieces (`Pieces`, unscaled only): one-sided, read where they lie and kept
        untouched by the caller until the transfer ended; otherwise joined (one copy)."""
        if self._state != "open":
            raise errors.TransportClosedError(f"transfer is {self._state}")
        h = self.header
        if not 0 <= index < len(h.layers) or index in self._sent:
            raise errors.WireFormatError(f"layer {index} is out of range or already sent")
        if isinstance(k, np.ndarray) != isinstance(v, np.ndarray):
            raise errors.WireFormatError(f"layer {index}: K and V must both be arrays or pieces")
        if isinstance(k, np.ndarray) or isinstance(v, np.ndarray):
            assert isinstance(k, np.ndarray)
            assert isinstance(v, np.ndarray)
            summed, sent = self._sender._layer(h, index, k, v, scales)
        else:
            pieces = kv_bytes.layer_pieces(h, index, k, v, scales)
            if self._sender._plane.one_sided:
                summed = sent = pieces
                self._in_place.add(index)
            else:  # no one-sided reads: one copy
                kn = h.layers[index].k_nbytes(h.dtype)
                joined = np.frombuffer(b"".join(pieces), np.uint8)
                shape = h.layers[index]
                jk = joined[:kn].view(h.dtype.numpy_dtype).reshape(shape.k)
                jv = joined[kn:].view(h.dtype.numpy_dtype).reshape(shape.v)
                summed, sent = self._sender._layer(h, index, jk, jv, None)
        if self._sender.delay_hook is not None and (held := self._sender.delay_hook(index)) > 0:
            await asyncio.sleep(min(held, self._wait_s()))  # a slow link, within the deadline
        plane = self._sender._plane
        nbytes = sum(b.nbytes for b in summed)
        try:
            if plane.inline:
                (csum,) = await self._sender.checksums([summed])
                await self._send_frame(wire.LayerFrame(index, nbytes, csum))
                await self._link.send_payload(sent, self._wait_s())
            else:
                self._out_of_band(index, summed, sent)
        except BaseException:
            await self._fail()
            raise
        self._sent.add(index)
        self.bytes_sent += nbytes

    async def send_all(self, cache: wire.KvCache) -> None:
        """Inline (TCP), the whole KV at hand: every layer's LAYER frame and payload, in
        batches of about `_BATCH_BYTES` — each batch's checksums at once, then its frames
        and payloads in one `Link.send_batch`, which drains only when the transport holds
        much unsent. Per layer, a frame write, a drain and a race of the pending read cost
        ~140 µs; the receiver reads batched frames in place. A layer `delay_hook` holds
        back goes out after the layers before it were written."""
        if self._state != "open":
            raise errors.TransportClosedError(f"transfer is {self._state}")
        h = self.header
        if self._sent or len(cache.layers) != len(h.layers):
            raise errors.WireFormatError(f"{len(cache.layers)} layers; the header: {len(h.layers)}")
        scaled = h.scales is not wire.ScaleLayout.NONE
        try:
            batch: Parts = []
            size = 0
            for i, (k, v) in enumerate(cache.layers):
                summed, sent = self._sender._layer(h, i, k, v, cache.scales[i] if scaled else None)
                delay = self._sender.delay_hook
                if delay is not None and (held := delay(i)) > 0:  # a slow link: what was
                    if batch:  # given before this layer leaves before the delay
                        await self._send_batch(batch)
                        batch, size = [], 0
                    await asyncio.sleep(min(held, self._wait_s()))
                batch.append((i, summed, sent))
                size += sum(b.nbytes for b in summed)
                if size >= _BATCH_BYTES or i == len(h.layers) - 1:
                    await self._send_batch(batch)
                    batch, size = [], 0
        except BaseException:
            await self._fail()
            raise

    async def _send_batch(self, parts: Parts) -> None:
        sums = await self._sender.checksums([summed for _, summed, _ in parts])
        chunks: list[bytes | memoryview] = []
        for (i, summed, sent), csum in zip(parts, sums, strict=True):
            nbytes = sum(b.nbytes for b in summed)
            frame = wire.encode_layer_frame(wire.LayerFrame(i, nbytes, csum))
            chunks.append(control.encode(control.Kind.LAYER, frame))
            chunks.extend(sent)
            self._sent.add(i)
            self.bytes_sent += nbytes
        await self._link.send_batch(chunks, self._wait_s())

    def _start(self, coro: Coroutine[Any, Any, None], what: str) -> None:
        name = f"pdorch-kv-{self.header.request_id}-{what}"
        self._in_flight.append(asyncio.create_task(coro, name=name))

    async def _send_frame(self, frame: wire.LayerFrame) -> None:
        msg = control.encode(control.Kind.LAYER, wire.encode_layer_frame(frame))
        await self._link.send(msg, self._wait_s())

    def _out_of_band(self, index: int, summed: list[memoryview], sent: list[memoryview]) -> None:
        """Layer ``index`` is given: once its segment is complete, move it."""
        seg = self._segment_of[index]
        self._outgoing[index] = (summed, sent)
        self._missing[seg] -= 1
        if self._missing[seg]:
            return
        parts = [(i, *self._outgoing.pop(i)) for i in self._segments[seg]]
        if self._sender._plane.one_sided:
            self._grouped(seg, parts)
        else:
            self._start(self._send_segment(seg, parts), f"segment-{seg}")

    def _grouped(self, seg: int, parts: Parts) -> None:
        """One-sided: expose a complete segment — with the group still forming, if it
        fits (`_GROUP_BYTES`) and is given the same way (pieces or arrays), else in a new
        group and task of its own. A group's task closes it when it starts, so every
        segment that completed before the loop turned goes with it, and groups still run
        side by side (one's checksums in the thread while another's message is written)."""
        size = _nbytes(parts)
        forming = self._forming
        if (
            forming is not None
            and self._forming_bytes + size <= _GROUP_BYTES
            and self._given_in_pieces(forming[0][1]) == self._given_in_pieces(parts)
        ):
            forming.append((seg, parts))
            self._forming_bytes += size
            return
        group = self._forming = [(seg, parts)]
        self._forming_bytes = size
        self._start(self._expose(group), f"segment-{seg}")

    def _given_in_pieces(self, parts: Parts) -> bool:
        return any(i in self._in_place for i, _, _ in parts)

    async def _expose(self, group: list[tuple[int, Parts]]) -> None:
        """One-sided: tell the receiver where the segments are at once (it starts
        reading) — KEYS first for memory its link does not know yet — then checksum their
        layers in one thread hop meanwhile and send their frames; the receiver verifies
        each layer once both are in."""
        if self._forming is group:
            self._forming = None  # started: later segments form a group of their own
        if self._given_in_pieces(group[0][1]):
            await self._expose_pieces(group)
            return
        per_read, used = self._acquire_each(
            [[b for _, _, sent in parts for b in sent] for _, parts in group]
        )
        message = self._sender.announce(self._link, used)
        message += b"".join(map(control.read, [seg for seg, _ in group], per_read))
        await self._link.send(message, self._wait_s())
        await self._send_frames([part for _, parts in group for part in parts])

    async def _expose_pieces(self, group: list[tuple[int, Parts]]) -> None:
        """Segments with layers in pieces (memory the transfer does not own): checksums
        first, then KEYS, the READs and LAYERS in one message. Checked against the bytes
        as they were given, a read that finds them changed (re-used after the transfer
        failed) is refused. Small pieces, or more than one READ names, are staged
        (`kv_bytes.staged`): copied after their checksums, in the same thread hop, into
        one pooled buffer for the group, each segment's READ naming its part of it — a
        piece changed before its copy is refused just the same."""
        sender = self._sender
        hook = sender.exposed_hook
        per_segment = [[b for _, _, sent in parts for b in sent] for _, parts in group]
        bufs = [b for seg_bufs in per_segment for b in seg_bufs]
        sizes = [sum(b.nbytes for b in seg_bufs) for seg_bufs in per_segment]
        stage = any(kv_bytes.staged(seg_bufs) for seg_bufs in per_segment)
        staging = sender.staging.acquire(sum(sizes)) if stage else None
        layers = [part for _, parts in group for part in parts]

        def then() -> None:  # in the checksum thread for a large group
            if hook is not None:
                for seg, _ in group:
                    hook(seg)
            if staging is not None:
                kv_bytes.copy_into(staging, bufs)

        sums = await sender.checksums([summed for _, summed, _ in layers], then)
        if staging is not None:  # (were the wait cancelled, the copy's buffer is dropped)
            self._staged.append(staging)
            self._buffers.append(staging.data)
            descs, used = sender.registry.acquire([staging.data])
            self._used.extend(used)
            per_read = kv_bytes.split_descriptors(descs, sizes)
        else:
            per_read, used = self._acquire_each(per_segment)
        message = sender.announce(self._link, used)
        segments = [seg for seg, _ in group]
        message += b"".join(map(control.read, segments, per_read))
        message += control.encode(control.Kind.LAYERS, kv_bytes.frames(layers, sums))
        await self._link.send(message, self._wait_s())

    def _acquire_each(
        self, per_segment: list[list[memoryview]]
    ) -> tuple[list[list[control.Descriptor]], list[Registration]]:
        """Each segment's descriptors, registering memory not registered yet, and the
        registrations they took. Each is recorded as the transfer's at once: a later one's
        registration failing fails the transfer, which releases (after its hold) what the
        earlier ones took."""
        per_read: list[list[control.Descriptor]] = []
        used: list[Registration] = []
        for bufs in per_segment:
            self._buffers.extend(bufs)
            descs, regs = self._sender.registry.acquire(bufs)
            self._used.extend(regs)
            per_read.append(descs)
            used += regs
        return per_read, used

    async def _send_frames(self, parts: Parts) -> None:
        sums = await self._sender.checksums([summed for _, summed, _ in parts])
        frames = kv_bytes.frames(parts, sums)
        await self._link.send(control.encode(control.Kind.LAYERS, frames), self._wait_s())

    async def _send_segment(self, seg: int, parts: Parts) -> None:
        """Start the segment's payload (the receiver posted its receive already), checksum
        its layers meanwhile in one thread hop, send their frames in one write, then wait
        for the payload to be delivered."""
        plane = self._sender._plane
        tag = control.layer_tag(self._tag, seg)
        bufs = [b for _, _, sent in parts for b in sent]
        payload = asyncio.create_task(
            plane.send(self._link.peer, tag, bufs), name=f"pdorch-kv-payload-{seg}"
        )
        try:
            await self._send_frames(parts)
            await payload
        finally:
            if not payload.done():
                payload.cancel()

    async def hold(self, producing: Awaitable[T]) -> T:
        """Await ``producing`` (the engine computing the next layer), telling the receiver
        every ``keepalive_s`` that this sender is alive (ALIVE): a forward slower than the
        receiver's idle deadline is not a dead peer, while a stopped sender still is. A
        receiver that died or gave up meanwhile is found by the next ALIVE (its ERROR, or
        the connection lost); the transfer's own deadline bounds the wait. Not concurrent
        with `send_layer` (an ALIVE never splits a frame from its payload)."""
        if self._state != "open":
            raise errors.TransportClosedError(f"transfer is {self._state}")
        task = asyncio.ensure_future(producing)
        try:
            while True:
                wait_s = min(self._settings.keepalive_s, self._wait_s())
                done, _ = await asyncio.wait({task}, timeout=wait_s)
                if done:
                    return task.result()
                try:
                    await self._link.send(_ALIVE, self._wait_s())
                except BaseException:
                    await self._fail()
                    raise
        finally:
            if not task.done():
                task.cancel()

    async def finish(self) -> None:
        """Wait until the receiver verified every layer; then the link returns to the pool."""
        if self._state != "open":
            raise errors.TransportClosedError(f"transfer is {self._state}")
        if len(self._sent) != len(self.header.layers):
            missing = sorted(set(range(len(self.header.layers))) - self._sent)
            await self.abort("finished with missing layers")
            raise errors.WireFormatError(f"finish() with layers not sent: {missing[:8]}")
        try:
            while self._in_flight:  # each popped once done: `_fail` reaps the rest
                await self._link.race(self._in_flight[0], self._wait_s(), what="a layer send")
                self._in_flight.pop(0)
            msg = await self._link.read_next(self._wait_s())
            while msg.kind is control.Kind.LANDED:  # one-sided: the receiver is reading
                msg = await self._link.read_next(self._wait_s())
        except BaseException:
            await self._fail()
            raise
        if msg.kind is control.Kind.DONE:
            self._state = "done"
            self._sender._release_registrations(self._used)
            self._sender.unstage(self._staged)
            self._used, self._buffers, self._staged = [], [], []
            self._sender._release(self._pool, self._link, reusable=True)
            return
        await self._fail()
        if msg.kind is control.Kind.ERROR:
            raise control.parse_error(msg.body)
        raise errors.WireFormatError(f"expected DONE, got {msg.kind.name}")

    async def abort(self, reason: str = "aborted by sender") -> None:
        """Tell the receiver to discard the partial KV. Idempotent."""
        if self._state != "open":
            return
        with contextlib.suppress(errors.TransportError):
            await self._link.send(
                control.encode(control.Kind.ABORT, reason.encode()[:1000]),
                min(1.0, self._settings.idle_timeout_s),
            )
        await self._fail()

    async def _fail(self) -> None:
        if self._state != "open":
            return
        self._state = "failed"
        if any(not t.done() for t in self._in_flight):
            # Out-of-band sends still posted reference our buffers: cancel them. Only this
            # link's channel: other transfers to the same peer go on (issue 18).
            self._sender._plane.fail_channel(self._link.peer)
        self._forming = None
        for t in self._in_flight:
            t.cancel()
        for t in self._in_flight:
            with contextlib.suppress(BaseException):
                await t
        self._in_flight.clear()
        if self._used or self._staged:
            # The receiver may still be reading (it aborts its reads within its idle
            # deadline): the buffers stay referenced, so never freed under a read, until then.
            held: Held = (self._used, self._buffers, self._staged)
            self._used, self._buffers, self._staged = [], [], []
            self._sender._quarantine(held, self._settings.idle_timeout_s)
        await self._link.close()
        self._sender._release(self._pool, self._link, reusable=False)

    async def __aenter__(self) -> OutgoingTransfer:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is not None:
            await self.abort(f"sender error: {type(exc).__name__}")
        elif self._state == "open":
            await self.abort("transfer left without finish()")


def _nbytes(parts: Parts) -> int:
    return sum([b.nbytes for _, _, sent in parts for b in sent])
