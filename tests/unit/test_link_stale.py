"""`Link.is_stale` without a read outstanding: an idle pooled link is judged from what the
stream holds (the sender reads its next reply in place, so no watch task waits on it)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from transport import control, stream
from transport.base import Peer
from transport.link import Link

Peer_ = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _idle_link(peer: Peer_) -> bool:
    """Connect to a server running ``peer``; return whether the link is stale once the
    peer has done its part (and the loop has seen it)."""
    done, release, ended = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await peer(reader, writer)
        done.set()
        await release.wait()  # leave the connection as the peer left it until judged
        writer.close()
        ended.set()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await stream.connect("127.0.0.1", port, None, 5)
    link = Link(reader, writer, Peer(b"", b""))
    try:
        await asyncio.wait_for(done.wait(), 5)
        for _ in range(50):  # the loop delivers what the peer did: no read needed
            if link.is_stale():
                break
            await asyncio.sleep(0.01)
        assert link._pending is None  # judging it started no read
        return link.is_stale()
    finally:
        release.set()
        await link.close()
        await asyncio.wait_for(ended.wait(), 5)
        server.close()
        await server.wait_closed()


async def _quiet(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    pass


async def _closes(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.close()


async def _resets(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.transport.abort()


async def _speaks(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(control.encode(control.Kind.DONE))  # out of turn
    await writer.drain()


@pytest.mark.parametrize(
    ("peer", "stale"),
    [(_quiet, False), (_closes, True), (_resets, True), (_speaks, True)],
    ids=["quiet", "closed", "reset", "spoke-out-of-turn"],
)
def test_an_idle_link_is_stale_once_its_peer_closed_broke_or_spoke(
    peer: Peer_, stale: bool
) -> None:
    assert asyncio.run(_idle_link(peer)) is stale


@pytest.mark.parametrize("loop_name", ["asyncio", "uvloop"])
@pytest.mark.parametrize("how", ["send", "send_payload", "send_batch"])
def test_a_write_to_a_link_the_peer_reset_is_peer_lost(loop_name: str, how: str) -> None:
    """The peer reset the connection and the loop closed the transport: the next write is
    `PeerLostError` on both loops (uvloop raised RuntimeError, which no caller expects: a
    sender on uvloop whose receiver was killed failed with it)."""
    from transport import errors  # noqa: PLC0415

    new_loop = asyncio.new_event_loop
    if loop_name == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        new_loop = uvloop.new_event_loop

    async def main() -> None:
        reset = asyncio.Event()

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.transport.abort()
            reset.set()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        reader, writer = await stream.connect("127.0.0.1", port, None, 5)
        link = Link(reader, writer, Peer(b"", b""))
        try:
            await asyncio.wait_for(reset.wait(), 5)
            for _ in range(200):  # writes meet the peer's reset: the loop closes the transport
                if writer.transport.is_closing():
                    break
                writer.write(b"x")
                await asyncio.sleep(0.01)
            assert writer.transport.is_closing()
            data = control.hello(b"i" * control.INSTANCE_ID_BYTES, b"")
            writes = {
                "send": lambda: link.send(data, 1.0),
                "send_payload": lambda: link.send_payload([memoryview(data)], 1.0),
                "send_batch": lambda: link.send_batch([data], 1.0),
            }
            with pytest.raises(errors.PeerLostError):
                await writes[how]()
        finally:
            await link.close()
            server.close()
            await server.wait_closed()

    loop = new_loop()
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
