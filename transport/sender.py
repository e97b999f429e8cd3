"""The sending side of KV transfers, for every backend (the payload path is the `DataPlane`).

Layer-wise streaming: `KvSender.open()` sends the header and waits for the receiver to accept
it; `OutgoingTransfer.send_layer(i, k, v)` may be called as soon as layer *i* exists and
returns at once; while the producer computes the next layer, `OutgoingTransfer.hold` keeps
the receiver's idle deadline for a live sender (ALIVE every ``keepalive_s``). Out of band,
a *segment* (a run of consecutive layers, `wire.segments`) starts moving as soon as its last
layer is given, while each layer's checksum is computed in a thread (xxh3 releases the GIL)
and its frame follows; `finish()` returns once the receiver has verified every layer.
Connections and data-plane endpoints to a receiver are pooled and reused; a pooled
connection whose peer went away is noticed before reuse and replaced, so the first transfer
after a receiver restarts connects afresh. One-sided (UCX v2), `send` of a complete KV is
one message and one reply (`_send_folded`), over memory registered once per allocation
(`transport.registry`) whose keys each link carries once. On every backend, `send` of a
KV of at most its data plane's bound (`control.eager_bytes`: 128 KiB one-sided, 4 MiB on
the tag path and TCP) is that one message with its bytes inline (eager:
nothing registered, posted or read; only to a receiver it would pair with for a larger KV,
`transport.backend_names`). With `LinkTls`, links are mutual
TLS and KV goes only to a receiver whose identity `LinkTls.receivers` allows; the
out-of-band payload of each transfer carries the token the receiver issued in its ACCEPT.

**Layers in pieces, read in place (one-sided).** `OutgoingTransfer.send_layer` also takes K
and V each as a sequence of memoryviews — the pieces of memory that, concatenated, are the
layer's wire bytes (an engine's paged cache: each block's K, or each (block, head) chunk of
it, in the request's block order) — so nothing is gathered: the receiver reads the pieces
straight out of the engine's memory (registered once, `Registry.register_region`) into its
contiguous buffer. Adjacent pieces merge into one descriptor; a segment of small pieces, or
more scattered than one READ may name (`control.MAX_REGIONS`), is staged instead: copied
into one pooled registered buffer, read as one region (`kv_bytes.staged`). The memory is
not the transfer's: its owner keeps it stable until the transfer ended, and the layers'
checksums are taken *before* the receiver learns where to read (and before a staging
copy), so bytes changed after that (a read that comes late, after a failed transfer's
memory was re-used) fail verification. Backends without one-sided reads join the pieces
(one copy, as a gather).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import os
import ssl
import time
from collections.abc import Callable
from functools import partial

import numpy as np
import xxhash

from transport import control, errors, kv_bytes, stream, wire
from transport.backend_names import NO_UCX_PEER
from transport.base import DataPlane, Peer, TransportSettings
from transport.buffers import BufferPool
from transport.link import Link, tls_error
from transport.outgoing import OutgoingTransfer, Pool
from transport.registry import Registration, Registry
from transport.security import LinkTls, describe

log = logging.getLogger(__name__)

PayloadHook = Callable[[int, memoryview, memoryview], tuple[memoryview, memoryview]]
DelayHook = Callable[[int], float]
ExposedHook = Callable[[int], None]
LayeredHook = Callable[[], bool]
Held = tuple[list[Registration], list[memoryview], list[np.ndarray]]
"""One-sided: registrations a transfer uses, its buffers (kept alive with them), and its
staging buffers (`kv_bytes.staged`: back to the pool once released)."""

_THREAD_CHECKSUM_BYTES = 1 << 20
"""Below this a checksum costs less than a thread hop (xxh3 runs at ~30 GB/s here)."""
_xxh3 = xxhash.xxh3_64_intdigest
STAGE_MAX_BYTES = 4 << 20
"""One-sided, a whole KV at once (`_Folded.stage`: the copy is on the loop, before the
OPEN): segments up to this size are staged (`kv_bytes.staged`)."""
STAGING_IDLE_BYTES = 256 << 20
"""Staging buffers kept idle for reuse, at most (each stays registered while kept). A KV
staged whole (pieces apart: the vLLM connector's path) holds its buffers until DONE, so a
KV larger than this takes fresh buffers every transfer, faulted in and registered: 256 MiB
paged, a scratch script on `transport.bench._Paged`, two runs each, 64 MiB → 256 MiB:
2.13–2.53 → 2.59–3.04 GB/s (224–416 → 32 fresh buffers)."""

_FOLD_CHECKSUM_BYTES = 4 << 20
"""A folded transfer up to this size is checksummed before its one write (~130 µs at
4 MiB): a thread hop and a second message cost more here (0.2–0.6 ms under load)."""


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"address must be host:port, got {address!r}")
    return host.strip("[]"), int(port)


class KvSender:
    def __init__(
        self, data_plane: DataPlane, settings: TransportSettings, tls: LinkTls | None = None
    ) -> None:
        self._plane = data_plane
        self.settings = settings
        self.tls = tls
        """With a client context, links are mutual TLS, to `LinkTls.receivers` only."""
        self._instance = os.urandom(control.INSTANCE_ID_BYTES)
        self._address = b""
        self._pools: dict[str, Pool] = {}
        self._held: dict[int, Held] = {}
        """Failed transfers' registered memory, held a while (`_quarantine`)."""
        self.registry = Registry(data_plane.register, data_plane.deregister)
        """One-sided: memory registered once per allocation, keys sent once per link."""
        self.staging = BufferPool(STAGING_IDLE_BYTES, min_pooled=0)
        """One-sided: where segments of small pieces apart are joined (`kv_bytes.staged`:
        `_Folded.stage`, `OutgoingTransfer`'s pieces); pooled, so each buffer is registered
        once and its key sent once per link."""
        self._started = False
        self._closed = False
        self._checksummer = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="pdorch-kv-checksum"
        )
        self.payload_hook: PayloadHook | None = None
        """Fault injection (`transport.testing.FaultInjector`): sees each layer's buffers after
        its checksum was taken and returns the buffers to send instead."""
        self.delay_hook: DelayHook | None = None
        """Fault injection: seconds the link holds a layer back before it goes out (awaited,
        so the sender's event loop keeps running — a slow link, not a stalled process)."""
        self.layered_hook: LayeredHook | None = None
        """Fault injection: true while transfers must go layer by layer — a timing fault
        (a delay, a pace, a drop, a gate) acts between layers, and an eager KV, one
        message, has none; a corruption alone keeps eager."""
        self.exposed_hook: ExposedHook | None = None
        """Fault injection for layers given in pieces (one-sided): called with a segment's
        index after its layers' checksums were taken, before the receiver learns where to
        read them (a test changes the source memory there)."""

    @property
    def backend(self) -> str:
        return self._plane.name

    async def start(self) -> None:
        if not self._started:
            self._address = await self._plane.start()
            self._started = True

    async def open(self, address: str, header: wire.KvHeader) -> OutgoingTransfer:
        """Open a transfer: the receiver has checked the header and reserved memory on return."""
        if self._closed:
            raise errors.TransportClosedError("sender is closed")
        await self.start()
        encoded = wire.encode_header(header)
        pool = await self._slot(address)
        try:
            for attempt in (1, 2):
                link, reused = await self._acquire(pool, address)
                try:
                    if self._plane.one_sided:
                        message = self.withdrawals(link) + control.open_read2(
                            self.settings.segment_bytes, encoded, folded=False
                        )
                    else:  # the receiver issues the transfer's token
                        message = control.open_(0, self.settings.segment_bytes, encoded)
                    await link.send(message, self.settings.idle_timeout_s)
                    msg = await link.read_next(self.settings.idle_timeout_s)
                except errors.PeerLostError:
                    await link.close()
                    if reused and attempt == 1:
                        continue  # a pooled link the peer had dropped: try a fresh one
                    raise
                except BaseException:
                    await link.close()
                    raise
                if msg.kind is control.Kind.ERROR:
                    pool.idle.append((link, time.monotonic()))  # a refusal leaves it clean
                    raise control.parse_error(msg.body)
                if msg.kind is not control.Kind.ACCEPT:
                    await link.close()
                    raise errors.WireFormatError(f"expected ACCEPT, got {msg.kind.name}")
                try:
                    token = control.parse_accept(msg.body)
                except errors.WireFormatError:
                    await link.close()
                    raise
                return OutgoingTransfer(self, pool, link, header, token)
            raise AssertionError("unreachable")  # pragma: no cover
        except BaseException:
            pool.slots.release()
            raise

    async def send(self, address: str, cache: wire.KvCache) -> None:
        """Send a whole KV cache: the layer-wise API in a loop, or — one-sided, or a KV of
        at most `eager_bytes` on any backend (inline, eager) — one message and one
        reply (`_send_folded`)."""
        eager = self._eager(cache)
        if self._plane.one_sided or eager:
            await self._send_folded(address, cache, eager=eager)
            return
        scaled = cache.header.scales is not wire.ScaleLayout.NONE
        async with await self.open(address, cache.header) as transfer:
            if self._plane.inline:
                await transfer.send_all(cache)  # frames and payloads in a few writes
            else:
                for i, (k, v) in enumerate(cache.layers):
                    await transfer.send_layer(i, k, v, cache.scales[i] if scaled else None)
            await transfer.finish()

    @property
    def _needs_ucx_peer(self) -> bool:
        """A tag (v1) sender: its eager KV goes only to a receiver its tag path could reach
        (one with a UCX data plane). A one-sided sender's is refused by a tcp receiver
        itself, as its reads would be; a tcp sender's by a UCX receiver."""
        return not self._plane.inline and not self._plane.one_sided

    @property
    def eager_bytes(self) -> int:
        """The largest KV this sender sends inline (`control.eager_bytes`: its data plane's)."""
        return control.eager_bytes(one_sided=self._plane.one_sided)

    def _eager(self, cache: wire.KvCache) -> bool:
        """Whether ``cache`` goes inline (`eager_bytes`; not while a fault injector times
        layers, `layered_hook`)."""
        if not 0 < cache.header.payload_bytes <= self.eager_bytes:
            return False
        return self.layered_hook is None or not self.layered_hook()

    async def _send_folded(self, address: str, cache: wire.KvCache, *, eager: bool) -> None:
        """One-sided, the whole KV at hand (prefill finished): OPEN_READ2 (``FOLDED``) and
        every segment's READ in one write — with KEYS for what this link's receiver does
        not hold yet, WITHDRAW for what it holds and was freed; a KV of at most
        `eager_bytes` goes inline instead (PAYLOAD) — then the checksums
        (LAYERS; in that same write when the KV is small), then one reply: DONE | ERROR.
        A refusal is raised here, as from `open`; a failed transfer's memory is held
        (`_quarantine`) while its receiver may still be reading."""
        if self._closed:
            raise errors.TransportClosedError("sender is closed")
        await self.start()
        folded = _Folded(self, cache, eager=eager)
        await folded.prepare()
        pool = await self._slot(address)
        try:
            folded.register()
        except BaseException:
            pool.slots.release()
            raise
        try:
            link, msg = await self._exchange(pool, address, folded)
        except BaseException:
            self._quarantine(folded.held, self.settings.idle_timeout_s)
            pool.slots.release()
            raise
        if msg.kind is control.Kind.DONE:
            self._release_registrations(folded.used)
            folded.unstage()
            self._release(pool, link, reusable=True)
            return
        # A refusal or a failure: the receiver stopped reading before it answered, but the
        # link may still carry what we sent after the OPEN: it is not reused.
        await link.close()
        self._quarantine(folded.held, self.settings.idle_timeout_s)
        pool.slots.release()
        if msg.kind is control.Kind.ERROR:
            raise control.parse_error(msg.body)
        raise errors.WireFormatError(f"expected DONE, got {msg.kind.name}")

    async def _slot(self, address: str) -> Pool:
        """The receiver's pool, with one of its transfer slots taken."""
        pool = self._pools.get(address)
        if pool is None:  # (not `setdefault`: a semaphore built per transfer, then dropped)
            pool = self._pools[address] = Pool(self.settings.max_connections_per_peer)
        if not pool.slots.locked():  # free: taken without a task or a loop turn
            await pool.slots.acquire()
            return pool
        try:
            await asyncio.wait_for(pool.slots.acquire(), self.settings.idle_timeout_s)
        except TimeoutError:
            raise errors.TransferTimeoutError(
                f"no free connection slot to {address} within {self.settings.idle_timeout_s}s"
            ) from None
        return pool

    async def _exchange(
        self, pool: Pool, address: str, folded: _Folded
    ) -> tuple[Link, control.Message]:
        """Send a folded transfer and read its reply (past LANDED).

        At its connection cap a receiver may close a pooled link it saw idle before it
        read the OPEN waiting there (`KvReceiver._make_room`): such a link yields
        `PeerLostError` without any reply, and the transfer goes once more on a fresh link,
        as `open` does. A receiver that read the OPEN marks its link busy and never closes
        it for room, so a link that answered is never retried."""
        for attempt in (1, 2):
            link, reused = await self._acquire(pool, address)
            replied = False
            try:
                if folded.eager and self._needs_ucx_peer and not link.peer.data_address:
                    raise errors.PeerLostError(NO_UCX_PEER)  # as its tag path would fail
                await link.send_parts(folded.message(link), folded.wait_s())
                if not folded.frames:  # a large KV: checksummed while the receiver reads
                    await folded.send_checksums(link)
                msg = await link.read_next(folded.wait_s())  # in place: no task to wake
                replied = True
                while msg.kind is control.Kind.LANDED:
                    msg = await link.read_next(folded.wait_s())
            except errors.PeerLostError:
                await link.close()
                if reused and attempt == 1 and not replied:
                    continue
                raise
            except BaseException:
                with contextlib.suppress(errors.TransportError):
                    await link.send(control.encode(control.Kind.ABORT, b"sender error"), 1.0)
                await link.close()
                raise
            return link, msg
        raise AssertionError("unreachable")  # pragma: no cover

    def withdrawals(self, link: Link) -> bytes:
        """WITHDRAW for keys this link's receiver holds whose memory was freed (sent before
        the link's next transfer, so the receiver never reads by them again)."""
        self.registry.collect()
        gone = [k for k in link.keys_told if k not in self.registry.live]
        if not gone:
            return b""
        link.keys_told.difference_update(gone)
        return control.withdraw(gone)

    def announce(self, link: Link, used: list[Registration]) -> bytes:
        """KEYS for the registrations this link's receiver does not hold yet (once per
        link: later transfers name them by id)."""
        told = link.keys_told
        new = []
        for r in used:  # (a group's segments may name the same registration)
            if r.key.key_id not in told:
                told.add(r.key.key_id)
                new.append(r.key)
        return b"".join(
            control.keys(new[i : i + control.MAX_KEYS])
            for i in range(0, len(new), control.MAX_KEYS)
        )

    def _layer(
        self,
        h: wire.KvHeader,
        index: int,
        k: np.ndarray,
        v: np.ndarray,
        scales: tuple[np.ndarray, np.ndarray] | None,
    ) -> tuple[list[memoryview], list[memoryview]]:
        """Layer ``index``'s buffers, as checksummed and as sent, checked against the
        header (shapes, dtype, scales)."""
        shape = h.layers[index]
        if tuple(k.shape) != shape.k or tuple(v.shape) != shape.v:
            raise errors.WireFormatError(f"layer {index} shapes differ from the header's")
        if k.dtype.itemsize != h.dtype.itemsize or v.dtype.itemsize != h.dtype.itemsize:
            raise errors.WireFormatError(f"layer {index} dtype differs from {h.dtype.name}")
        counts = h.scale_counts(index)
        given = (0, 0) if scales is None else (scales[0].size, scales[1].size)
        if (scales is None) != (h.scales is wire.ScaleLayout.NONE) or given != counts:
            raise errors.WireFormatError(f"layer {index}: scales do not match the header's")
        kb, vb, *sb = wire.layer_buffers(k, v, scales)
        out_k, out_v = kb, vb
        if self.payload_hook is not None:  # fault injection, after the checksum
            out_k, out_v = self.payload_hook(index, kb, vb)
        return [kb, vb, *sb], [out_k, out_v, *sb]

    async def _acquire(self, pool: Pool, address: str) -> tuple[Link, bool]:
        """A pooled link (True) or a new one (False).

        A new connection lost while it is set up (connect, TLS handshake, HELLO) is made
        once more: nothing was offered on it, so nothing can be received twice, and a
        receiver on a starved loop may drop a newcomer (a handshake it finished late) that
        the next try gets through. A timeout, a refusal or a second loss is the caller's."""
        # The receiver closes links idle for connection_idle_s: leave those it may be
        # closing (idle for half of that) rather than race it.
        fresh_after = time.monotonic() - self.settings.connection_idle_s / 2
        while pool.idle:
            link, since = pool.idle.pop()
            if since > fresh_after and not link.is_stale():
                return link, True
            await link.close()
        try:
            return await self._connect(address), False
        except errors.PeerLostError as exc:
            log.info("KV connection to %s lost while set up (%s): connecting again", address, exc)
        return await self._connect(address), False

    async def _connect(self, address: str) -> Link:
        host, port = split_address(address)
        timeout = self.settings.connect_timeout_s
        context = self.tls.client if self.tls is not None else None
        try:  # the TLS handshake is inside the connect timeout
            reader, writer = await asyncio.wait_for(
                stream.connect(host, port, context, timeout), timeout
            )
        except TimeoutError:
            raise errors.TransferTimeoutError(f"connect to {address} timed out") from None
        except ssl.SSLError as exc:  # cut short: lost (retryable); else refused
            why = tls_error(exc)
            raise type(why)(f"TLS handshake with {address} failed: {exc.reason or exc}") from exc
        except OSError as exc:
            raise errors.PeerLostError(f"cannot connect to {address}: {exc}") from exc
        link = Link(reader, writer, Peer(b"", b""))
        link.who = address
        try:
            if self.tls is not None and context is not None:
                cert = writer.get_extra_info("peercert")
                link.who = f"{describe(cert)} at {address}"
                if not cert or not self.tls.receivers(cert):
                    log.warning(
                        "refused to send KV to %s: this identity may not receive KV", link.who
                    )
                    raise errors.PeerRejectedError(
                        f"{link.who} is not an identity allowed to receive KV"
                    )
                link.authenticated = True
            await link.send(control.hello(self._instance, self._address), timeout)
            msg = await link.next_message(timeout)
            if msg.kind is control.Kind.ERROR:  # e.g. the receiver is at its connection cap
                raise control.parse_error(msg.body)
            if msg.kind is not control.Kind.HELLO:
                raise errors.WireFormatError(f"expected HELLO from {address}, got {msg.kind.name}")
            link.peer = Peer(*control.parse_hello(msg.body))
            link.on_close = partial(self._plane.release, link.peer)
        except BaseException:
            await link.close()
            raise
        return link

    def _release(self, pool: Pool, link: Link, reusable: bool) -> None:
        if reusable and not self._closed:  # a dead peer is noticed before reuse (is_stale)
            pool.idle.append((link, time.monotonic()))
        pool.slots.release()

    def _quarantine(self, held: Held, hold_s: float) -> None:
        """A failed one-sided transfer: its receiver may still be reading (it aborts its
        reads within its idle deadline). Its buffers stay referenced, so never freed under
        a read, and its registrations in use, for ``hold_s``; then they are released."""
        key = id(held)
        self._held[key] = held
        loop = asyncio.get_running_loop()
        loop.call_later(hold_s, lambda: self._unhold(key))

    def _unhold(self, key: int) -> None:
        held = self._held.pop(key, None)
        if held is not None:
            self._release_registrations(held[0])
            self.unstage(held[2])

    def _release_registrations(self, used: list[Registration]) -> None:
        try:
            self.registry.release(used)
        except errors.TransportError:
            log.warning("could not deregister KV memory", exc_info=True)

    async def close(self) -> None:
        """Close idle links and the data plane. Idempotent."""
        if self._closed:
            return
        self._closed = True
        while self._held:
            self._release_registrations(self._held.popitem()[1][0])
        for pool in self._pools.values():
            while pool.idle:
                await pool.idle.pop()[0].close()
        self.registry.close()
        await self._plane.close()
        self._checksummer.shutdown(wait=False)

    async def checksums(
        self, layers: list[list[memoryview]], then: Callable[[], None] | None = None
    ) -> list[int]:
        """Each layer's checksum, then ``then`` (e.g. a staging copy of what was summed).
        Large batches go to this sender's one checksum thread, one batch after the other
        in order: two at once competed with the copy for memory bandwidth and delayed the
        first segment's frames."""
        if sum(b.nbytes for layer in layers for b in layer) < _THREAD_CHECKSUM_BYTES:
            return _summed(layers, then)
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._checksummer, _summed, layers, then)
        except RuntimeError as exc:  # the executor was shut down: the sender is closed
            raise errors.TransportClosedError(f"sender closed: {exc}") from exc

    def unstage(self, staged: list[np.ndarray]) -> None:
        """Staging buffers nothing reads any more (the transfer ended, or its failure's
        hold is over): back to the pool, to be staged into again."""
        for buf in staged:
            self.staging.release(buf)


