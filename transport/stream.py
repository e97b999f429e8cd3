"""A link's byte stream: asyncio's stream reader, fed by a buffered protocol that can read a
payload straight into its destination (`LinkReader.read_into`).

asyncio's stream reader takes each ``recv`` as a new bytes object, appends it to its
buffer and slices a read out of that buffer: three copies, each into a fresh allocation
whose pages fault in. For a layer's payload on the TCP backend those copies, not the
socket, were the cost (a 2 MiB transfer's receiver: ``bytearray.extend`` and the reads
ahead of everything else in its profile). Here the transport reads into memory the
protocol hands it (`asyncio.BufferedProtocol`): while a payload is being read, the
payload's own remaining bytes (the kernel's copy is the only one); otherwise a scratch
buffer reused for every read, from which the stream reader takes one copy, as before.
Messages are read as before (`asyncio.StreamReader.readexactly`).

asyncio's and uvloop's transports, plain and TLS, take buffered protocols (the transport
asks `get_buffer` before each read; uvloop only of a protocol that is not an
`asyncio.Protocol`, hence `LinkProtocol` does the stream reader protocol's work itself).
Bytes handed to `feed_data` instead (a transport that does not) still fill a payload being
read first, so a read in place never waits for bytes that went elsewhere.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
import threading
from typing import Any

STREAM_LIMIT = 4 << 20
"""asyncio stream buffer: large, so inline payloads move in few wakeups."""
_SCRATCH_BYTES = 256 << 10
"""What the transport may read at once outside a payload (asyncio's own read size)."""
_scratch = threading.local()
"""One scratch buffer per thread (each runs one event loop at a time), shared by its links:
a transport asks `get_buffer` and reports `buffer_updated` in one synchronous step (asyncio,
uvloop, TLS alike), and the bytes are copied out before anything else reads — so hundreds
of pooled links hold no buffer of their own."""


def _scratch_buffer() -> memoryview:
    buffer: memoryview | None = getattr(_scratch, "buffer", None)
    if buffer is None:
        buffer = _scratch.buffer = memoryview(bytearray(_SCRATCH_BYTES))
    return buffer


class LinkReader(asyncio.StreamReader):
    """asyncio's stream reader, plus payload reads in place and how much is buffered."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(limit=STREAM_LIMIT, loop=loop)
        self._sink: memoryview | None = None
        """The payload being read in place: what of it is still to come."""
        self._filled = 0
        """Bytes of ``_sink`` the transport has written."""
        self._sink_waiter: asyncio.Future[None] | None = None
        self.heard = loop.time()
        """When the peer's bytes last came (the loop's clock): idle deadlines are silence
        since then (`transport.link.Link.silent_for`)."""

    def buffered(self) -> int:
        """Bytes received and not read yet."""
        return len(self._buffer)  # type: ignore[attr-defined]  # asyncio's own buffer

    def peek(self, nbytes: int) -> bytes:
        """The first ``nbytes`` received and not read yet (fewer if fewer are), left there."""
        return bytes(self._buffer[:nbytes])  # type: ignore[attr-defined]

    # ---------------------------------------------------------------- the protocol's side

    def sink(self) -> memoryview | None:
        """Where the transport should write next: the payload's rest, or None (scratch)."""
        if self._sink is None or self._filled >= len(self._sink):
            return None  # (full: the reader has not run yet to take it back)
        return self._sink[self._filled :]

    def filled(self, nbytes: int) -> None:
        """The transport wrote ``nbytes`` more of the payload."""
        assert self._sink is not None
        self._filled += nbytes
        self.heard = self._loop.time()  # type: ignore[attr-defined]  # asyncio's own
        if self._filled >= len(self._sink):
            self._wake_sink()

    def feed_data(self, data: Any) -> None:
        self.heard = self._loop.time()  # type: ignore[attr-defined]  # asyncio's own
        if self._sink is not None and data:  # a transport that is not buffered
            rest = self._sink[self._filled :]
            take = min(len(rest), len(data))
            rest[:take] = memoryview(data)[:take]
            self.filled(take)
            data = memoryview(data)[take:]
            if not data:
                return
        super().feed_data(data)

    def feed_eof(self) -> None:
        super().feed_eof()
        self._wake_sink()

    def set_exception(self, exc: Exception) -> None:
        super().set_exception(exc)
        self._wake_sink()

    def _wake_sink(self) -> None:
        waiter, self._sink_waiter = self._sink_waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # ------------------------------------------------------------------ the reader's side

    async def read_into(self, view: memoryview, timeout_s: float | None) -> None:
        """Read exactly ``len(view)`` bytes into ``view``: what is buffered first (one copy),
        then the rest written there by the transport itself. Raises `TimeoutError` when no
        byte came for ``timeout_s`` (None: the caller bounds the wait),
        `asyncio.IncompleteReadError` at EOF, and the stream's exception (a reset, a TLS
        error) as `readexactly` does."""
        n = len(view)
        pos = self._take_buffered(view)
        if pos == n:
            return
        if self._sink is not None:
            raise RuntimeError("read_into() called while another read_into() is waiting")
        self._sink, self._filled = view[pos:], 0
        loop = asyncio.get_running_loop()
        try:
            while self._filled < len(self._sink):
                if self._exception is not None:  # type: ignore[attr-defined]
                    raise self._exception  # type: ignore[attr-defined]
                if self._eof:  # type: ignore[attr-defined]
                    raise asyncio.IncompleteReadError(bytes(view[: pos + self._filled]), n)
                self._maybe_resume_transport()  # type: ignore[attr-defined]
                before = self._filled
                self._sink_waiter = waiter = loop.create_future()
                done, _ = await asyncio.wait([waiter], timeout=timeout_s)
                if not done and self._filled == before:
                    raise TimeoutError
        finally:
            self._sink, self._sink_waiter = None, None

    def _take_buffered(self, view: memoryview) -> int:
        """Copy what is buffered (up to ``len(view)``) into ``view``; how many bytes."""
        buffer: bytearray = self._buffer  # type: ignore[attr-defined]
        take = min(len(buffer), len(view))
        if take:
            with memoryview(buffer) as held:
                view[:take] = held[:take]
            del buffer[:take]
            self._maybe_resume_transport()  # type: ignore[attr-defined]
        return take


