"""A link writes a message's pieces in one system call (`Link._gathered`: ``os.writev``),
on asyncio's own transport in plaintext; under TLS and on uvloop the transport writes them.
Whatever the socket takes at once — all of it, or a part ending inside a piece — the peer
reads exactly the pieces, in order."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
from pathlib import Path

import numpy as np
import pytest

from transport import errors, stream
from transport.base import Peer
from transport.link import Link
from transport.security import load_dir

pytest.importorskip("cryptography", reason="the test extra's cryptography")
from tests.contract.kv_tls_certs import make_pki

pytestmark = pytest.mark.timeout(60)

KIB = 1 << 10


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_pki(tmp_path_factory.mktemp("gather-pki"))


class _Writev:
    """Every ``os.writev`` the link makes: bytes asked, bytes the socket took."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[int, int]] = []
        original = os.writev

        def writev(fd: int, buffers: list[bytes | memoryview]) -> int:
            asked = sum(len(b) if isinstance(b, bytes) else b.nbytes for b in buffers)
            self.calls.append((asked, -1))
            took = original(fd, buffers)
            self.calls[-1] = (asked, took)
            return took

        monkeypatch.setattr(os, "writev", writev)


def _pieces(n: int, size: int) -> list[bytes | memoryview]:
    """A small head, then ``n`` pieces of ``size`` bytes each with bytes of its own,
    half of them views of numpy memory (as a KV's layers are)."""
    rng = np.random.default_rng(n)
    out: list[bytes | memoryview] = [b"head" * 8]
    for i in range(n):
        data = rng.integers(0, 256, size, dtype=np.uint8)
        out.append(data.data if i % 2 else data.tobytes())
    return out


async def _send(
    pieces: list[bytes | memoryview],
    *,
    batch: bool,
    pki: Path | None,
    sndbuf: int = 0,
    slow_reader: bool = False,
) -> tuple[bytes, Link]:
    """Write ``pieces`` on a link (one message's parts, or `send_batch`'s chunks); what
    the peer read, all of it."""
    total = sum(len(p) if isinstance(p, bytes) else p.nbytes for p in pieces)
    got: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if slow_reader:
            await asyncio.sleep(0.2)  # the sender's socket fills: its writes are partial
        got.set_result(await reader.readexactly(total))
        await reader.read()  # open until the link closes (a drain races the peer's EOF)
        writer.close()

    server_ctx = client_ctx = None
    if pki is not None:
        server_ctx = load_dir(pki, "decode").server
        client_ctx = load_dir(pki, "prefill").client
    server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=server_ctx)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await stream.connect("127.0.0.1", port, client_ctx, 5)
    if sndbuf:
        writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
    link = Link(reader, writer, Peer(b"", b""))
    try:
        if batch:
            await link.send_batch(pieces, 10.0)
            await link.send_payload((), 10.0)  # what the transport still holds goes out
        else:
            await link.send_parts(pieces, 10.0)
        return await asyncio.wait_for(got, 10), link
    finally:
        await link.close()
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize("batch", [False, True], ids=["message", "batch"])
@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
@pytest.mark.usefixtures("event_loop_kind")
def test_pieces_arrive_in_order_and_plain_asyncio_gathers_them(
    batch: bool, tls: bool, event_loop_kind: str, pki: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """64 pieces of 16 KiB after a small head (a 1 MiB KV of 32 layers apart, K and V
    apart): the peer reads exactly them; on asyncio in plaintext the pieces after the
    head went in one ``writev`` (the head first, alone: `Link._gathered`), elsewhere in
    none."""
    writev = _Writev(monkeypatch)
    pieces = _pieces(64, 16 * KIB)
    got, link = asyncio.run(_send(pieces, batch=batch, pki=pki if tls else None))
    assert got == b"".join(bytes(p) for p in pieces)
    gathers = event_loop_kind == "asyncio" and not tls
    assert (link._fd is not None) == gathers
    if gathers:
        assert writev.calls
        assert writev.calls[0][0] == 64 * 16 * KIB  # every piece but the head, at once
    else:
        assert not writev.calls


@pytest.mark.parametrize("batch", [False, True], ids=["message", "batch"])
def test_a_partial_gathered_write_leaves_the_rest_to_the_transport_in_order(
    batch: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A small send buffer and a peer that reads late: the socket takes part of the
    pieces, ending inside one; that piece's rest and the pieces after it follow through
    the transport, and the peer reads every byte in order."""
    writev = _Writev(monkeypatch)
    pieces = _pieces(96, 24 * KIB + 7)  # odd sizes: the socket's cut falls inside a piece
    got, _ = asyncio.run(_send(pieces, batch=batch, pki=None, sndbuf=16 * KIB, slow_reader=True))
    assert got == b"".join(bytes(p) for p in pieces)
    asked, took = writev.calls[0]
    assert 0 < took < asked


def test_a_gathered_write_to_a_peer_that_reset_is_a_lost_peer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The peer reset the connection before this loop saw it: the gathered write's own
    error is the link's `PeerLostError`, as a write through the transport's is."""
    writev = _Writev(monkeypatch)
    listener = socket.create_server(("127.0.0.1", 0))
    connected, reset = threading.Event(), threading.Event()

    def peer() -> None:  # a thread: it resets while the link's loop does not turn
        conn, _ = listener.accept()
        connected.wait(5)
        linger = (1).to_bytes(4, "little") + bytes(4)  # on, 0 s: close sends a reset
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
        conn.close()
        reset.set()

    async def main() -> None:
        port = listener.getsockname()[1]
        reader, writer = await stream.connect("127.0.0.1", port, None, 5)
        link = Link(reader, writer, Peer(b"", b""))
        connected.set()
        try:
            assert reset.wait(5)  # blocking, on purpose: no loop turn sees the reset
            with pytest.raises(errors.PeerLostError):
                await link.send_parts(_pieces(64, 16 * KIB)[1:], 5.0)  # no head: one writev
        finally:
            await link.close()

    thread = threading.Thread(target=peer, daemon=True)
    thread.start()
    try:
        asyncio.run(main())
    finally:
        listener.close()
        thread.join(5)
    assert writev.calls  # the error came from the gathered write itself
    assert writev.calls[0][1] == -1
