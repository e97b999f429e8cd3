"""A link's stream (`transport.stream`): payloads read in place, on real sockets, plain and
mutual TLS, on asyncio's loop and on uvloop's.

The transport writes a payload straight into its destination (`LinkReader.read_into`):
what the stream already holds is copied first, the rest never passes the stream's buffer;
messages before and after it read as before; EOF, a reset and silence end the read as
the `Link` reports them."""

from __future__ import annotations

import asyncio
import socket
import ssl
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np
import pytest

from transport import control, errors, stream
from transport.base import Peer
from transport.link import Link
from transport.security import load_dir

pytest.importorskip("cryptography", reason="the test extra's cryptography")
from tests.contract.kv_tls_certs import make_pki

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("event_loop_kind")]

MIB = 1 << 20
Serve = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_pki(tmp_path_factory.mktemp("stream-pki"))


def _contexts(pki: Path | None) -> tuple[ssl.SSLContext | None, ssl.SSLContext | None]:
    if pki is None:
        return None, None
    return load_dir(pki, "decode").server, load_dir(pki, "prefill").client


async def _linked(serve: Serve, pki: Path | None) -> tuple[Link, asyncio.Server]:
    server_ctx, client_ctx = _contexts(pki)

    async def serving(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await serve(reader, writer)
        except (ConnectionError, ssl.SSLError):
            pass  # the client cut it: what some tests do
        finally:
            writer.transport.abort()

    server = await asyncio.start_server(serving, "127.0.0.1", 0, ssl=server_ctx)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await stream.connect("127.0.0.1", port, client_ctx, 5)
    return Link(reader, writer, Peer(b"", b"")), server


async def _close(link: Link, server: asyncio.Server) -> None:
    await link.close()
    server.close()
    await server.wait_closed()
    await asyncio.sleep(0.05)  # the server's handler sees the close and ends


class _Fed:
    """Bytes that went through the stream's buffer (`LinkReader.feed_data`)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.nbytes = 0
        original = stream.LinkReader.feed_data

        def feed(reader: stream.LinkReader, data: bytes) -> None:
            self.nbytes += len(data)
            original(reader, data)

        monkeypatch.setattr(stream.LinkReader, "feed_data", feed)


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_a_payload_between_messages_is_read_in_place(
    tls: bool, pki: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A message, 8 MiB of payload (sent in pieces, with pauses so that most of it comes
    after the read began), then another message: the payload arrives intact and at most
    what came before the read passed through the stream's buffer."""
    payload = np.random.default_rng(1).integers(0, 256, 8 * MIB, dtype=np.uint8).tobytes()
    fed = _Fed(monkeypatch)
    started = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"head:" + payload[: 64 << 10])
        await writer.drain()
        await started.wait()
        for i in range(64 << 10, len(payload), MIB):
            writer.write(payload[i : i + MIB])
            await writer.drain()
            await asyncio.sleep(0.002)
        writer.write(b":tail")
        await writer.drain()
        await reader.read()  # until the client closes
        writer.close()

    async def main() -> None:
        link, server = await _linked(serve, pki if tls else None)
        try:
            assert await link.reader.readexactly(5) == b"head:"
            await asyncio.sleep(0.05)  # the first 64 KiB are in the stream's buffer
            before = fed.nbytes
            into = memoryview(bytearray(len(payload)))
            started.set()
            await link.read_into(into, 5.0)
            assert bytes(into) == payload
            # Nothing of the payload went through the buffer (":tail" may have, after it).
            assert fed.nbytes - before <= len(b":tail")
            assert before <= 5 + (64 << 10)
            assert await link.reader.readexactly(5) == b":tail"
        finally:
            await _close(link, server)

    asyncio.run(main())


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_a_peer_closing_mid_payload_is_a_lost_peer(tls: bool, pki: Path) -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"x" * 1000)
        await writer.drain()
        writer.close()

    async def main() -> None:
        link, server = await _linked(serve, pki if tls else None)
        try:
            with pytest.raises(errors.PeerLostError, match=r"peer closed after 1000 of 4096"):
                await link.read_into(memoryview(bytearray(4096)), 5.0)
            assert link.broken
        finally:
            await _close(link, server)

    asyncio.run(main())


