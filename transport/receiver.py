"""The receiving side of KV transfers, for every backend.

Per transfer: decode and check the header against the `Expectation` and the epoch fence
*before* reserving memory; allocate one contiguous buffer; receive each layer straight into
its slice (while the next layer's frame is read and earlier layers are verified in a thread);
then file the `KvCache` in the `Inbox`. Any failure — checksum, protocol, peer death, deadline
— discards the partial buffer, releases its reservation and files the error, so a decode
waiting in `Inbox.take` learns of it at once. Verification checks each layer's checksum and,
with ``check_finite`` on, that its values hold no NaN or infinity, in the same pass.

Fixed cost per transfer (issue 16): what depends only on a KV's layout — its offsets, its
segments, its header's shape section — is derived once per layout (`wire`'s memos); a
LAYERS message's frames are decoded and checked in one pass; layers are verified on
slices of one byte view of the payload; and between transfers the next message is read in
place (no task to wake, then a waiter). One-sided, a 4 KiB KV in 32 layers: ~0.9 → ~0.5 ms
of CPU per transfer, sender and receiver together (one process, medians of alternating
runs at loads of 8–15 on this 2-core VM; the README's "KV transport" has the figures).

Per connection: at most ``max_connections_per_host`` per remote IP and ``max_connections``
in all, counted from the accept (a handshake in progress counts), a new connection at a cap
closing the longest-idle one (a connection moving KV is never closed for room; if all are,
the newcomer gets an ERROR); with `LinkTls`, the TLS handshake within ``accept_timeout_s``
and the sender's identity (a refusal is logged once, with the peer's identity and address,
and tells the peer nothing more than that); HELLO within ``accept_timeout_s``; between
transfers, at most ``connection_idle_s`` of silence.

TLS starts at accept: the receiver accepts sockets itself and hands each to the loop with
its server context (`loop.connect_accepted_socket`), so the TLS layer reads the socket's
first byte. It used to accept in plaintext and upgrade (`StreamWriter.start_tls`), to log
each refusal with the peer's address (a server with ``ssl=`` fails handshakes out of the
handler's sight); but senders speak TLS at once, and uvloop starts reading an accepted
socket before its handler runs: on a busy loop the ClientHello was already in the plaintext
stream's buffer when the upgrade began, never reached the TLS layer, and the handshake
stalled until the sender's connect timed out (README: Workers on uvloop). Accepting here
keeps the refusal log and the caps before the handshake.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np

from transport import control, errors, incoming, stream, wire
from transport.backend_names import TCP_SENDER_REFUSED
from transport.base import DataPlane, Inbox, Peer, TransferTokens, TransportSettings
from transport.buffers import Bodies, BufferPool
from transport.link import Link
from transport.security import LinkTls, describe

log = logging.getLogger(__name__)

# After refusing a transfer mid-payload: how long to wait for the ERROR to go out and the
# sender to stop (the link lingers, discarding, so the sender reads the ERROR, not EPIPE).
_REFUSAL_WAIT_S = 1.0

_BACKLOG = 128
"""Listen backlog: connections the kernel completes while the loop is busy (a burst of
senders' first links; asyncio's own servers use 100)."""
_ACCEPT_PAUSE_S = 1.0
"""After accept fails for want of descriptors or memory: pause this long (as asyncio's
servers do), letting connections close, rather than spin on a listener that stays ready."""
_ACCEPT_PAUSE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})

_TOKENS = TransferTokens(memory=65536)
"""The process's transfer tokens (`KvReceiver.tokens`); remembers as many spent tokens as
`TransportSettings.epoch_memory`'s default remembers epochs (about 100 bytes each)."""


