"""One KV transfer being received: what `KvReceiver` does with an OPEN it accepted
(`transport.receiver` has the whole protocol's story).

An eager KV that came whole in its OPEN is checked and taken in one pass (`whole`,
`take_whole`: every frame against the header, one copy, every layer verified); any other
transfer runs the layer loop (`Receive`): inline (TCP) payloads read after their frames,
one-sided READs of the sender's memory, or tagged receives posted before ACCEPT — each
layer verified against its frame's checksum as it lands, in a thread for large ones. The
remote keys a one-sided link announces are learned here too (`learn_keys`), bounded per
link.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from transport import control, errors, wire
from transport.base import DataPlane, TransportSettings
from transport.link import Link, wait_first

log = logging.getLogger(__name__)


MAX_KEYS_PER_LINK = 4096
"""One-sided: keys a link may hold at once — one per live allocation of the sender's that
the link carried (freed ones are withdrawn); at most ~4 MiB with the longest remote keys."""


def inline(folded: Sequence[control.Folded]) -> bool:
    """Whether an OPEN carries its payload (eager: a PAYLOAD folded in)."""
    return any(isinstance(m, control.Inline) for m in folded)


def check_inline(header: wire.KvHeader, folded: Sequence[control.Folded]) -> None:
    """An eager payload (PAYLOAD, at most `control.EAGER_BYTES` whatever the sender's own
    bound, `control.decode_head`) is exactly the checked header's payload size, and comes
    once — before any memory is taken for it."""
    inline = [m.body for m in folded if isinstance(m, control.Inline)]
    if not inline:
        return
    if len(inline) > 1 or inline[0].nbytes != header.payload_bytes:
        raise errors.WireFormatError(
            f"an inline payload of {sum(v.nbytes for v in inline)} bytes in "
            f"{len(inline)} messages; the header declares {header.payload_bytes}"
        )
    if any(m.kind in (control.Kind.READ, control.Kind.KEYS) for m in folded):
        # (on a receiver without a one-sided path too: nothing is ever read for it)
        raise errors.WireFormatError("an eager OPEN carries its payload: no READ or KEYS")


def whole(header: wire.KvHeader, folded: Sequence[control.Folded]) -> bool:
    """Whether an eager OPEN holds the whole transfer as a sender writes it: its payload
    (checked against the header's size, `check_inline`), then one LAYERS message with as
    many frames as the header has layers (`take_whole`). Anything else — frames in more
    messages, some on the link after it — takes the layer loop (`Receive`)."""
    if len(folded) != 2:
        return False
    inline, layers = folded
    return (
        isinstance(inline, control.Inline)
        and isinstance(layers, control.Message)
        and layers.kind is control.Kind.LAYERS
        and len(layers.body) == len(header.layers) * wire.LAYER_FRAME_SIZE
    )


def take_whole(
    header: wire.KvHeader,
    payload: np.ndarray,
    folded: Sequence[control.Folded],
    check_finite: bool,
) -> None:
    """An eager KV whole in its OPEN (`whole`): every frame checked against the header
    (declared, each layer once, of its length: with as many frames as layers, every layer
    has one), the payload copied in once and each layer verified against its frame — what
    the layer loop does with it, in one pass, without its bookkeeping, a coroutine or a
    loop turn (~10 µs of ~22 for 32 layers)."""
    inline, layers = folded
    assert isinstance(inline, control.Inline)
    assert isinstance(layers, control.Message)
    indices, sums = wire.frame_sums(header, layers.body, frozenset())
    flat = payload.data.cast("B")
    if inline.body.nbytes != flat.nbytes:  # `check_inline` refused it already
        raise errors.WireFormatError("an inline payload of the wrong size")
    flat[:] = inline.body
    bounds = header.bounds
    if not check_finite:
        batch = [
            (i, c, flat[bounds[i] : bounds[i + 1]], 0) for i, c in zip(indices, sums, strict=True)
        ]
        wire.verify_layers(batch, None)
        return
    dtype = header.dtype
    batch = [
        (i, c, flat[bounds[i] : bounds[i + 1]], header.layers[i].nbytes(dtype))
        for i, c in zip(indices, sums, strict=True)
    ]
    wire.verify_layers(batch, dtype)


def learn_keys(link: Link, body: bytes) -> None:
    for key in control.parse_keys(body):
        if key.key_id in link.keys:  # ids are never reused: its unpacked key may be cached
            raise errors.WireFormatError(f"key {key.key_id} announced twice on a link")
        if len(link.keys) >= MAX_KEYS_PER_LINK:
            raise errors.WireFormatError(f"more than {MAX_KEYS_PER_LINK} keys on a link")
        link.keys[key.key_id] = key


@dataclasses.dataclass
class Receive:
    """The layer loop of one accepted transfer.

    Inline (TCP): each LAYER frame is followed by its payload on the link; verification of
    layer *i* runs in a thread while layer *i+1* is read. One-sided (UCX): each READ
    message starts the read of that segment from the sender's memory into its slice of the
    payload (`_read_segment`). Tagged (UCX v1): the receive of every segment is posted
    before ACCEPT goes out (tags and sizes follow from the header), so payloads land as
    soon as the sender starts them. Either way out of band, a layer is verified once both
    its segment and its frame (which carries the checksum, and may come later) are in.
    """

    plane: DataPlane
    link: Link
    header: wire.KvHeader
    tag: int
    """The transfer's token (`control.new_token`): out of band, segment n's tag."""
    payload: np.ndarray
    settings: TransportSettings
    segment_bytes: int
    one_sided: bool
    """Opened by OPEN_READ2: the payload is read, or (eager, on any backend) came inline
    in the OPEN — never on the link after a LAYER frame."""
    sums: dict[int, int] = dataclasses.field(default_factory=dict)
    """Layer index → checksum, from the frames received so far (each checked against the
    header: declared, not repeated, of the declared length)."""
    landed: set[int] = dataclasses.field(default_factory=set)
    receiving: dict[asyncio.Task[None], range] = dataclasses.field(default_factory=dict)
    checking: set[asyncio.Task[None]] = dataclasses.field(default_factory=set)
    """Reads that verify their segment where they complete (`_verifier`)."""
    read_verified: int = 0
    """Layers verified where their read completed."""
    holding: bool = False
    """While the OPEN's folded messages are taken: reads announced wait for the rest, so
    that checksums folded after a READ are known when it starts (`start_reads`)."""
    verifying: dict[asyncio.Task[None], int] = dataclasses.field(default_factory=dict)
    ready: list[int] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        self.offsets = self.header.layer_offsets()
        self.flat = self.payload.data.cast("B")
        """The payload as bytes: a layer's view is a slice of it (numpy's slicing costs
        ~1 µs more per layer, and a transfer slices every layer)."""
        self.segments = wire.segments(self.header, self.segment_bytes)
        self.reading: set[int] = set()
        """One-sided: segments announced (each is read once)."""
        self.queued: list[tuple[int, list[control.RemoteRegion]]] = []
        """One-sided: announced segments waiting for a read slot (`_MAX_READS`)."""
        self.spoke_at = time.monotonic()
        """When this side last told the sender it is alive (its ACCEPT, then LANDED)."""
        self.told = 0
        """Layers landed when the last LANDED went out."""

    def segment_view(self, n: int) -> memoryview:
        return self._layers_view(self.segments[n])

    def _segment_bytes(self, n: int) -> int:
        seg, bounds = self.segments[n], self.header.bounds
        return bounds[seg.stop] - bounds[seg.start]

    def view(self, index: int) -> memoryview:
        off = self.offsets[index]
        return self.flat[off : off + self.header.layer_nbytes(index)]

    def values(self, index: int) -> int:
        """Bytes of layer ``index``'s K and V values (its scales, if any, follow them)."""
        return self.header.layers[index].nbytes(self.header.dtype)

    def post_receives(self) -> None:
        """Out-of-band only: post every segment's receive into its slice of the payload."""
        for n, seg in enumerate(self.segments):
            view = self.segment_view(n)
            coro = self.plane.recv(self.link.peer, control.layer_tag(self.tag, n), view)
            self.receiving[asyncio.create_task(coro, name=f"pdorch-kv-recv-{n}")] = seg

    async def run(self) -> None:
        h, link, s = self.header, self.link, self.settings
        deadline = time.monotonic() + s.transfer_timeout_s
        verified = 0
        try:
            verified += self._start_verifying()  # what landed in place, before any wait
            if self.plane.inline:
                verified += await self._read_inline(deadline)
            while verified + self.read_verified < len(h.layers):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise errors.TransferTimeoutError(
                        f"transfer exceeded {s.transfer_timeout_s}s "
                        f"({verified + self.read_verified} layers)"
                    )
                watch: list[asyncio.Future[Any]] = [*self.receiving, *self.verifying]
                # Keep a read outstanding even when all frames are in: it sees the peer's EOF.
                reading = len(self.sums) < len(h.layers) or not self.plane.inline
                if reading and not watch:  # only the link to wait for: read it in place
                    idle_s = min(remaining, s.idle_timeout_s)
                    await self._on_message(await link.read_next(idle_s))
                    if self.one_sided:  # segments may have been read in place meanwhile
                        await self._tell_alive()
                    verified += self._start_verifying()
                    continue
                if reading:
                    watch.append(link.pending())
                await wait_first(
                    watch, min(remaining, s.idle_timeout_s), what="layer data", on_timeout=link
                )
                for task in [t for t in self.verifying if t.done()]:
                    verified += self.verifying.pop(task)
                    task.result()
                await self._collect_landed()
                if reading and link.pending().done():
                    await self._on_message(link.take_pending())
                verified += self._start_verifying()
        finally:
            await self.cancel_pending()

    async def cancel_pending(self) -> None:
        """Cancel what is still in flight — receives, reads, verifications — once the
        transfer ended or failed (before its loop too: `KvReceiver._receive`)."""
        unfinished = [*self.receiving, *self.verifying]
        if self.receiving:  # posted receives must not outlive the buffer: cancel them
            self.plane.fail_channel(self.link.peer)  # this transfer's only (issue 18)
        for task in unfinished:
            task.cancel()
        for task in unfinished:
            with contextlib.suppress(BaseException):
                await task

    async def _read_inline(self, deadline: float) -> int:
        """Inline (TCP): frames and payloads follow each other on the link, as does any
        ABORT, and a dead or silent peer ends the read itself (EOF, the idle deadline):
        read them in turn, in place — no task and no loop turn per frame while the bytes
        are buffered. Verification batches started meanwhile are checked between frames
        (a failed checksum ends the read there). Returns the layers verified."""
        h, s = self.header, self.settings
        verified = 0
        while len(self.sums) < len(h.layers):
            for task in [t for t in self.verifying if t.done()]:
                verified += self.verifying.pop(task)
                task.result()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise errors.TransferTimeoutError(
                    f"transfer exceeded {s.transfer_timeout_s}s ({len(self.sums)} layers)"
                )
            await self._on_message(await self.link.read_next(min(remaining, s.idle_timeout_s)))
            verified += self._start_verifying()
        return verified

    async def _collect_landed(self) -> None:
        """File the segments whose payload is in; one-sided, start the next reads and tell
        the sender, at most every ``keepalive_s`` (it has nothing in flight to watch: this
        is its sign of life; one per segment cost each side a message per layer, and the
        vLLM connector sends a segment per layer)."""
        for task in [t for t in self.receiving if t.done()]:
            seg = self.receiving.pop(task)
            checked = task in self.checking
            self.checking.discard(task)
            task.result()
            self._landed(seg, verified=checked)
        if self.one_sided:
            self.start_reads()
            await self._tell_alive()

    async def _tell_alive(self) -> None:
        """One-sided: LANDED if segments landed since the last one, more are to come (after
        the last, DONE or ERROR follows) and ``keepalive_s`` passed — or half the idle
        deadline, if that is shorter (the sender's is taken to be this side's)."""
        more = self.receiving or len(self.reading) < len(self.segments)
        now = time.monotonic()
        every_s = min(self.settings.keepalive_s, self.settings.idle_timeout_s / 2)
        if more and len(self.landed) > self.told and now - self.spoke_at >= every_s:
            self.told, self.spoke_at = len(self.landed), now
            await self.link.send(_LANDED, self.settings.idle_timeout_s)

    def _maybe_verify(self, index: int) -> None:
        if index in self.sums and index in self.landed:
            self.ready.append(index)

    def _start_verifying(self) -> int:
        """Verify every layer that is ready, in one thread hop (a segment's layers land
        together; a hop per layer cost more than the checksums themselves); a small batch
        right here (returns how many layers it verified)."""
        if not self.ready:
            return 0
        finite = self.header.dtype if self.settings.check_finite else None
        batch = self._batch(self.ready, finite)
        self.ready = []
        tail = not self.receiving and len(self.sums) == len(self.header.layers)
        limit = _TAIL_VERIFY_BYTES if tail else _THREAD_VERIFY_BYTES
        nbytes = _nbytes(batch)
        if nbytes < limit:  # a task or thread costs more than this
            _verify_all(batch, finite)
            return len(batch)
        parts = [batch]
        if not self.receiving and len(batch) > 1 and nbytes >= _SPLIT_TAIL_BYTES:
            # Nothing left to land: this is the tail every transfer waits on, and the copy
            # no longer needs a core. Two threads verify it in half the time.
            half = len(batch) // 2
            parts = [batch[:half], batch[half:]]
        for part in parts:
            task = asyncio.create_task(_verify(part, finite), name="pdorch-kv-verify")
            self.verifying[task] = len(part)
        return 0

    def _batch(self, indices: Sequence[int], finite: wire.DType | None) -> Batch:
        sums, flat, offsets = self.sums, self.flat, self.header.bounds
        if finite is None:  # the value bytes only matter to the finite check
            return [(i, sums[i], flat[offsets[i] : offsets[i + 1]], 0) for i in indices]
        return [(i, sums[i], flat[offsets[i] : offsets[i + 1]], self.values(i)) for i in indices]

    def _verifier(self, layers: range, last: int) -> Callable[[], None] | None:
        """The verification of a read's ``layers`` (segments up to ``last``), run where
        the read completes — the read's thread hop and loop turn then serve both (a second
        hop for the checksums cost ~0.2 ms of a 4 MiB transfer's ~1.5 here) — if it ends
        with the last segment and every checksum of its layers is in (a folded KV's, up to
        `sender._FOLD_CHECKSUM_BYTES`). An earlier segment's would hold up the next read
        in the same thread: verified apart."""
        if last != len(self.segments) - 1 or any(i not in self.sums for i in layers):
            return None
        finite = self.header.dtype if self.settings.check_finite else None
        return functools.partial(_verify_all, self._batch(layers, finite), finite)

    async def _on_message(self, msg: control.Message) -> None:
        await self._take(msg)
        if self.queued and not self.holding and not self._more_to_join():
            self.start_reads()

    def _more_to_join(self) -> bool:
        """Whether to take the sender's next message before starting the reads queued:
        it is buffered already (the rest of a write: its READs may join these, read as
        one, `start_reads`) and what is queued is small enough to join more. Never past
        `_JOINED_READ_BYTES`: a sender writing segment after segment keeps the buffer
        full, and waiting for it to drain left the reads idle (16 MiB 6 → 8 ms)."""
        if not self.link.message_ready():
            return False
        return sum(self._segment_bytes(n) for n, _ in self.queued) < _JOINED_READ_BYTES

    async def _take(self, msg: control.Message) -> None:
        if msg.kind is control.Kind.ALIVE:  # the sender's next layer is being computed
            return
        if msg.kind is control.Kind.ABORT:
            raise errors.PeerLostError(f"sender aborted: {msg.body.decode(errors='replace')}")
        if msg.kind is control.Kind.READ and self.one_sided:
            self._read_segment(*control.parse_read(msg.body))
            return
        if msg.kind is control.Kind.KEYS and self.one_sided:  # new memory, this transfer's
            learn_keys(self.link, msg.body)
            return
        if msg.kind is control.Kind.LAYERS and (self.one_sided or not self.plane.inline):
            indices, sums = wire.frame_sums(self.header, msg.body, self.sums.keys())
            self.sums.update(zip(indices, sums, strict=True))
            landed = self.landed
            self.ready.extend([i for i in indices if i in landed])
            return
        if msg.kind is not control.Kind.LAYER:
            raise errors.WireFormatError(f"unexpected {msg.kind.name} during a transfer")
        frame = self._on_frame(wire.decode_layer_frame(msg.body))
        if self.plane.inline and not self.one_sided:  # (eager: the payload is in)
            await self.link.read_into(self.view(frame.index), self.settings.idle_timeout_s)
            self.landed.add(frame.index)
            self._maybe_verify(frame.index)

    def _read_segment(self, n: int, descriptors: list[control.Descriptor]) -> None:
        """Start reading segment ``n`` into its slice of our buffer — the only memory the
        read may write: its descriptors must add up to exactly that slice's length, each
        within a key this link holds (announced, not withdrawn)."""
        if not 0 <= n < len(self.segments) or n in self.reading:
            raise errors.WireFormatError(f"READ {n} out of range or repeated")
        view = self.segment_view(n)
        regions = []
        for d in descriptors:
            key = self.link.keys.get(d.key_id)
            if key is None:
                raise errors.WireFormatError(
                    f"READ {n} names key {d.key_id}, which this link does not hold "
                    "(never announced, or withdrawn)"
                )
            if d.length <= 0 or d.offset + d.length > key.length:
                raise errors.WireFormatError(f"READ {n}: a descriptor outside key {d.key_id}")
            regions.append(
                control.RemoteRegion(key.address + d.offset, d.length, key.rkey, d.key_id)
            )
        if sum(r.length for r in regions) != view.nbytes:
            raise errors.WireFormatError(f"READ {n}: regions do not add up to its size")
        self.reading.add(n)
        self.queued.append((n, regions))

    def take_inline(self, body: memoryview) -> None:
        """Eager: the whole payload came folded into the OPEN (its length was checked
        against the header's before the buffer was taken, `check_inline`): copy it in
        from the OPEN's body (a view, `control.Inline`: past the stream reader's, the one
        copy made of it here), as if every segment had been read; each layer is verified
        once its frame is in."""
        if not self.one_sided or self.reading or body.nbytes != self.flat.nbytes:
            raise errors.WireFormatError("an inline payload besides reads, or of the wrong size")
        self.flat[:] = body
        self.reading.update(range(len(self.segments)))
        for seg in self.segments:
            self._landed(seg)

    def start_reads(self) -> None:
        """Read announced segments in order, ``_MAX_READS`` at a time: all at once, a
        transfer's first segment landed only with its last (the copies share the memory
        bandwidth), the sender heard nothing for that long, and verification could not
        overlap the reads. Consecutive segments announced together are read as one, up to
        `_JOINED_READ_BYTES` (the vLLM connector sends a segment per layer, and a sender
        sends the segments that completed meanwhile together)."""
        self.holding = False
        budget = _IN_PLACE_READ_BYTES
        queued = self.queued
        while queued and len(self.receiving) < _MAX_READS:
            first, regions = queued.pop(0)
            last = first
            size = self._segment_bytes(first)
            while queued and queued[0][0] == last + 1:
                more = self._segment_bytes(last + 1)
                if size + more > _JOINED_READ_BYTES:
                    break
                regions = _joined(regions, queued.pop(0)[1])
                last, size = last + 1, size + more
            layers = range(self.segments[first].start, self.segments[last].stop)
            view = self._layers_view(layers)
            then = self._verifier(layers, last)
            # A small read is done right here (no task, no loop turn), up to a budget per
            # call: past it, a task each, so a KV of many small segments still lets the
            # loop turn.
            if view.nbytes <= budget:
                rest = self.plane.read_now(self.link.peer, regions, view, then)
                if rest is None:
                    budget -= view.nbytes
                    self._landed(layers, verified=then is not None)
                    continue
            else:
                rest = self.plane.read(self.link.peer, regions, view, then)
            task = asyncio.create_task(rest, name=f"pdorch-kv-read-{first}")
            self.receiving[task] = layers
            if then is not None:
                self.checking.add(task)

    def _layers_view(self, layers: range) -> memoryview:
        """Consecutive layers' bytes in our buffer (they lie back to back, in wire order)."""
        start = self.offsets[layers.start]
        end = self.offsets[layers.stop - 1] + self.header.layer_nbytes(layers.stop - 1)
        return self.flat[start:end]

    def _landed(self, seg: range, *, verified: bool = False) -> None:
        self.landed.update(seg)
        if verified:  # where it was read (`_verifier`)
            self.read_verified += len(seg)
            return
        sums = self.sums
        self.ready.extend([i for i in seg if i in sums])

    def _on_frame(self, frame: wire.LayerFrame) -> wire.LayerFrame:
        wire.check_layer_frame(self.header, frame, self.sums)  # no per-frame set copy
        self.sums[frame.index] = frame.checksum
        self._maybe_verify(frame.index)
        return frame