def test_a_reset_mid_payload_is_a_lost_peer() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"x" * 1000)
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.transport.abort()

    async def main() -> None:
        link, server = await _linked(serve, None)
        try:
            with pytest.raises(errors.PeerLostError):
                await link.read_into(memoryview(bytearray(MIB)), 5.0)
        finally:
            await _close(link, server)

    asyncio.run(main())


def test_a_payload_that_stops_coming_times_out_but_a_slow_one_does_not() -> None:
    """The timeout is for silence: a payload trickling in slower than the timeout in all
    but faster between bytes is read; one that stops is not."""
    go_on = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(8):  # 8 × 50 ms: 0.4 s in all, against a 0.2 s timeout
            writer.write(b"y" * 512)
            await writer.drain()
            await asyncio.sleep(0.05)
        await go_on.wait()
        writer.write(b"z" * 10)  # then silence
        await writer.drain()
        await reader.read()
        writer.close()

    async def main() -> None:
        link, server = await _linked(serve, None)
        try:
            into = memoryview(bytearray(8 * 512))
            await link.read_into(into, 0.2)
            assert bytes(into) == b"y" * 4096
            go_on.set()
            with pytest.raises(errors.TransferTimeoutError, match="no payload progress"):
                await link.read_into(memoryview(bytearray(100)), 0.2)
            assert link.broken
        finally:
            await _close(link, server)

    asyncio.run(main())


