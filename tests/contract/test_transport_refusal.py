"""A receiver that refuses a transfer mid-payload is heard: the sender gets the refusal.

The receiver used to reset the connection right after its ERROR, with the sender's later layers
unread; the sender's next write then failed with EPIPE and it reported "peer lost" instead of
the reason (CI caught it under load: nonfinite-tcp). The receiver now lingers (half-close,
discard, bounded) so the ERROR is read.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from transport import errors
from transport.backends import make_receiver, make_sender
from transport.base import TransportSettings
from transport.testing import MIB, synthetic_cache


async def _refused_early(rounds: int) -> None:
    settings = TransportSettings(check_finite=True)
    receiver = make_receiver("tcp", settings)
    address = await receiver.start()
    sender = make_sender("tcp", settings)
    try:
        for n in range(rounds):
            # A NaN in layer 0 of a 64 MiB KV in small layers (each write drains at once):
            # the refusal comes while most layers are still unsent.
            cache = synthetic_cache(f"early-{n}", 1, 64 * MIB, n_layers=512, seed=n)
            cache.layers[0][0].reshape(-1)[7] = np.nan
            with pytest.raises(errors.WireFormatError, match="NaN"):
                await sender.send(address, cache)
            assert receiver.inbox.bytes_in_use == 0
    finally:
        await sender.close()
        await receiver.close()


def test_refusal_mid_payload_reaches_the_sender() -> None:
    asyncio.run(_refused_early(12))
