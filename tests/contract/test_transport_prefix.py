"""Suffix-only transfers at the receiver (wire version 3, issue 20 item 3): a receiver that
does not hold the named prefix refuses before any payload moves and before the epoch is
fenced, with a `PrefixMissingError` the sender reads; the whole KV at the same epoch is then
taken. One it holds is taken with its prefix named."""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import replace

import pytest

from transport import errors
from transport.backends import make_receiver, make_sender
from transport.base import TransportSettings
from transport.testing import MIB, synthetic_cache

DIGEST = hashlib.sha256(b"held prefix").digest()


async def _exchange(backend: str) -> None:
    receiver = make_receiver(backend, TransportSettings())
    address = await receiver.start()
    sender = make_sender(backend, TransportSettings())
    asked: list[tuple[int, bytes]] = []
    try:
        whole = synthetic_cache("rid-1", 2, MIB, n_layers=4, seed=1)
        suffix = replace(whole, header=replace(whole.header, prefix_tokens=32, prefix_hash=DIGEST))
        with pytest.raises(errors.PrefixMissingError, match="prefix this KV extends is not held"):
            await sender.send(address, suffix)  # no check installed: it holds no prefix

        def holds(tokens: int, digest: bytes) -> bool:
            asked.append((tokens, digest))
            return digest == DIGEST and tokens == 16

        receiver.prefix_check = holds
        with pytest.raises(errors.PrefixMissingError):
            await sender.send(address, suffix)  # 32 tokens: not what it holds
        assert asked == [(32, DIGEST)]
        assert receiver.inbox.bytes_in_use == 0
        await sender.send(address, whole)  # the same epoch, whole: taken
        got = await receiver.take("rid-1", 2, 5.0)
        assert got.header.prefix_tokens == 0
        got.release()

        held = synthetic_cache("rid-2", 1, MIB, n_layers=4, seed=2)
        held = replace(held, header=replace(held.header, prefix_tokens=16, prefix_hash=DIGEST))
        await sender.send(address, held)
        got = await receiver.take("rid-2", 1, 5.0)
        assert (got.header.prefix_tokens, got.header.prefix_hash) == (16, DIGEST)
        got.release()
    finally:
        await sender.close()
        await receiver.close()


def test_a_prefix_the_receiver_lacks_is_refused_and_the_whole_kv_then_taken() -> None:
    asyncio.run(_exchange("tcp"))
