"""The control connection shared by every backend: framing, deadlines, error translation.

A `Link` is one TCP connection between a sender and a receiver, after HELLO. It keeps at
most one *pending read* outstanding: while a side waits for payload progress it races that
read, so a peer that dies (EOF/RST, seen by the kernel within milliseconds of SIGKILL) or
reports an error is noticed at once, whichever backend carries the payload. A peer that
stalls (SIGSTOP) is caught by the idle deadline instead.

**An idle deadline is the peer's silence, not our loop's lateness** (`Link.silent_for`):
when `read_next`'s deadline comes (`next_message`'s wait already counts a read that
completed in the turn its deadline came), the link first asks when the peer's bytes last came — or
whether some wait on the socket, unread — and only silence for the whole deadline ends the
read. A loop that ran late (another thread holding the GIL or the core: a vLLM model
runner's forward beside a KV connector's loop) would otherwise run the deadline's timer
before the read that the peer's message, sent in time, had made ready: asyncio runs the
timers it finds expired in the same turn as the I/O, before the woken read, and uvloop runs
timers before it polls — a live sender's ALIVE lost to the receiver's own stall.

OSError, IncompleteReadError and TimeoutError are translated into the transport's tree here;
a TLS error (`ssl.SSLError`, e.g. the peer's alert that our certificate is refused, which
TLS 1.3 delivers after the client's handshake) becomes `PeerRejectedError` (`tls_error`),
also when it is what closed the link before a write; the TLS stream ending early
(`ssl.SSLEOFError`) is a lost peer, as a TCP reset is.

**Copies of an eager payload** (`control.eager_bytes`, inline in its OPEN). Out: none of
ours past 64 KiB — `send_parts` hands the KV's buffers to the transport as they lie, and
only what the socket does not take at once is buffered (asyncio copies that rest; uvloop
holds the buffers) — and one join up to it. On asyncio's transport in plaintext the
pieces after the message's head go to the socket in one ``writev`` (`Link._gathered`),
where the transport made a system call, and a TCP segment, per piece: 64 for a 1 MiB KV
of 32 layers apart (~1,000 → ~720 µs, `tcp`). In: the socket (or TLS) layer writes the
OPEN's body straight into a buffer of its own (`read_message`, bodies of 64 KiB or
more: `transport.stream` reads in place; on a receiver's link a recycled one,
`Link.bodies`), then ours, the one copy from that body into the receiver's buffer
(`control.Inline`). Through asyncio's stream reader it was three more —
each ``recv`` into a new bytes object, appended to its buffer, sliced out by
``readexactly`` — and fresh allocations of a few hundred KiB fault their pages in: those
were most of what an eager payload cost past ~128 KiB (a profile at 512 KiB, tcp:
``readexactly`` and ``bytearray.extend`` ahead of everything else). The body's buffer and
the receiver's are both recycled (`transport.buffers`): a fresh 1 MiB buffer faults its
pages in on first touch, ~250 µs here, and two of them were half of a 1 MiB eager
transfer's time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import select
import ssl
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, cast

from transport import control, errors
from transport.base import Peer
from transport.buffers import Bodies
from transport.stream import STREAM_LIMIT, LinkReader

log = logging.getLogger(__name__)

__all__ = ["STREAM_LIMIT", "Link", "read_message", "tls_error", "wait_first"]

_CHUNK = 4 << 20
_IN_PLACE_BYTES = 64 << 10
"""`read_message`: a body this large is read into its own buffer, not the stream's."""
_JOIN_BYTES = 256 << 10
"""`Link.send_batch` joins chunks up to this into one write (one send syscall)."""
_HELD_BYTES = 512 << 10
"""`Link.send_batch` drains once the transport holds more than this unsent."""
_GATHER_BYTES = 64 << 10
"""`Link.send_parts` joins a message up to this into one write (one send syscall)."""
_IOV_MAX = 1024
"""Pieces one `os.writev` may take (Linux's ``IOV_MAX``)."""
_PIECE_BYTES = 16 << 10
"""`Link.send_parts`, past `_GATHER_BYTES`: a buffer this large is written as it lies."""


