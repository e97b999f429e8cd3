"""One-sided UCX: the receiver reads only into the slice it reserved, once per segment.

A sender announcing regions that do not add up to the segment's size, or a segment that
does not exist, or a one-sided OPEN to a receiver without that path, is refused with a
clear error before any read is issued, and the reservation is released.
"""

from __future__ import annotations

import asyncio

import pytest

from transport import control, errors, testing, wire
from transport.backends import UCX_READ, make_receiver
from transport.base import TransportSettings
from transport.tcp import tcp_receiver
from transport.ucx import ucx_available

pytestmark = [pytest.mark.ucx, pytest.mark.skipif(not ucx_available(), reason="no ucxx")]


async def _message(reader: asyncio.StreamReader) -> control.Message:
    kind, length = control.decode_head(await asyncio.wait_for(reader.readexactly(5), 5))
    return control.Message(kind, await asyncio.wait_for(reader.readexactly(length), 5))


async def _refused(regions: list[control.RemoteRegion], index: int = 0) -> str:
    receiver = make_receiver(UCX_READ, TransportSettings())
    address = await receiver.start()
    try:
        reader, writer = await testing._say_hello(address)
        cache = testing.synthetic_cache("r", 1, 64 * testing.KIB, n_layers=2)
        writer.write(control.open_(0, 1 << 20, wire.encode_header(cache.header), read=True))
        assert (await _message(reader)).kind is control.Kind.ACCEPT
        writer.write(control.segment(index, regions))
        msg = await _message(reader)
        while msg.kind is control.Kind.LANDED:
            msg = await _message(reader)
        assert msg.kind is control.Kind.ERROR, msg.kind
        with pytest.raises(errors.WireFormatError):
            await receiver.take("r", 1, timeout_s=5)
        assert receiver.inbox.bytes_in_use == 0
        writer.close()
        return control.parse_error(msg.body).args[0]
    finally:
        await receiver.close()


def test_regions_that_do_not_add_up_to_the_segment_are_refused() -> None:
    too_long = [control.RemoteRegion(4096, 64 * testing.KIB + 1, b"k")]
    assert "do not add up" in asyncio.run(_refused(too_long))


def test_a_segment_out_of_range_is_refused() -> None:
    fits = [control.RemoteRegion(4096, 64 * testing.KIB, b"k")]
    assert "out of range" in asyncio.run(_refused(fits, index=1))  # 64 KiB: one segment


def test_a_one_sided_open_to_a_receiver_without_that_path_is_refused() -> None:
    async def run() -> None:
        receiver = tcp_receiver(TransportSettings())
        address = await receiver.start()
        try:
            reader, writer = await testing._say_hello(address)
            header = wire.encode_header(testing.synthetic_cache("t", 1, 1024).header)
            writer.write(control.open_(0, 1 << 20, header, read=True))
            msg = await _message(reader)
            assert msg.kind is control.Kind.ERROR
            assert isinstance(control.parse_error(msg.body), errors.HeaderRejectedError)
            writer.close()
        finally:
            await receiver.close()

    asyncio.run(run())