class KvReceiver:
    def __init__(
        self,
        data_plane: DataPlane,
        settings: TransportSettings,
        model: wire.ModelSpec | None = None,
        tls: LinkTls | None = None,
    ) -> None:
        self._plane = data_plane
        self.settings = settings
        self.model = model
        self.tls = tls
        """With a server context, links are mutual TLS and only `LinkTls.senders` may send."""
        self.inbox = Inbox(settings.memory_budget_bytes, settings.epoch_memory)
        self.tokens = _TOKENS
        """Transfer tokens, one registry per process: UCX tags match worker-wide (one
        worker per process), so every receiver here must know every live token."""
        self.buffers = BufferPool(settings.pooled_buffer_bytes)
        """Payload buffers and eager OPENs' bodies, recycled (`transport.buffers`)."""
        self.bodies = Bodies(self.buffers, settings.body_reading_bytes)
        """Eager OPENs' bodies being read, bounded in all (`Link.bodies`)."""
        self._instance = os.urandom(control.INSTANCE_ID_BYTES)
        self._data_address = b""
        self._listeners: list[socket.socket] = []
        self._acceptors: list[asyncio.Task[None]] = []
        self._handlers: set[asyncio.Task[None]] = set()
        """One task per accepted connection (named ``pdorch-kv-conn``), until it ends."""
        self._conns: set[_Conn] = set()
        self._closed = False
        self._reaper: asyncio.Task[None] | None = None
        self.address = ""
        self.prefix_check: Callable[[int, bytes], bool] | None = None
        """Whether this receiver's consumer holds the KV prefix a suffix-only transfer
        names (tokens, hash; `wire` version 3); None: it holds none, so it refuses them."""

    @property
    def backend(self) -> str:
        return self._plane.name

    @property
    def data_address(self) -> bytes:
        """This receiver's data-plane address (UCX: its worker address), as sent in HELLO."""
        return self._data_address

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Listen; returns the "host:port" senders connect to."""
        self._data_address = await self._plane.start()
        self._listeners = await _listen(host, port)
        sock_host, sock_port = self._listeners[0].getsockname()[:2]
        self.address = f"{sock_host}:{sock_port}"
        self._acceptors = [
            asyncio.create_task(self._accept(sock), name="pdorch-kv-accept")
            for sock in self._listeners
        ]
        self._reaper = asyncio.create_task(self._reap(), name="pdorch-kv-reaper")
        return self.address

    async def _reap(self) -> None:
        interval = min(1.0, self.settings.kv_hold_s / 4)
        while True:
            await asyncio.sleep(interval)
            for rid in self.inbox.reap(time.monotonic(), self.settings.kv_hold_s):
                log.info("freed the KV of request %s: no decode call within its lease", rid)
            if not self._plane.inline:
                await self._discard_unmatched()

    async def _discard_unmatched(self) -> None:
        """Drop out-of-band payload messages that no transfer announced — an unknown token
        (injected), a spent one (a replay, or a late segment of a failed transfer) — so they
        land nowhere and hold no memory; one line each."""
        try:
            dropped = await asyncio.to_thread(self._plane.discard_unmatched, self.tokens.wants)
        except errors.TransportError as exc:
            log.warning("could not discard unmatched KV payload messages: %s", exc)
            return
        for tag, length in dropped:
            token = tag & ~0xFFFF
            if self.tokens.state(token) == "spent":
                log.info(
                    "refused a %s message of %d bytes under a spent transfer token %#x (a "
                    "replay, or a late segment of a failed transfer): discarded",
                    self._plane.name,
                    length,
                    token,
                )
            else:
                log.warning(
                    "refused a %s message of %d bytes under token %#x, which no transfer "
                    "announced (its sender is unknown to UCX): discarded",
                    self._plane.name,
                    length,
                    token,
                )

    async def take(self, request_id: str, epoch: int, timeout_s: float) -> wire.KvCache:
        return await self.inbox.take(request_id, epoch, timeout_s)

    def discard(self, request_id: str, epoch: int | None = None) -> bool:
        """Free KV held or arriving for the request (`Inbox.discard`)."""
        return self.inbox.discard(request_id, epoch)

    async def close(self) -> None:
        """Stop accepting, drop every connection, free held KV. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        for task in self._acceptors:
            task.cancel()
        for task in self._acceptors:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for sock in self._listeners:
            sock.close()
        for conn in list(self._conns):
            if conn.link is not None:
                await conn.link.close()
        # What is left: handshakes in progress, handlers between their link's close and
        # their end. Each ends within its own timeouts; cancelled here so none outlives us.
        handlers = list(self._handlers)
        for task in handlers:
            task.cancel()
        if handlers:
            await asyncio.wait(handlers, timeout=self.settings.connect_timeout_s)
        for rid in self.inbox.held():
            self.inbox.discard(rid)
        await self._plane.close()

    # ------------------------------------------------------------------------ connection

    @property
    def connections(self) -> int:
        """Open control connections (senders' links, and connections not yet introduced)."""
        return len(self._conns)

    async def _accept(self, listener: socket.socket) -> None:
        """Accept connections on ``listener`` until cancelled, one handler task each."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, peername = await loop.sock_accept(listener)
            except OSError as exc:  # the listener stays open: the next accept may succeed
                if exc.errno not in _ACCEPT_PAUSE_ERRNOS:
                    log.debug("KV receiver: accept failed: %s", exc)
                    continue
                log.warning(
                    "KV receiver cannot accept connections (%s): pausing %ss",
                    exc,
                    _ACCEPT_PAUSE_S,
                )
                await asyncio.sleep(_ACCEPT_PAUSE_S)
                continue
            task = asyncio.create_task(self._serve(sock, peername), name="pdorch-kv-conn")
            self._handlers.add(task)
            task.add_done_callback(self._handlers.discard)

    async def _serve(self, sock: socket.socket, peername: Any) -> None:
        host = str(peername[0]) if peername else "?"
        who = f"{host}:{peername[1]}" if peername else host
        try:
            self._make_room(host)
        except errors.BudgetExceededError as exc:
            log.warning("refused a KV connection from %s: %s", host, exc)
            await self._refuse_room(sock, who, exc)
            return
        conn = _Conn(host, asyncio.current_task())
        self._conns.add(conn)
        link: Link | None = None
        try:
            link = conn.link = await self._connect(sock, who)
            if link is not None and await self._admit(link):
                await self._converse(link, conn)
        except errors.TransportError as exc:
            log.debug("KV connection from %s closed: %s", host, exc)
        except Exception:
            log.exception("KV connection handler failed")
        finally:
            self._conns.discard(conn)
            if link is not None:
                await link.close()

    async def _converse(self, link: Link, conn: _Conn) -> None:
        """HELLO both ways, then transfers one after another until the link ends."""
        s = self.settings
        msg = await link.next_message(s.accept_timeout_s)
        if msg.kind is not control.Kind.HELLO:
            raise errors.WireFormatError(f"expected HELLO, got {msg.kind.name}")
        link.peer = Peer(*control.parse_hello(msg.body))
        link.on_close = partial(self._plane.release, link.peer)
        await link.send(control.hello(self._instance, self._data_address), s.connect_timeout_s)
        while not link.broken and not self._closed:
            conn.idle_since = time.monotonic()
            # Between transfers: a pooled link waits here, bounded by the idle timeout.
            # Read in place (no task to wake, then a waiter: two loop steps fewer on
            # every transfer's critical path; EOF and silence end it the same way).
            msg = await link.read_next(s.connection_idle_s)
            if msg.kind in _OPENS:
                conn.busy = True
                try:
                    await self._open(link, msg)
                finally:
                    conn.busy = False
            elif msg.kind in (control.Kind.KEYS, control.Kind.WITHDRAW):
                self._on_keys(link, msg)
            elif msg.kind not in (control.Kind.ABORT, control.Kind.ALIVE):  # late: harmless
                raise errors.WireFormatError(f"unexpected {msg.kind.name} between transfers")

    async def _connect(self, sock: socket.socket, who: str) -> Link | None:
        """The accepted socket as a `Link`, TLS from its first byte when this receiver has a
        server context: the handshake within ``accept_timeout_s``, or one refusal line and
        None (the socket closed). The sender's identity is `_admit`'s."""
        s = self.settings
        server = self.tls.server if self.tls is not None else None
        loop = asyncio.get_running_loop()
        reader, protocol = stream.pair(loop)
        try:
            # The handshake's own timeout, and the same deadline around the call (a loop
            # whose SSL layer would not time out still cannot hold the handler).
            async with asyncio.timeout(s.accept_timeout_s):
                if server is None:
                    transport, _ = await loop.connect_accepted_socket(lambda: protocol, sock)
                else:
                    transport, _ = await loop.connect_accepted_socket(
                        lambda: protocol,
                        sock,
                        ssl=server,
                        ssl_handshake_timeout=s.accept_timeout_s,
                    )
        except (OSError, TimeoutError) as exc:  # ssl.SSLError is an OSError
            # The loop closed the socket (it is the transport's from the call on).
            if server is None:
                log.debug("KV connection from %s lost at accept: %s", who, exc)
                return None
            reason = getattr(exc, "reason", None) or str(exc) or type(exc).__name__
            if isinstance(exc, TimeoutError):
                reason = f"none within {s.accept_timeout_s}s"
            log.warning(
                "refused a KV connection from %s (no verified certificate): TLS handshake "
                "failed: %s",
                who,
                reason,
            )
            return None
        writer = asyncio.StreamWriter(transport, protocol, reader, loop)
        link = Link(reader, writer, Peer(b"", b""))
        link.who = who
        link.bodies = self.bodies  # an eager OPEN's body, recycled (`_give_back`)
        return link

    async def _refuse_room(
        self, sock: socket.socket, who: str, exc: errors.BudgetExceededError
    ) -> None:
        """Answer a connection refused at the caps with an ERROR (retryable), then close.
        Under TLS it goes after the handshake (a plaintext ERROR would read to a TLS sender
        as a broken handshake) and carries only its class: the peer is not identified."""
        link = await self._connect(sock, who)
        if link is None:
            return
        answer = control.refusal(exc) if self.tls is not None and self.tls.server else None
        with contextlib.suppress(errors.TransportError):
            await link.send(answer or control.error(exc), self.settings.connect_timeout_s)
            # The sender's HELLO is on its way: closing with it unread resets the
            # connection, and the sender would see "connection lost", not why.
            await link.linger(_REFUSAL_WAIT_S)
        await link.close()

    async def _admit(self, link: Link) -> bool:
        """The sender's identity, from the certificate TLS verified (nothing to do without
        TLS). A refusal is logged once (identity and address) and answered with nothing
        more than its class (`control.refusal`)."""
        tls, s = self.tls, self.settings
        if tls is None or tls.server is None:
            return True
        cert = link.writer.get_extra_info("peercert")
        identity = describe(cert)
        link.who = f"{identity} at {link.who}"
        if not cert or not tls.senders(cert):
            log.warning("refused a KV connection from %s: this identity may not send KV", link.who)
            with contextlib.suppress(errors.TransportError):
                refused = errors.PeerRejectedError("identity not allowed")
                await link.send(control.refusal(refused), s.connect_timeout_s)
                # Closing at once can reset the connection before the peer reads the
                # refusal (it would see "connection lost", not why): let it read, bounded.
                await link.linger(_REFUSAL_WAIT_S)
            return False
        link.authenticated = True
        return True

    def _on_keys(self, link: Link, msg: control.Message) -> None:
        """One-sided: the sender's registered regions (KEYS), or that some are gone
        (WITHDRAW: forgotten here and by the data plane; a READ naming one is refused)."""
        if not self._plane.can_read:
            raise errors.WireFormatError(f"{msg.kind.name}: {self._plane.name} reads nothing")
        if msg.kind is control.Kind.KEYS:
            incoming.learn_keys(link, msg.body)
            return
        gone = control.parse_withdraw(msg.body)
        for key_id in gone:
            link.keys.pop(key_id, None)
        self._plane.forget_keys(link.peer, gone)

    def _make_room(self, host: str) -> None:
        """Admit a connection from ``host`` within the per-host and total caps: at a cap,
        close the longest-idle connection not moving KV (of that host, then of any host);
        if every one is moving KV, refuse with `BudgetExceededError` (retryable)."""
        s = self.settings
        for cap, what in ((s.max_connections_per_host, f"from {host}"), (s.max_connections, "")):
            group = [c for c in self._conns if not what or c.host == host]
            if len(group) < cap:
                continue
            idle = [c for c in group if not c.busy]
            if not idle:
                raise errors.BudgetExceededError(
                    f"{len(group)} KV connections {what or 'in all'} (the cap), all moving KV"
                )
            oldest = min(idle, key=lambda c: c.idle_since)
            log.debug("closing an idle KV connection from %s to make room", oldest.host)
            self._conns.discard(oldest)
            oldest.drop()

    def _reserve(self, header_bytes: bytes) -> wire.KvHeader:
        """Decode and check the header, fence its epoch and reserve its bytes."""
        s = self.settings
        header = wire.decode_header(header_bytes, s.max_kv_bytes)
        exp = wire.Expectation(
            max_kv_bytes=s.max_kv_bytes,
            model=self.model,
            min_epoch=self.inbox.min_epoch(header.request_id),
        )
        wire.check_expected(header, exp)
        self._check_prefix(header)
        self.inbox.reserve(header.request_id, header.epoch, header.payload_bytes)
        return header

    def _payload(self, header: wire.KvHeader, folded: Sequence[control.Folded]) -> np.ndarray:
        """The buffer a checked header's payload lands in; an inline payload folded into
        its OPEN (eager) is checked against the header's size first (`incoming.check_inline`)."""
        incoming.check_inline(header, folded)
        return self.buffers.acquire(header.payload_bytes)

    async def _open(self, link: Link, msg: control.Message) -> None:
        if msg.kind is control.Kind.OPEN_READ2:
            await self._transfer(link, msg.kind, *control.parse_open_read2(msg.body))
        else:
            await self._transfer(link, msg.kind, *control.parse_open(msg.body))

    async def _folded(self, receive: incoming.Receive, msg: control.Folded) -> None:
        if isinstance(msg, control.Inline):  # PAYLOAD: a view of the OPEN's body
            receive.take_inline(msg.body)
        elif msg.kind in (control.Kind.KEYS, control.Kind.WITHDRAW):
            self._on_keys(receive.link, msg)
        elif msg.kind in (control.Kind.READ, control.Kind.LAYERS):
            await receive._on_message(msg)
        else:
            raise errors.WireFormatError(f"{msg.kind.name} folded into an OPEN")

    def _check_open(self, link: Link, kind: control.Kind, tag: int, *, eager: bool) -> None:
        """The protocol an OPEN asks for (its tag field: 0, or OPEN_READ2's flags less
        ``FOLDED``), before its header is even decoded. An eager one (folded, its payload
        inline) needs no one-sided path, but is taken only from a sender this receiver
        would take a larger KV from (`backend_names.receiver_takes`, by the data-plane
        address in the sender's HELLO: a UCX worker's, or none on tcp)."""
        ucx_sender = bool(link.peer.data_address)
        tcp_pair = eager and not ucx_sender  # a tcp sender's eager KV: no read needed
        if kind is not control.Kind.OPEN and not self._plane.can_read and not tcp_pair:
            raise errors.HeaderRejectedError(f"{self._plane.name} has no one-sided path")
        if tcp_pair and self._data_address:
            raise errors.HeaderRejectedError(TCP_SENDER_REFUSED)
        if kind is control.Kind.OPEN_READ:
            raise errors.HeaderRejectedError(control.ONE_SIDED_V1_REFUSED)
        if tag and kind is control.Kind.OPEN_READ2:
            raise errors.HeaderRejectedError(f"OPEN_READ2 with unknown flags {tag:#x}")
        if tag:
            raise errors.HeaderRejectedError(
                "OPEN names its own payload tag: this receiver issues transfer tokens "
                "(the sender predates them: upgrade it)"
            )

    def _check_prefix(self, header: wire.KvHeader) -> None:
        """Refuse a suffix-only transfer whose prefix is not held here, before any payload
        moves and before its epoch is fenced: the sender may then send the whole KV."""
        n = header.prefix_tokens
        if n and not (self.prefix_check is not None and self.prefix_check(n, header.prefix_hash)):
            raise errors.PrefixMissingError(
                f"request {header.request_id!r}: the KV extends a prefix of {n} tokens "
                f"(hash {header.prefix_hash[:8].hex()}) this receiver does not hold"
            )

    async def _transfer(
        self,
        link: Link,
        kind: control.Kind,
        tag: int,
        segment_bytes: int,
        header_bytes: bytes,
        then: Sequence[control.Folded] = (),
    ) -> None:
        s = self.settings
        read = kind is not control.Kind.OPEN
        folded = False
        if kind is control.Kind.OPEN_READ2:
            folded, tag = bool(tag & control.FOLDED), tag & ~control.FOLDED  # flags
        try:
            self._check_open(link, kind, tag, eager=folded and incoming.inline(then))
            header = self._reserve(header_bytes)
        except errors.TransportError as exc:
            log.info("refused a KV transfer from %s: %s", link.who, exc)
            # Details (the model's fingerprint and shapes, epochs, budget) only to a peer
            # TLS authenticated; anyone else learns the class of the refusal.
            # (A retired protocol's refusal says only that: anyone may read it.)
            detailed = link.authenticated or kind is control.Kind.OPEN_READ
            refusal = control.error(exc) if detailed else control.refusal(exc)
            await link.send(refusal, s.idle_timeout_s)
            if folded:  # its READ and LAYERS follow on the link: let the sender read why
                await link.linger(_REFUSAL_WAIT_S)
            return
        rid, epoch = header.request_id, header.epoch
        started = time.monotonic()
        token = 0 if folded else self.tokens.issue()  # one-sided reads need none
        try:
            payload = self._payload(header, then)
            if folded and incoming.whole(header, then):  # eager, as a sender writes it: no loop
                self._take_eager(header, payload, then)
            else:
                receive = incoming.Receive(
                    self._plane, link, header, token, payload, s, segment_bytes, read
                )
                await self._receive(receive, then, accept=not folded)
            self.inbox.complete(
                rid, epoch, wire.assemble(header, payload, partial(self.buffers.release, payload))
            )
        except errors.TransportError as exc:
            self.inbox.fail(rid, epoch, exc)
            log.warning(
                "KV transfer of request %s epoch %s from %s failed: %s", rid, epoch, link.who, exc
            )
            if not isinstance(exc, errors.PeerLostError | errors.TransferTimeoutError):
                with contextlib.suppress(errors.TransportError):
                    await link.send(control.error(exc), _REFUSAL_WAIT_S)
                    await link.linger(_REFUSAL_WAIT_S)  # the sender reads the ERROR, not EPIPE
            link.broken = True
            return
        except BaseException:
            self.inbox.fail(rid, epoch, errors.TransportClosedError("receiver stopped"))
            link.broken = True
            raise
        finally:
            if token:
                self.tokens.spend(token)  # done or failed: its posted receives are gone
        log.debug(
            "received KV of request %s epoch %s: %d bytes in %.1f ms",
            rid,
            epoch,
            header.payload_bytes,
            1000 * (time.monotonic() - started),
        )
        try:
            await link.send(control.encode(control.Kind.DONE), s.idle_timeout_s)
        except errors.TransportError:
            link.broken = True  # the KV is complete and filed; only the ack was lost

    def _take_eager(
        self, header: wire.KvHeader, payload: np.ndarray, folded: Sequence[control.Folded]
    ) -> None:
        """An eager KV whole in its OPEN (`incoming.take_whole`), then the OPEN's body back to the
        pool it was read into (`Link.bodies`): the payload was copied out synchronously,
        nothing reads the body after, verified or not. A body read elsewhere (a
        bytearray) is left to the collector."""
        try:
            incoming.take_whole(header, payload, folded, self.settings.check_finite)
        finally:
            self._give_back(folded)

    def _give_back(self, folded: Sequence[control.Folded]) -> None:
        for m in folded:
            if isinstance(m, control.Inline):
                if isinstance(owner := m.body.obj, np.ndarray):
                    self.buffers.release(owner)
                return

    async def _receive(
        self, receive: incoming.Receive, then: Sequence[control.Folded], *, accept: bool
    ) -> None:
        """The layer loop of an accepted transfer: its receives posted (tagged), ACCEPT
        with its token (unless folded), what was folded into the OPEN, then the rest."""
        try:
            if not self._plane.inline and not receive.one_sided:
                receive.post_receives()
            if accept:
                await receive.link.send(control.accept(receive.tag), self.settings.idle_timeout_s)
            receive.holding = receive.one_sided  # reads start once every folded message is in
            for msg in then:  # folded into the OPEN: taken as if they followed it
                await self._folded(receive, msg)
            if receive.one_sided:  # (a segment read in place may fail here, after others
                receive.start_reads()  # started: those are cancelled)
        except BaseException:
            await receive.cancel_pending()
            raise
        await receive.run()


_OPENS = (control.Kind.OPEN, control.Kind.OPEN_READ, control.Kind.OPEN_READ2)


async def _listen(host: str, port: int) -> list[socket.socket]:
    """Listening sockets on every address ``host`` resolves to, as `asyncio.start_server`
    binds them (address reuse; IPv6 sockets IPv6-only), non-blocking for `sock_accept`."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )
    socks: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(_BACKLOG)
            sock.setblocking(False)
    except BaseException:
        for sock in socks:
            sock.close()
        raise
    if not socks:
        raise OSError(f"{host!r} resolves to no address to listen on")
    return socks


@dataclasses.dataclass(eq=False)
class _Conn:
    """A receiver's control connection: whose, and whether a transfer is using it."""

    host: str
    handler: asyncio.Task[Any] | None
    """The task serving it."""
    link: Link | None = None
    """None until its TLS handshake (if any) is over."""
    busy: bool = False
    idle_since: float = dataclasses.field(default_factory=time.monotonic)

    def drop(self) -> None:
        """Close it for room: its handler sees EOF (or, mid-handshake, is cancelled) and ends."""
        if self.link is not None:
            self.link.broken = True
            self.link.writer.transport.abort()
        elif self.handler is not None:
            self.handler.cancel()