class Link:
    """One control connection (exclusively used by one transfer at a time)."""

    def __init__(
        self,
        reader: LinkReader,
        writer: asyncio.StreamWriter,
        peer: Peer,
    ) -> None:
        self.reader = reader
        self.writer = writer
        self.peer = peer
        self._pending: asyncio.Task[control.Message] | None = None
        self._stash: control.Message | None = None  # read early while racing a payload
        self.broken = False
        self.on_close: Callable[[], None] | None = None
        """Called once when the link closes (the data plane frees the channel's state)."""
        self.who = ""
        """How logs name the peer: its address, and its TLS identity when it has one."""
        self.authenticated = False
        """Whether TLS verified the peer's certificate and identity (refusals to others
        carry no details, `control.refusal`)."""
        self.keys_told: set[int] = set()
        """One-sided, sender: key ids this link's receiver holds (KEYS sent, not withdrawn)."""
        self.keys: dict[int, control.RemoteKey] = {}
        """One-sided, receiver: the keys the sender announced on this link, by id."""
        self._fd = _plain_fd(writer)
        """The socket, when pieces may be written in one `os.writev` (`_gathered`)."""
        self.bodies: Bodies | None = None
        """Receiver: where an OPEN_READ2 body of `_IN_PLACE_BYTES` or more is read into (a
        numpy buffer of its pool, bodies being read bounded in all; its reader gives it
        back once it copied the payload out, or drops it); None: a bytearray of its own."""

    # -------------------------------------------------------------------------- reading

    def pending(self) -> asyncio.Task[control.Message]:
        """The outstanding read of the next message (started if none is)."""
        if self._pending is None:
            self._pending = asyncio.create_task(
                read_message(self.reader, self.bodies), name="pdorch-kv-read"
            )
        return self._pending

    def take_pending(self) -> control.Message:
        """Consume the finished pending read (raises what it raised)."""
        task = self._pending
        if task is None or not task.done():
            raise errors.TransportClosedError("link closed while reading")
        self._pending = None
        return task.result()

    async def next_message(self, timeout_s: float | None) -> control.Message:
        if self._stash is not None:
            msg, self._stash = self._stash, None
            return msg
        task = self.pending()
        await wait_first([task], timeout_s, what="the peer's next message")
        return self.take_pending()

    async def read_next(self, timeout_s: float) -> control.Message:
        """The next message, read in place when no read is outstanding: no task and no
        loop turn when it is already buffered (the inline payload path reads frame after
        frame so). EOF, a reset and silence for ``timeout_s`` raise as `next_message`."""
        if self._stash is not None or self._pending is not None:
            return await self.next_message(timeout_s)
        try:
            if self._buffered_whole():  # nothing to wait for: no deadline to arm
                return await read_message(self.reader, self.bodies)
            loop = asyncio.get_running_loop()
            start = loop.time()
            check: asyncio.TimerHandle
            async with asyncio.timeout(None) as deadline:

                def due() -> None:
                    nonlocal check
                    when = self.silent_for(timeout_s, start)
                    if when is None:
                        deadline.reschedule(loop.time())  # silent: the read ends
                    else:
                        check = loop.call_at(when, due)

                check = loop.call_at(start + timeout_s, due)
                try:
                    return await read_message(self.reader, self.bodies)
                finally:
                    check.cancel()
        except TimeoutError:
            self.broken = True
            raise errors.TransferTimeoutError(
                f"timed out after {timeout_s}s waiting for the peer's next message"
            ) from None
        except errors.TransportError:
            self.broken = True
            raise

    def silent_for(self, timeout_s: float, since: float) -> float | None:
        """At a read's deadline (the read began at ``since``): None when the peer has been
        silent for ``timeout_s``; else when that would be, counted from its last bytes — or
        from now when bytes wait on the socket unread (this loop ran late, and they came
        while it did not run)."""
        now = asyncio.get_running_loop().time()
        heard = max(self.reader.heard, since)
        if heard + timeout_s > now:
            return heard + timeout_s
        return now + timeout_s if self._unread() else None

    def _unread(self) -> bool:
        """Whether the peer's bytes wait on the socket (readable now)."""
        sock = self.writer.get_extra_info("socket")
        if sock is None:
            return False
        try:
            readable, _, _ = select.select([sock.fileno()], [], [], 0)
        except (OSError, ValueError):  # closed meanwhile: the read says how
            return False
        return bool(readable)

    def message_ready(self) -> bool:
        """Whether the next message can be taken without waiting: read already, or all in
        the stream's buffer (the rest of a write the peer made at once)."""
        if self._stash is not None:
            return True
        if self._pending is not None:
            return self._pending.done()
        return self._buffered_whole()

    def _buffered_whole(self) -> bool:
        """Whether the next message is all in the stream's buffer (one `read_message` reads
        it without waiting; bodies read in place are not)."""
        reader = self.reader
        if reader.buffered() < control.HEAD_SIZE:
            return False
        try:
            _, length = control.decode_head(reader.peek(control.HEAD_SIZE))
        except errors.TransportError:
            return False  # `read_message` raises it
        return length < _IN_PLACE_BYTES and reader.buffered() >= control.HEAD_SIZE + length

    def is_stale(self) -> bool:
        """An idle pooled link whose peer closed it, broke it or spoke out of turn. Seen
        without a read outstanding (the loop keeps filling the stream's buffer, and marks
        its EOF or error, whether or not anyone reads), so the next transfer's reply can be
        read in place: no watch task per idle link to wake, then a waiter."""
        if self.broken or self._stash is not None or self.writer.is_closing():
            return True
        if self._pending is not None:
            return self._pending.done()
        reader = self.reader
        return reader.at_eof() or reader.exception() is not None or reader.buffered() > 0

    # -------------------------------------------------------------------------- writing

    def _check_writable(self) -> None:
        """Raise `PeerLostError` (or the peer's ERROR, if it came first) when the transport
        is already closed — the peer reset it. uvloop raises RuntimeError on a write to a
        closed transport; asyncio's drops the bytes and fails the drain; so look first."""
        if self.writer.transport.is_closing():
            self.broken = True
            self._raise_if_refused()
            why = self.reader.exception()  # e.g. the peer's TLS alert closed it
            if isinstance(why, ssl.SSLError):
                raise tls_error(why) from why
            raise errors.PeerLostError("connection to peer lost: it is closed")

    async def send(self, data: bytes, timeout_s: float) -> None:
        await self._write((data,), timeout_s)

    async def send_parts(self, parts: Sequence[bytes | memoryview], timeout_s: float) -> None:
        """Write one message given in pieces (an eager KV's OPEN: its head, the KV's own
        buffers, its checksums). Up to `_GATHER_BYTES` joined, as `send` writes it; past
        it each buffer of at least `_PIECE_BYTES` is written as it lies (the socket takes
        it straight from the KV's memory when it can; only what it leaves is buffered),
        smaller neighbours joined between them."""
        size = sum(len(p) if isinstance(p, bytes) else p.nbytes for p in parts)
        if size > _GATHER_BYTES:
            await self._write(_coalesce(parts, _PIECE_BYTES), timeout_s)
        elif len(parts) == 1 and isinstance(parts[0], bytes):
            await self.send(parts[0], timeout_s)
        else:
            await self.send(b"".join(parts), timeout_s)

    def _gathered(self, chunks: list[bytes | memoryview]) -> list[bytes | memoryview]:
        """Write as much of ``chunks`` as the socket takes now in one system call per
        `_IOV_MAX` pieces, when nothing is queued before them (asyncio's selector transport
        in plaintext writes each piece with a call of its own, a segment each: 64 for a
        KV of 32 layers apart); what is left, for the transport. OSError is the caller's.
        A small first piece (a message's head) goes ahead on its own, as before: the
        receiver then reads the body's head and sets up its in-place read before the
        body arrives, instead of finding most of it in its stream's buffer (with the head
        gathered, a 256 KiB eager KV read 20–50 µs slower in 6 of 6 pairs of `pdorch bench
        transport`; within noise in one pair of processes)."""
        transport = self.writer.transport
        if self._fd is None or len(chunks) < 3:
            return chunks
        if transport.get_write_buffer_size() or transport.is_closing():
            return chunks
        first = chunks[0]
        if (len(first) if isinstance(first, bytes) else first.nbytes) < _PIECE_BYTES:
            self.writer.write(first)
            if transport.get_write_buffer_size():
                return chunks[1:]
            chunks = chunks[1:]
        while chunks:
            batch = chunks[:_IOV_MAX]
            try:
                sent = os.writev(self._fd, batch)
            except (BlockingIOError, InterruptedError):
                return chunks
            for i, c in enumerate(batch):
                n = len(c) if isinstance(c, bytes) else c.nbytes
                if sent < n:  # the socket is full: this piece's rest and the others wait
                    rest = memoryview(c).cast("B")[sent:] if sent else c
                    return [rest, *chunks[i + 1 :]]
                sent -= n
            chunks = chunks[len(batch) :]
        return chunks

    async def _write(self, chunks: Iterable[bytes | memoryview], timeout_s: float) -> None:
        self._check_writable()
        try:
            for chunk in self._gathered(list(chunks)):
                self.writer.write(chunk)
            transport = self.writer.transport
            if not transport.get_write_buffer_size() and not transport.is_closing():
                return  # all of it went to the socket: nothing to drain (saves loop turns)
            await asyncio.wait_for(self.writer.drain(), timeout_s)
        except TimeoutError:
            self.broken = True
            raise errors.TransferTimeoutError(f"peer did not read for {timeout_s}s") from None
        except ssl.SSLError as exc:
            self.broken = True
            raise tls_error(exc) from exc
        except OSError as exc:
            raise self._lost(exc) from exc

    async def send_payload(self, buffers: Iterable[memoryview], timeout_s: float) -> None:
        """Write payload bytes inline (TCP backend), racing the pending read for errors."""
        self._check_writable()
        try:
            for b in buffers:
                self.writer.write(b)
            drain = asyncio.ensure_future(self.writer.drain())
            try:
                await self.race(drain, timeout_s, what="the peer to read the payload")
            finally:
                drain.cancel()
        except OSError as exc:
            raise self._lost(exc) from exc

    async def send_batch(self, chunks: Sequence[bytes | memoryview], timeout_s: float) -> None:
        """Write many messages and payloads at once (TCP backend, a whole KV): small ones
        joined into one write, and a drain — racing the pending read for the peer's ERROR
        or EOF — only when the transport holds more than `_HELD_BYTES` unsent, and at the
        end past its high-water mark."""
        if sum(c.nbytes if isinstance(c, memoryview) else len(c) for c in chunks) <= _JOIN_BYTES:
            chunks = [b"".join(chunks)]
        transport = self.writer.transport
        self._check_writable()
        try:
            chunks = self._gathered(list(chunks))
        except OSError as exc:
            raise self._lost(exc) from exc
        for c in chunks:
            self._check_writable()
            try:
                self.writer.write(c)
            except OSError as exc:
                raise self._lost(exc) from exc
            if transport.get_write_buffer_size() > _HELD_BYTES:
                # asyncio moves what is left of its buffer after each send (3.11): a large
                # held buffer costs a copy per send. Drain here, as a write per layer did.
                await self.send_payload((), timeout_s)
        high = transport.get_write_buffer_limits()[1]
        if transport.get_write_buffer_size() > high or transport.is_closing():
            await self.send_payload((), timeout_s)

    def _lost(self, exc: OSError) -> errors.TransportError:
        """A write that failed with ``exc``: the link is broken, and what the caller raises
        is the peer's ERROR if it came before the write broke, else `PeerLostError`."""
        self.broken = True
        self._raise_if_refused()
        return errors.PeerLostError(f"connection to peer lost: {exc}")

    def _raise_if_refused(self) -> None:
        """If the peer's ERROR already arrived before our write broke, raise it instead."""
        task, msg = self._pending, self._stash
        finished = task is not None and task.done() and not task.cancelled()
        if msg is None and task is not None and finished and task.exception() is None:
            msg = task.result()
        if msg is not None and msg.kind is control.Kind.ERROR:
            raise control.parse_error(msg.body)

    def _settled(self, task: asyncio.Future[Any]) -> bool:
        """Whether `race` may return at once: ``task`` succeeded already (a small
        segment's send) and there is no word of the peer's to look at first — none
        stashed or read, no byte of it buffered. Anything else (a failure, the peer's
        ERROR on its way) takes the race, which reads the peer first."""
        if not task.done() or task.cancelled() or task.exception() is not None:
            return False
        if self._stash is not None:
            return True
        if self._pending is not None:
            return not self._pending.done()
        return not self.reader.buffered()

    async def race(self, fut: Awaitable[object], timeout_s: float, *, what: str) -> None:
        """Wait for ``fut`` while watching the peer: its EOF, ERROR or silence end the wait."""
        task = asyncio.ensure_future(fut)
        try:
            if self._settled(task):  # no read task and no `asyncio.wait`
                return
            while True:
                watch: list[asyncio.Future[Any]] = [task]
                if self._stash is None:
                    watch.append(self.pending())
                done = await wait_first(watch, timeout_s, what=what, on_timeout=self)
                # The peer's word first, even when our write finished too: a receiver that
                # refused keeps reading (and discarding) only for a while, and writes that
                # always drain at once would otherwise never look at its ERROR.
                if self._stash is None and self._pending is not None and self._pending.done():
                    msg = self.take_pending()  # raises PeerLostError on EOF
                    if msg.kind is control.Kind.ERROR:
                        self.broken = True
                        raise control.parse_error(msg.body)
                    if msg.kind is control.Kind.ABORT:
                        self.broken = True
                        reason = msg.body.decode(errors="replace")
                        raise errors.PeerLostError(f"peer aborted: {reason}")
                    self._stash = msg  # e.g. DONE racing our last drain: keep it for later
                if task in done:
                    task.result()
                    return
        except BaseException:
            self.broken = True
            raise

    async def read_into(self, view: memoryview, timeout_s: float) -> None:
        """Read exactly len(view) payload bytes from the connection (TCP backend), in place
        (`LinkReader.read_into`: what the stream holds, then straight from the socket)."""
        n = len(view)
        try:
            await self.reader.read_into(view, timeout_s)
        except TimeoutError:
            self.broken = True
            raise errors.TransferTimeoutError(
                f"no payload progress for {timeout_s}s (a payload of {n} bytes)"
            ) from None
        except asyncio.IncompleteReadError as exc:
            self.broken = True
            got = len(exc.partial)
            raise errors.PeerLostError(f"peer closed after {got} of {n} payload bytes") from None
        except ssl.SSLError as exc:
            self.broken = True
            raise tls_error(exc) from exc
        except OSError as exc:
            self.broken = True
            raise errors.PeerLostError(f"connection lost after part of {n} bytes") from exc

    async def linger(self, timeout_s: float) -> None:
        """After refusing mid-transfer: half-close and discard what the peer still sends.

        Closing at once, with the peer's payload unread, resets the connection, and the
        peer's next write fails with EPIPE before it reads our ERROR. Lingering lets it
        read the ERROR and stop; bounded by ``timeout_s``, then the link is broken.
        """
        self.broken = True
        if self._pending is not None:
            self._pending.cancel()
            with contextlib.suppress(BaseException):
                await self._pending
            self._pending = None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        with contextlib.suppress(OSError, RuntimeError):
            if self.writer.can_write_eof():
                self.writer.write_eof()
        with contextlib.suppress(OSError, TimeoutError):
            while (left := deadline - loop.time()) > 0:
                if not await asyncio.wait_for(self.reader.read(_CHUNK), left):
                    return  # the peer closed: it has read our ERROR or given up

    async def close(self) -> None:
        """Close the connection; a broken one is aborted (unsent bytes dropped, no waiting)."""
        broken, self.broken = self.broken, True
        on_close, self.on_close = self.on_close, None
        if on_close is not None:
            on_close()
        if self._pending is not None:
            self._pending.cancel()
            with contextlib.suppress(BaseException):
                await self._pending
            self._pending = None
        if broken:
            self.writer.transport.abort()
            return
        self.writer.close()
        with contextlib.suppress(OSError, TimeoutError):
            await asyncio.wait_for(self.writer.wait_closed(), 1.0)