_MAX_READS = 2
"""One-sided: segment reads queued per transfer. The data plane runs a link's reads one after
another (UCX: one reader thread per link), so the second is queued behind the first and starts
the moment it lands, with no loop turn between them, while the first is verified and the third
announced. Two reads *at once* shared the memory bandwidth instead, so a 64 MiB KV's two
32 MiB segments landed together and nothing overlapped (1.8–2.6 GB/s against 3.6 with one at
a time, load 7); one at a time with a loop turn and a thread hop between them cost 0.7–2.7 ms
per segment boundary under load. Nor does verifying a read while the next lands pay on two
cores: a 16 MiB segment read in 4 MiB parts of whole layers, each verified in a thread while
the next was read, took 5.3–6.4 ms against 4.4–4.8 whole (64 MiB 15–17 → 22–25 ms; three
pairs, quiet machine): the hash slowed the copy more than it hid."""

_JOINED_READ_BYTES = 256 << 10
"""One-sided: consecutive segments announced together are read as one up to this size (a
read costs ~20 µs besides its copy; past this the copy dominates and a larger read would
only delay the first segment's verification)."""

_IN_PLACE_READ_BYTES = 1 << 20
"""One-sided: segments read on the loop per `Receive.start_reads` call, at most (a CMA copy
of 1 MiB: ~0.1–0.2 ms)."""