class LinkProtocol(asyncio.BufferedProtocol):
    """A stream reader's protocol (what `asyncio.StreamReaderProtocol` does for a client's
    stream, with its flow control for `asyncio.StreamWriter.drain`) that lets the
    transport write into a payload in place (`LinkReader.sink`), and otherwise into its
    thread's scratch buffer. Not an `asyncio.Protocol`: uvloop reads into the buffers only
    of a protocol that is not one."""

    def __init__(self, reader: LinkReader, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._reader = reader
        self._scratch = _scratch_buffer()
        self._into_sink = False
        self._over_ssl = False
        self._paused = False
        self._lost = False
        self._drain_waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._closed: asyncio.Future[None] = loop.create_future()

    # ------------------------------------------------------------------------ reading

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._reader.set_transport(transport)
        self._over_ssl = transport.get_extra_info("sslcontext") is not None

    def get_buffer(self, sizehint: int) -> memoryview:
        sink = self._reader.sink()
        self._into_sink = sink is not None
        if sink is not None:
            return sink
        self._scratch = _scratch_buffer()  # this thread's (a link may move between loops)
        return self._scratch

    def buffer_updated(self, nbytes: int) -> None:
        if self._into_sink:
            self._reader.filled(nbytes)
        else:
            self._reader.feed_data(self._scratch[:nbytes])

    def data_received(self, data: bytes) -> None:
        """(A transport that does not take buffered protocols.)"""
        self._reader.feed_data(data)

    def eof_received(self) -> bool:
        self._reader.feed_eof()
        return not self._over_ssl  # keep the write side open (TLS cannot)

    def connection_lost(self, exc: Exception | None) -> None:
        if exc is None:
            self._reader.feed_eof()
        else:
            self._reader.set_exception(exc)
        if not self._closed.done():
            if exc is None:
                self._closed.set_result(None)
            else:
                self._closed.set_exception(exc)
        self._lost = True
        self._wake_drains(exc)

    # ------------------------------------------------------------------------ writing

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        self._wake_drains(None)

    def _wake_drains(self, exc: Exception | None) -> None:
        for waiter in self._drain_waiters:
            if not waiter.done():
                if exc is None:
                    waiter.set_result(None)
                else:
                    waiter.set_exception(exc)

    async def _drain_helper(self) -> None:
        """What `asyncio.StreamWriter.drain` awaits: the transport below its high-water mark."""
        if self._lost:
            raise ConnectionResetError("Connection lost")
        if not self._paused:
            return
        waiter: asyncio.Future[None] = self._loop.create_future()
        self._drain_waiters.append(waiter)
        try:
            await waiter
        finally:
            self._drain_waiters.remove(waiter)

    def _get_close_waiter(self, stream: object) -> asyncio.Future[None]:
        """What `asyncio.StreamWriter.wait_closed` awaits."""
        return self._closed

    def __del__(self) -> None:
        closed = getattr(self, "_closed", None)
        if closed is not None and closed.done() and not closed.cancelled():
            closed.exception()  # retrieved: no "exception was never retrieved" report


def pair(loop: asyncio.AbstractEventLoop) -> tuple[LinkReader, LinkProtocol]:
    """A reader and its protocol, for an accepted socket (`loop.connect_accepted_socket`)."""
    reader = LinkReader(loop)
    return reader, LinkProtocol(reader, loop)


async def connect(
    host: str, port: int, tls: ssl.SSLContext | None, handshake_timeout_s: float
) -> tuple[LinkReader, asyncio.StreamWriter]:
    """`asyncio.open_connection` with a `LinkProtocol` (and, with ``tls``, the peer's
    name checked against ``host`` and the handshake bounded)."""
    loop = asyncio.get_running_loop()
    reader, protocol = pair(loop)
    if tls is None:
        transport, _ = await loop.create_connection(lambda: protocol, host, port)
    else:
        transport, _ = await loop.create_connection(
            lambda: protocol,
            host,
            port,
            ssl=tls,
            server_hostname=host,
            ssl_handshake_timeout=handshake_timeout_s,
        )
    return reader, asyncio.StreamWriter(transport, protocol, reader, loop)
