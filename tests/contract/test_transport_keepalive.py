"""A layer-wise push whose producer is slower than the receiver's idle deadline: the sender
waits for each layer through `OutgoingTransfer.hold`, which sends ALIVE every
``keepalive_s``, so the receiver keeps a live sender's transfer open however long the
engine's forward takes (within the transfer's deadline). Without it the silent link reads
as a dead peer: the receiver gives up and the sender finds its connection closed — what a
loaded CPU vLLM prefill met in CI ("KV push … failed: connection to peer lost: it is
closed", a failover the P/D test does not expect). A receiver that dies during the wait is
found by the next ALIVE, before the producer is done."""

from __future__ import annotations

import asyncio
import time

import pytest

from transport import errors, testing
from transport.backends import UCX_READ, make_receiver, make_sender
from transport.base import TransportSettings
from transport.ucx import ucx_available

pytestmark = pytest.mark.timeout(60)

_UCX = [pytest.mark.ucx, pytest.mark.skipif(not ucx_available(), reason="ucxx not installed")]
BACKENDS = [pytest.param("ucx", marks=_UCX), pytest.param(UCX_READ, marks=_UCX), "tcp"]
IDLE_S = 0.4
"""The receiver's idle deadline; the producer is silent 3× as long before each layer."""
SILENT_S = 3 * IDLE_S
LAYERS = 3
RECEIVER = TransportSettings(idle_timeout_s=IDLE_S)
SENDER = TransportSettings(keepalive_s=IDLE_S / 4)


async def _layer_after(delay_s: float, index: int) -> int:
    await asyncio.sleep(delay_s)  # the forward computing layer ``index``
    return index


async def _push(backend: str, held: bool) -> None:
    """Open, then each layer after SILENT_S — awaited through `hold` or bare."""
    rx = make_receiver(backend, RECEIVER)
    address = await rx.start()
    tx = make_sender(backend, SENDER)
    cache = testing.synthetic_cache("slow", 1, LAYERS * 64 * testing.KIB, n_layers=LAYERS, seed=5)
    try:
        async with await tx.open(address, cache.header) as transfer:
            for i, (k, v) in enumerate(cache.layers):
                produced = _layer_after(SILENT_S, i)
                index = await (transfer.hold(produced) if held else produced)
                await transfer.send_layer(index, k, v)
            await transfer.finish()
        got = await rx.take("slow", 1, 5)
        assert testing.digest(got) == testing.digest(cache)
    finally:
        await tx.close()
        await rx.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_held_push_outlasts_the_receivers_idle_deadline(backend: str) -> None:
    asyncio.run(_push(backend, held=True))


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_same_push_unheld_is_given_up_on(backend: str) -> None:
    """Why `hold` exists: the same silences, awaited bare, fail the transfer."""
    with pytest.raises(errors.TransportError):
        asyncio.run(_push(backend, held=False))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_receiver_gone_during_the_wait_is_found_by_the_next_alive(backend: str) -> None:
    async def run() -> None:
        rx = make_receiver(backend, TransportSettings())
        address = await rx.start()
        tx = make_sender(backend, SENDER)
        cache = testing.synthetic_cache("gone", 1, 64 * testing.KIB, n_layers=1)
        never: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        try:
            async with await tx.open(address, cache.header) as transfer:
                await rx.close()
                started = time.monotonic()
                with pytest.raises(errors.TransportError):
                    await transfer.hold(never)
                assert time.monotonic() - started < 10 * SENDER.keepalive_s
            assert never.cancelled()  # the producer's wait is not left behind
        finally:
            await tx.close()
            await rx.close()

    asyncio.run(run())
