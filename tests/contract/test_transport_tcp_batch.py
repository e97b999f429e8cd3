"""TCP, a whole KV at hand (`KvSender.send`): its frames and payloads go out batched and
are read in place, yet every layer is still checked.

`OutgoingTransfer.send_all` writes a small KV's every LAYER frame and payload in one write;
the receiver reads them in turn without a task per frame (`Link.read_next`). These tests
fail if the batching stops (a write per layer, a read task per frame) or if a layer inside
a batch escapes its checksum.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import pytest

from transport import errors, link
from transport.backends import make_receiver, make_sender
from transport.base import TransportSettings
from transport.testing import digest, synthetic_cache

_SIZE = 32 << 10
_LAYERS = 32


async def _one_write_and_verified(monkeypatch: pytest.MonkeyPatch) -> None:
    receiver = make_receiver("tcp")
    address = await receiver.start()
    sender = make_sender("tcp")
    try:
        await sender.send(address, synthetic_cache("warm", 1, _SIZE, _LAYERS))  # connects
        await receiver.take("warm", 1, 5)
        writes: list[int] = []
        reads: list[str] = []
        write = asyncio.StreamWriter.write
        create_task = asyncio.create_task

        def counting_write(self: asyncio.StreamWriter, data: Any) -> None:
            writes.append(memoryview(data).nbytes)
            write(self, data)

        def counting_task(coro: Coroutine[Any, Any, Any], **kw: Any) -> asyncio.Task[Any]:
            reads.append(str(kw.get("name", "")))
            return create_task(coro, **kw)

        monkeypatch.setattr(asyncio.StreamWriter, "write", counting_write)
        monkeypatch.setattr(link.asyncio, "create_task", counting_task)
        cache = synthetic_cache("one", 1, _SIZE, _LAYERS, seed=3)
        await sender.send(address, cache)
        got = await receiver.take("one", 1, 5)
        monkeypatch.undo()
        assert digest(got) == digest(cache)
        # Every frame and payload in one write (beyond it: OPEN, ACCEPT, DONE).
        assert max(writes) > _SIZE, writes
        assert len(writes) <= 4, writes
        # No read task per frame: the pending reads of OPEN/ACCEPT/DONE at most.
        assert reads.count("pdorch-kv-read") <= 4, reads
    finally:
        await sender.close()
        await receiver.close()


def test_a_whole_kv_goes_in_one_write_and_every_layer_is_verified(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asyncio.run(_one_write_and_verified(monkeypatch))


async def _corrupted_inside_a_batch(size: int, layer: int) -> None:
    settings = TransportSettings()
    receiver = make_receiver("tcp", settings)
    address = await receiver.start()
    sender = make_sender("tcp", settings)

    def flip(index: int, k: memoryview, v: memoryview) -> tuple[memoryview, memoryview]:
        if index != layer:
            return k, v
        bad = bytearray(v)
        bad[len(bad) // 2] ^= 0x01
        return k, memoryview(bad)

    sender.payload_hook = flip  # after the checksum: only the receiver can catch it
    try:
        with pytest.raises(errors.ChecksumMismatchError):
            await sender.send(address, synthetic_cache("bad", 1, size, _LAYERS))
        with pytest.raises(errors.ChecksumMismatchError):
            await receiver.take("bad", 1, 5)
        assert receiver.inbox.bytes_in_use == 0
        sender.payload_hook = None  # the next transfer goes through, on a fresh link
        cache = synthetic_cache("good", 1, size, _LAYERS, seed=1)
        await sender.send(address, cache)
        assert digest(await receiver.take("good", 1, 5)) == digest(cache)
    finally:
        await sender.close()
        await receiver.close()


@pytest.mark.parametrize(
    ("size", "layer"),
    [(_SIZE, 17), (16 << 20, 30)],  # one joined write; several batches, drained
    ids=["one-write", "batches"],
)
def test_a_corrupted_layer_inside_a_batched_write_is_refused(size: int, layer: int) -> None:
    asyncio.run(_corrupted_inside_a_batch(size, layer))