def _summed(layers: list[list[memoryview]], then: Callable[[], None] | None) -> list[int]:
    sums = kv_bytes.checksums(layers)
    if then is not None:
        then()
    return sums


def _remaining(deadline: float, settings: TransportSettings, request_id: str) -> float:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise errors.TransferTimeoutError(
            f"transfer of {request_id!r} exceeded {settings.transfer_timeout_s}s"
        )
    return min(remaining, settings.idle_timeout_s)


class _Folded:
    """One folded one-sided transfer (`KvSender._send_folded`): its layers, checked and
    hooked; its registrations and READ descriptors; its checksums.

    A KV laid out as on the wire in one allocation (a prefill's KV block, the reference
    engine's layout) is taken as one span (`kv_bytes.span`): each layer's checksum is taken over a
    slice of it and each segment is one buffer to describe, so the per-transfer Python
    work no longer grows with 64 views, addresses and registry lookups (a 32-layer 4 KiB KV,
    median of 2,400 in one process: ~260 µs of preparation and registry before, ~80 after,
    on this 2-core VM at load 11). Anything else (layers
    apart, scales, fault-injection hooks) goes layer by layer, as it always did."""

    def __init__(self, sender: KvSender, cache: wire.KvCache, *, eager: bool) -> None:
        self.sender = sender
        self.cache = cache
        self.header = cache.header
        self.summed: list[list[memoryview]] = []
        """Per layer: its buffers as checksummed."""
        self.segments: list[list[memoryview]] = []
        """Per segment: its buffers as sent (what the receiver reads)."""
        self.used: list[Registration] = []
        self.staged: list[np.ndarray] = []
        """Staging buffers of this transfer's segments (`stage`), back to the pool once it
        ended (`unstage`), or once its failure's hold is over."""
        self.reads: list[tuple[int, list[control.Descriptor]]] = []
        self.frames = b""
        self.eager = eager
        """The payload goes inline in the OPEN (`KvSender._eager`): nothing to register."""
        self.deadline = time.monotonic() + sender.settings.transfer_timeout_s

    @property
    def held(self) -> Held:
        return self.used, [b for seg in self.segments for b in seg], self.staged

    def stage(self) -> None:
        """Join each segment of many small pieces apart into one staging buffer, read as
        one region (`kv_bytes.staged`). The layers' checksums were taken over the pieces
        themselves, so a piece changed before it was copied fails verification as it
        would have read in place. Up to `STAGE_MAX_BYTES` a segment."""
        pool = self.sender.staging
        for n, pieces in enumerate(self.segments):
            if kv_bytes.staged(pieces, STAGE_MAX_BYTES):
                buf = pool.acquire(sum([p.nbytes for p in pieces]))
                kv_bytes.copy_into(buf, pieces)
                self.staged.append(buf)
                self.segments[n] = [buf.data]

    def unstage(self) -> None:
        """The transfer ended (DONE): its staging buffers go back to the pool."""
        staged, self.staged = self.staged, []
        self.segments = []  # no view of them is kept
        self.sender.unstage(staged)

    def wait_s(self) -> float:
        return _remaining(self.deadline, self.sender.settings, self.header.request_id)

    async def prepare(self) -> None:
        """Check every layer against the header; a small KV's checksums right away."""
        h, cache, sender = self.header, self.cache, self.sender
        if len(cache.layers) != len(h.layers):
            raise errors.WireFormatError(f"{len(cache.layers)} layers; the header: {len(h.layers)}")
        self.encoded = wire.encode_header(h)
        self.spans = spans = wire.segments(h, sender.settings.segment_bytes)
        hooked = sender.payload_hook is not None or sender.delay_hook is not None
        joined = span = None
        if not hooked and self.eager and h.payload_bytes <= kv_bytes.JOIN_EAGER_BYTES:
            joined = kv_bytes.joined(h, cache)
        if joined is not None:  # the layers' bytes, copied: nothing to register or keep
            self.segments = [[joined]]
            sums = [_xxh3(joined[a:b]) for a, b in itertools.pairwise(h.bounds)]
            self.frames = self._frames(sums)
            return
        if not hooked:
            span = kv_bytes.span(h, cache)
        if span is not None:
            offsets = h.bounds
            self.summed = [[span[offsets[i] : offsets[i + 1]]] for i in range(len(h.layers))]
            self.segments = [[span[offsets[seg.start] : offsets[seg.stop]]] for seg in spans]
        else:
            sent_layers = []
            scaled = h.scales is not wire.ScaleLayout.NONE
            for i, (k, v) in enumerate(cache.layers):
                summed, sent = sender._layer(h, i, k, v, cache.scales[i] if scaled else None)
                if sender.delay_hook is not None and (held := sender.delay_hook(i)) > 0:
                    await asyncio.sleep(min(held, self.wait_s()))  # a slow link
                self.summed.append(summed)
                sent_layers.append(sent)
            self.segments = [[b for i in seg for b in sent_layers[i]] for seg in spans]
            if not self.eager:
                self.stage()
        if h.payload_bytes <= _FOLD_CHECKSUM_BYTES:
            self.frames = self._frames(kv_bytes.checksums(self.summed))

    def _frames(self, sums: list[int], first: int = 0) -> bytes:
        return wire.layer_frames(self.header, first, sums)

    def register(self) -> None:
        """Descriptors of each segment, registering memory not registered yet (eager:
        none, its bytes go in the message)."""
        if self.eager:
            return
        registry = self.sender.registry
        try:
            for n, buffers in enumerate(self.segments):
                descs, regs = registry.acquire(buffers)
                self.used.extend(regs)  # a user per acquire: released as many times
                self.reads.append((n, descs))
        except BaseException:
            self.sender._release_registrations(self.used)
            raise

    def message(self, link: Link) -> list[bytes | memoryview]:
        """OPEN_READ2 with [WITHDRAW] [KEYS] READ… [LAYERS] folded in: one message, which
        the receiver reads in one go, in pieces for one gathered write (`Link.send_parts`):
        an eager KV's buffers go as they lie, after its PAYLOAD head, never joined. (Past
        `control.MAX_BODY`, e.g. hundreds of blocks apart, the same messages follow it.)"""
        sender = self.sender
        keys = sender.withdrawals(link) + sender.announce(link, self.used)
        seg = sender.settings.segment_bytes
        layers = control.encode(control.Kind.LAYERS, self.frames) if self.frames else b""
        if self.eager:  # the checksums were taken over these very bytes (`prepare`)
            buffers = [b for segment in self.segments for b in segment]
            head = keys + control.payload_head(buffers)
            return control.open_read2_parts(seg, self.encoded, [head, *buffers, layers])
        rest = b"".join(control.read(n, descs) for n, descs in self.reads) + layers
        then = keys + rest
        if len(self.encoded) + len(then) + 32 <= control.MAX_BODY:
            return [control.open_read2(seg, self.encoded, folded=True, then=then)]
        return [keys + control.open_read2(seg, self.encoded, folded=True) + rest]

    async def send_checksums(self, link: Link) -> None:
        """LAYERS per segment, in order, each sent as soon as its layers' checksums are
        taken — so the receiver verifies each segment as it lands, not all of them once
        the whole KV was hashed (256 MiB at load ~15: 200 MiB were then verified in one
        batch that ended ~15 ms after the last read). Kept once all are taken: a retry
        sends them with its OPEN."""
        parts = []
        for seg in self.spans:
            sums = await self.sender.checksums(self.summed[seg.start : seg.stop])
            parts.append(self._frames(sums, seg.start))
            await link.send(control.encode(control.Kind.LAYERS, parts[-1]), self.wait_s())
        self.frames = b"".join(parts)