_LANDED = control.encode(control.Kind.LANDED)
"""One-sided: segments were read (`Receive._tell_alive`; no body: encoded once)."""

_SPLIT_TAIL_BYTES = 4 << 20
"""A final verification batch this large is split over two threads (xxh3 ~1.2 ms/32 MiB)."""


Batch = list[tuple[int, int, memoryview, int]]
"""Layers to verify: index, checksum (from its frame), payload, bytes of K and V values at
the payload's start (`wire.verify_layers`)."""


def _joined(
    regions: list[control.RemoteRegion], more: list[control.RemoteRegion]
) -> list[control.RemoteRegion]:
    """``regions`` then ``more``, read in order into consecutive bytes; the two that meet
    merged into one when they are adjacent in the same key (a group staged together)."""
    a, b = regions[-1], more[0]
    if a.key_id == b.key_id and a.address + a.length == b.address:
        merged = control.RemoteRegion(a.address, a.length + b.length, a.rkey, a.key_id)
        return [*regions[:-1], merged, *more[1:]]
    return [*regions, *more]


def _nbytes(batch: Batch) -> int:
    return sum([view.nbytes for _, _, view, _ in batch])


_THREAD_VERIFY_BYTES = 1 << 20
"""Below this a batch is verified on the event loop (xxh3: ~30 µs per MiB here)."""
_TAIL_VERIFY_BYTES = 4 << 20
"""The last batch, with nothing left to overlap: on the loop up to this (a thread hop
cost 0.2 ms here under load, as much as 4 MiB of xxh3)."""


async def _verify(batch: Batch, finite: wire.DType | None) -> None:
    await asyncio.to_thread(_verify_all, batch, finite)


def _verify_all(batch: Batch, finite: wire.DType | None) -> None:
    wire.verify_layers(batch, finite)
