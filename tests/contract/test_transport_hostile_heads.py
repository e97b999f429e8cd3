"""A KV receiver's peer controls every message head it sends — the length included — before
anything in the body can be checked. Heads of messages that are always small (HELLO, DONE,
ALIVE, …) declaring a large body are refused from the head, the link dropped; a large body
of any other kind is read into the receiver's bounded body buffers (`buffers.Bodies`), so
peers sending heads and stalling hold at most that bound over all their links — not
links × `control.MAX_BODY`."""

from __future__ import annotations

import asyncio
import os
import struct

import pytest

from transport import control, errors
from transport.backends import make_receiver
from transport.base import TransportSettings


def test_a_small_kinds_head_declaring_a_large_body_is_refused_from_the_head() -> None:
    for kind in (control.Kind.HELLO, control.Kind.ALIVE, control.Kind.ERROR, control.Kind.DONE):
        with pytest.raises(errors.WireFormatError, match=f"{kind.name} message of"):
            control.decode_head(struct.pack("<BI", kind, control.SMALL_BODY_BYTES + 1))
        assert control.decode_head(struct.pack("<BI", kind, control.SMALL_BODY_BYTES)) == (
            kind,
            control.SMALL_BODY_BYTES,
        )


async def _hello(host: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    r, w = await asyncio.open_connection(host, port)
    w.write(control.hello(os.urandom(control.INSTANCE_ID_BYTES), b""))
    head = await asyncio.wait_for(r.readexactly(control.HEAD_SIZE), 5)
    await r.readexactly(control.decode_head(head)[1])
    return r, w


def test_stalled_large_heads_hold_no_more_than_the_receivers_body_bound() -> None:
    bound = 3 * control.MAX_BODY
    settings = TransportSettings(body_reading_bytes=bound)

    async def main() -> None:
        receiver = make_receiver("tcp", settings)
        host, _, port = (await receiver.start()).rpartition(":")
        writers = []
        try:
            # An ALIVE declaring 4 MiB: dropped at its head.
            r, w = await _hello(host, int(port))
            w.write(struct.pack("<BI", control.Kind.ALIVE, control.MAX_BODY) + b"x")
            assert await asyncio.wait_for(r.read(), 5) == b""  # closed, nothing taken
            w.close()
            # KEYS heads of MAX_BODY, one byte each, then silence: at most the bound held.
            for _ in range(8):
                _, w = await _hello(host, int(port))
                w.write(struct.pack("<BI", control.Kind.KEYS, control.MAX_BODY) + b"x")
                writers.append(w)
            await asyncio.sleep(0.5)
            assert 0 < receiver.bodies.reading <= bound
        finally:
            for w in writers:
                w.close()
            await receiver.close()

    asyncio.run(main())
