"""A KV sent layer by layer while it is computed (vLLM's connector pushes each layer as the
forward saves it), its producer slower than the receiver's idle deadline.

**Segments** (out of band): each must reach the receiver within that deadline, or it takes
the silent link for a dead peer. With one layer per segment (what the vLLM connector sets on
both UCX backends) the transfer lands whatever the forward's length; with segments of many
layers the first one is announced only once they all exist, and the receiver gives up first
(measured with a vLLM engine under load: every 1024-token push over ``ucx`` failed, 32 MiB
segments).

**ALIVE** (every backend): a single layer may itself take longer than the deadline. The
sender waits for each layer through `OutgoingTransfer.hold`, which sends ALIVE every
``keepalive_s``, so the receiver keeps a live sender's transfer open however long the
forward takes (within the transfer's deadline). Without it the silent link reads as a dead
peer: the receiver gives up and the sender finds its connection closed — what a loaded CPU
vLLM prefill met in CI ("KV push … failed: connection to peer lost: it is closed", a
failover the P/D test does not expect). A receiver that dies during the wait is found by the
next ALIVE, before the producer is done."""

from __future__ import annotations

import asyncio
import time

import pytest

from transport import control, errors, testing
from transport.backends import UCX_READ, make_receiver, make_sender
from transport.base import TransportSettings
from transport.ucx import ucx_available

pytestmark = pytest.mark.timeout(60)

_UCX = [pytest.mark.ucx, pytest.mark.skipif(not ucx_available(), reason="ucxx not installed")]
UCX_BACKENDS = [pytest.param("ucx", marks=_UCX), pytest.param(UCX_READ, marks=_UCX)]
BACKENDS = [*UCX_BACKENDS, "tcp"]
IDLE_S = 0.6
"""The receiver's idle deadline."""
KEEPALIVE = TransportSettings(keepalive_s=IDLE_S / 4)


async def _push(
    backend: str,
    sender: TransportSettings,
    layers: int,
    layer_size: int,
    gap_s: float,
    held: bool,
    idle_s: float = IDLE_S,
) -> None:
    """Open, then give each layer ``gap_s`` after the one before, awaited through `hold`
    (``held``) or bare; the receiver (idle deadline ``idle_s``) must end up with the KV as
    sent."""
    rx = make_receiver(backend, TransportSettings(idle_timeout_s=idle_s))
    address = await rx.start()
    tx = make_sender(backend, sender)
    cache = testing.synthetic_cache("slow", 1, layers * layer_size, n_layers=layers, seed=3)
    try:
        async with await tx.open(address, cache.header) as transfer:
            for i, (k, v) in enumerate(cache.layers):
                computed = asyncio.sleep(gap_s)  # the forward computing the next layer
                await (transfer.hold(computed) if held else computed)
                await transfer.send_layer(i, k, v)
            await transfer.finish()
        got = await rx.take("slow", 1, 5)
        assert testing.digest(got) == testing.digest(cache)
    finally:
        await tx.close()
        await rx.close()


def _segmented(backend: str, segment_bytes: int) -> None:
    """8 layers of 1 MiB, 0.25 s apart: 2 s in all, twice a 1 s idle deadline; bare (each
    gap a quarter of the deadline: margin for a loaded machine)."""
    settings = TransportSettings(segment_bytes=segment_bytes)
    asyncio.run(_push(backend, settings, 8, testing.MIB, 0.25, held=False, idle_s=1.0))


@pytest.mark.parametrize("backend", UCX_BACKENDS)
def test_a_segment_per_layer_outlasts_the_idle_deadline(backend: str) -> None:
    _segmented(backend, control.MIN_SEGMENT_BYTES)


@pytest.mark.parametrize("backend", UCX_BACKENDS)
def test_one_segment_of_every_layer_is_given_up_on(backend: str) -> None:
    """Why the connector sets a segment per layer: the same push in one segment fails."""
    with pytest.raises(errors.TransportError):
        _segmented(backend, 32 * testing.MIB)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_held_push_outlasts_the_receivers_idle_deadline(backend: str) -> None:
    """Each of 3 layers 2× the idle deadline after the one before, through `hold`."""
    asyncio.run(_push(backend, KEEPALIVE, 3, 64 * testing.KIB, 2 * IDLE_S, held=True))


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_same_push_unheld_is_given_up_on(backend: str) -> None:
    """Why `hold` exists: the same silences, awaited bare, fail the transfer."""
    with pytest.raises(errors.TransportError):
        asyncio.run(_push(backend, KEEPALIVE, 3, 64 * testing.KIB, 2 * IDLE_S, held=False))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_receiver_gone_during_the_wait_is_found_by_the_next_alive(backend: str) -> None:
    async def run() -> None:
        rx = make_receiver(backend, TransportSettings())
        address = await rx.start()
        tx = make_sender(backend, KEEPALIVE)
        cache = testing.synthetic_cache("gone", 1, 64 * testing.KIB, n_layers=1)
        never: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        try:
            async with await tx.open(address, cache.header) as transfer:
                await rx.close()
                started = time.monotonic()
                with pytest.raises(errors.TransportError):
                    await transfer.hold(never)
                assert time.monotonic() - started < 10 * KEEPALIVE.keepalive_s
            assert never.cancelled()  # the producer's wait is not left behind
        finally:
            await tx.close()
            await rx.close()

    asyncio.run(run())