def _plain_fd(writer: asyncio.StreamWriter) -> int | None:
    """The socket's descriptor when the link writes through asyncio's own selector
    transport in plaintext, where `Link._gathered` may write pieces with one `os.writev`;
    None under TLS (the TLS layer encrypts piece by piece anyway) and on uvloop (whose
    transport gathers pieces itself)."""
    transport = writer.transport
    if type(transport).__module__ != "asyncio.selector_events":
        return None
    if transport.get_extra_info("ssl_object") is not None:
        return None
    sock = transport.get_extra_info("socket")
    return None if sock is None else int(sock.fileno())


def _coalesce(parts: Sequence[bytes | memoryview], piece: int) -> Iterable[bytes | memoryview]:
    """``parts`` in order, runs of those under ``piece`` bytes joined into one."""
    run: list[bytes | memoryview] = []
    for p in parts:
        if (len(p) if isinstance(p, bytes) else p.nbytes) >= piece:
            if run:
                yield b"".join(run)
                run = []
            yield p
        else:
            run.append(p)
    if run:
        yield b"".join(run)


def tls_error(exc: ssl.SSLError) -> errors.TransportError:
    """A TLS failure in the transport's tree: the stream cut short (no close_notify) is a
    lost peer (retryable); anything else — an alert, a certificate not verified — a
    refusal (`PeerRejectedError`, permanent)."""
    if isinstance(exc, ssl.SSLEOFError):
        return errors.PeerLostError(f"connection to peer lost: TLS {exc.reason or exc}")
    return errors.PeerRejectedError(f"TLS: {exc.reason or exc}")


