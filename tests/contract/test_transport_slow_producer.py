"""A KV sent layer by layer while it is computed (vLLM's connector pushes each layer as the
forward saves it) whose layers come slower, in all, than the receiver's idle deadline: each
*segment* must reach the receiver within that deadline, or it takes the silent link for a
dead peer. With one layer per segment (what the vLLM connector sets on both UCX backends)
the transfer lands whatever the forward's length; with segments of many layers the first
one is announced only once they all exist, and the receiver gives up first (measured with
a vLLM engine under load: every 1024-token push over ``ucx`` failed, 32 MiB segments)."""

from __future__ import annotations

import asyncio

import pytest

from transport import control, errors, testing
from transport.backends import make_receiver, make_sender
from transport.base import TransportSettings
from transport.ucx import ucx_available

pytestmark = [pytest.mark.ucx, pytest.mark.skipif(not ucx_available(), reason="no ucxx")]

IDLE_S = 0.6
LAYERS = 8
LAYER_GAP_S = 0.15
"""8 layers a 0.15 s apart: 1.2 s in all, twice the receiver's idle deadline."""


async def _push(backend: str, segment_bytes: int) -> None:
    rx = make_receiver(backend, TransportSettings(idle_timeout_s=IDLE_S))
    address = await rx.start()
    tx = make_sender(backend, TransportSettings(segment_bytes=segment_bytes))
    cache = testing.synthetic_cache("slow", 1, LAYERS * testing.MIB, n_layers=LAYERS, seed=3)
    try:
        transfer = await tx.open(address, cache.header)
        async with transfer:
            for i, (k, v) in enumerate(cache.layers):
                await asyncio.sleep(LAYER_GAP_S)  # the forward computing the next layer
                await transfer.send_layer(i, k, v)
            await transfer.finish()
        got = await rx.take("slow", 1, 5)
        assert testing.digest(got) == testing.digest(cache)
    finally:
        await tx.close()
        await rx.close()


@pytest.mark.parametrize("backend", ["ucx", "ucx-read"])
def test_a_segment_per_layer_outlasts_the_idle_deadline(backend: str) -> None:
    asyncio.run(_push(backend, control.MIN_SEGMENT_BYTES))


@pytest.mark.parametrize("backend", ["ucx", "ucx-read"])
def test_one_segment_of_every_layer_is_given_up_on(backend: str) -> None:
    """Why the connector sets a segment per layer: the same push in one segment fails."""
    with pytest.raises(errors.TransportError):
        asyncio.run(_push(backend, 32 * testing.MIB))