def test_bytes_fed_while_a_payload_is_read_fill_it_first() -> None:
    """A transport that hands the reader bytes (`feed_data`) rather than asking for a buffer
    still fills the payload being read, and what follows it stays buffered in order."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        reader, _ = stream.pair(loop)
        reader.feed_data(b"ab")
        into = memoryview(bytearray(6))
        read = asyncio.create_task(reader.read_into(into, 5.0))
        await asyncio.sleep(0)
        sink = reader.sink()
        assert sink is not None
        assert sink.nbytes == 4
        reader.feed_data(b"cdefgh")
        await read
        assert bytes(into) == b"abcdef"
        assert reader.buffered() == 2
        assert await reader.readexactly(2) == b"gh"
        assert reader.sink() is None

    asyncio.run(main())


def test_a_large_message_body_is_read_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """A message body of 64 KiB or more (an eager KV's OPEN) is read into its own buffer,
    not through the stream's; a small one after it reads as before."""
    fed = _Fed(monkeypatch)
    body = bytes(range(256)) * 4096  # 1 MiB
    small = control.encode(control.Kind.ALIVE)

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = control.encode(control.Kind.PAYLOAD)[:1] + len(body).to_bytes(4, "little")
        writer.write(head)
        await writer.drain()
        await asyncio.sleep(0.05)  # the client is reading the body by then
        writer.write(body + small)
        await writer.drain()
        await reader.read()

    async def main() -> None:
        link, server = await _linked(serve, None)
        try:
            msg = await link.read_next(5.0)
            assert msg.kind is control.Kind.PAYLOAD
            assert msg.body == body
            assert fed.nbytes <= control.HEAD_SIZE * 2  # the heads, never the body
            assert (await link.read_next(5.0)).kind is control.Kind.ALIVE
        finally:
            await _close(link, server)

    asyncio.run(main())


def test_read_next_takes_buffered_messages_at_once_and_still_times_out_on_a_partial_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Messages already whole in the stream's buffer are read without arming a deadline
    (`asyncio.timeout` cost ~4.6 µs a message here); a head whose body has not all come
    still waits within the deadline, and silence past it raises."""
    armed: list[float] = []
    real_timeout = asyncio.timeout

    def counted(delay: float | None) -> asyncio.Timeout:
        armed.append(delay or 0.0)
        return real_timeout(delay)

    monkeypatch.setattr(asyncio, "timeout", counted)
    two = control.encode(control.Kind.ALIVE) + control.encode(control.Kind.ABORT, b"x" * 40)
    partial = control.encode(control.Kind.ABORT, b"y" * 40)[:20]

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(two + partial)  # then silence: the last body never completes
        await writer.drain()
        await reader.read()

    async def main() -> None:
        link, server = await _linked(serve, None)
        try:
            for _ in range(1000):  # all of it in the buffer
                if link.reader.buffered() == len(two) + len(partial):
                    break
                await asyncio.sleep(0.01)
            assert (await link.read_next(5.0)).kind is control.Kind.ALIVE
            got = await link.read_next(5.0)
            assert (got.kind, bytes(got.body)) == (control.Kind.ABORT, b"x" * 40)
            assert armed == []  # both were whole in the buffer
            with pytest.raises(errors.TransferTimeoutError, match="next message"):
                await link.read_next(0.2)
            assert len(armed) == 1  # one deadline: for the message not all in
        finally:
            await _close(link, server)

    asyncio.run(main())


@pytest.mark.parametrize("ours", ["failed", "done"])
def test_race_reads_the_peers_error_first_whatever_became_of_our_send(ours: str) -> None:
    """The receiver's ERROR already on the link is what `race` raises — before our own
    send's failure (which the refusal may have caused: the wrong error would blame the
    wrong worker), and instead of returning for a send that finished. A send finished with
    nothing from the peer returns at once."""
    refusal = control.error(errors.ChecksumMismatchError("checksum mismatch in layer 3"))

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(refusal)
        await writer.drain()
        await reader.read()

    async def quiet(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()

    def sent(loop: asyncio.AbstractEventLoop) -> asyncio.Future[None]:
        fut: asyncio.Future[None] = loop.create_future()
        if ours == "failed":
            fut.set_exception(errors.PeerLostError("payload send failed"))
        else:
            fut.set_result(None)
        return fut

    async def main() -> None:
        link, server = await _linked(serve, None)
        try:
            for _ in range(1000):  # the ERROR is in the stream's buffer
                if link.reader.buffered() == len(refusal):
                    break
                await asyncio.sleep(0.01)
            with pytest.raises(errors.ChecksumMismatchError, match="layer 3"):
                await link.race(sent(asyncio.get_running_loop()), 5.0, what="a layer send")
            assert link.broken
        finally:
            await _close(link, server)
        link, server = await _linked(quiet, None)
        try:
            fut = sent(asyncio.get_running_loop())
            if ours == "failed":
                with pytest.raises(errors.PeerLostError):
                    await link.race(fut, 5.0, what="a layer send")
                assert link.broken
            else:
                await link.race(fut, 5.0, what="a layer send")
                assert link._pending is None  # no read task started for it
        finally:
            await _close(link, server)

    asyncio.run(main())


@pytest.mark.parametrize("read", ["read_next", "next_message"])
def test_a_message_sent_in_time_is_read_even_when_our_loop_ran_past_the_deadline(
    read: str,
) -> None:
    """The idle deadline is the peer's silence (`Link.silent_for`): a peer sends within the
    deadline while this loop is blocked past it (a GIL or a core held elsewhere) — the
    message is read, not lost to the deadline's timer, which the loop runs first when it
    wakes; a peer that says nothing still times out."""
    listener = socket.create_server(("127.0.0.1", 0))
    send = threading.Event()
    done = threading.Event()

    def peer() -> None:
        conn, _ = listener.accept()
        with conn:
            send.wait(10)
            time.sleep(0.1)  # while the reader's loop is blocked, before its deadline
            conn.sendall(control.encode(control.Kind.ALIVE))
            done.wait(10)

    thread = threading.Thread(target=peer, daemon=True)
    thread.start()

    async def main() -> None:
        port = listener.getsockname()[1]
        reader, writer = await stream.connect("127.0.0.1", port, None, 5)
        link = Link(reader, writer, Peer(b"", b""))
        try:
            reading = asyncio.create_task(getattr(link, read)(0.3))
            await asyncio.sleep(0.02)  # the read is waiting
            send.set()
            time.sleep(0.6)  # noqa: ASYNC251 - the point: this loop does not run
            assert (await reading).kind is control.Kind.ALIVE
            t0 = time.monotonic()
            with pytest.raises(errors.TransferTimeoutError, match="next message"):
                await getattr(link, read)(0.2)
            assert 0.15 < time.monotonic() - t0 < 1.5
        finally:
            done.set()
            await link.close()

    try:
        asyncio.run(main())
    finally:
        done.set()
        thread.join(5)
        listener.close()