async def read_message(reader: LinkReader, bodies: Bodies | None = None) -> control.Message:
    """Read one control message. EOF and resets become PeerLostError. A body of at least
    `_IN_PLACE_BYTES` (an eager KV's OPEN) is read in place into its own buffer
    (`LinkReader.read_into`), not through the stream's: from ``bodies`` when given (a
    receiver's link: a recycled numpy buffer, `Link.bodies`, kept as the body of an
    OPEN_READ2, copied out of any other; past their bound the read waits for room — a
    peer sending large heads and stalling holds no more than the bound over all links),
    else a bytearray (a sender's link, which reads only its receivers' replies)."""
    try:
        head = await reader.readexactly(control.HEAD_SIZE)
        kind, length = control.decode_head(head)
        if length < _IN_PLACE_BYTES:
            body = await reader.readexactly(length) if length else b""
        elif bodies is not None:  # a receiver's link: large bodies bounded over all links
            async with bodies.read(length) as buffer:  # may wait: the caller's deadline
                view = buffer.data
                await reader.read_into(view, None)  # the caller bounds the wait
            if kind is control.Kind.OPEN_READ2:
                body = cast(bytes, view)  # `control.parse_open_read2` takes views
            else:  # a large KEYS, say: copied out, the buffer back at once
                body = bytes(view)
                view.release()
                bodies.pool.release(buffer)
        else:
            into = bytearray(length)
            await reader.read_into(memoryview(into), None)  # the caller bounds the wait
            body = cast(bytes, into)  # every parser reads a body through buffer views
    except asyncio.IncompleteReadError as exc:
        raise errors.PeerLostError("peer closed the connection") from exc
    except ssl.SSLError as exc:
        raise tls_error(exc) from exc
    except OSError as exc:
        raise errors.PeerLostError(f"connection lost: {exc}") from exc
    return control.Message(kind, body)


async def wait_first(
    tasks: Sequence[asyncio.Future[Any]],
    timeout_s: float | None,
    *,
    what: str,
    on_timeout: Link | None = None,
) -> set[asyncio.Future[Any]]:
    """asyncio.wait(FIRST_COMPLETED) with a deadline that raises TransferTimeoutError."""
    done, _ = await asyncio.wait(tasks, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    if not done:
        if on_timeout is not None:
            on_timeout.broken = True
        raise errors.TransferTimeoutError(f"timed out after {timeout_s}s waiting for {what}")
    return done
