"""A prefill and a decode worker on different ``--transport`` backends: every pairing either
moves the KV intact (a UCX receiver takes a ``ucx`` or a ``ucx-read`` sender) or fails the
transfer at once with a transport error — never a hang, and nothing adopted
(`transport.backend_names.receiver_takes` is the table; this checks it against the real
backends, for the 4 KiB KV of a short prompt and a 16 MiB one)."""

from __future__ import annotations

import asyncio
import time

import pytest

from transport import errors, testing
from transport.backend_names import BACKENDS, receiver_takes
from transport.backends import make_receiver, make_sender
from transport.base import TransportSettings
from transport.ucx import ucx_available

pytestmark = [pytest.mark.ucx, pytest.mark.skipif(not ucx_available(), reason="no ucxx")]

PAIRS = [(s, r) for s in BACKENDS for r in BACKENDS]
FAIL_WITHIN_S = 2.0
"""A refused pairing fails in milliseconds on loopback (measured: < 10 ms); the bound is
far below the transfer's idle deadline (5 s), which a hang would run into."""


@pytest.mark.parametrize(("sender", "receiver"), PAIRS, ids=[f"{s}->{r}" for s, r in PAIRS])
def test_a_pairing_moves_the_kv_or_fails_at_once(sender: str, receiver: str) -> None:
    async def run() -> None:
        settings = TransportSettings()
        rx = make_receiver(receiver, settings)
        address = await rx.start()
        tx = make_sender(sender, settings)
        try:
            for epoch, size in enumerate((4 * testing.KIB, 16 * testing.MIB), start=1):
                cache = testing.synthetic_cache("pair", epoch, size, n_layers=8, seed=epoch)
                started = time.monotonic()
                if receiver_takes(receiver, sender):
                    await asyncio.wait_for(tx.send(address, cache), 30)
                    got = await rx.take("pair", epoch, 5)
                    assert testing.digest(got) == testing.digest(cache)
                    continue
                with pytest.raises(errors.TransportError) as refused:
                    await asyncio.wait_for(tx.send(address, cache), 30)
                if sender == "ucx" and receiver == "tcp":  # says why, not UCX's own words
                    assert "no UCX data plane" in str(refused.value)
                assert time.monotonic() - started < FAIL_WITHIN_S
                assert rx.inbox.bytes_in_use == 0  # nothing held for the refused transfer
        finally:
            await tx.close()
            await rx.close()

    asyncio.run(run())
