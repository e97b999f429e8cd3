"""The receiver's memory budget on every backend, with a real sender and receiver: a KV that
would take the receiver past `TransportSettings.memory_budget_bytes` is refused before a
byte of it is taken (`BudgetExceededError` on the sender: retryable, elsewhere or later),
whatever its path — inline in its OPEN, sent layer by layer, or read one-sided from the
sender's memory — and the room comes back when a held KV is released."""

from __future__ import annotations

import asyncio

import pytest

from transport import errors, testing
from transport.backends import UCX_READ, make_receiver, make_sender
from transport.base import TransportSettings
from transport.ucx import ucx_available

_UCX = [pytest.mark.ucx, pytest.mark.skipif(not ucx_available(), reason="ucxx not installed")]
BUDGET = 1 << 20
PATHS = [  # (backend, KV size): each backend's paths to the receiver's memory
    pytest.param("tcp", 768 * testing.KIB, id="tcp-inline"),
    pytest.param("ucx", 768 * testing.KIB, marks=_UCX, id="ucx-inline"),
    pytest.param(UCX_READ, 768 * testing.KIB, marks=_UCX, id="ucx-read-one-sided"),
]


async def _budgeted(backend: str, size: int) -> None:
    settings = TransportSettings(memory_budget_bytes=BUDGET)
    receiver = make_receiver(backend, settings)
    address = await receiver.start()
    sender = make_sender(backend, settings)
    try:
        await sender.send(address, testing.synthetic_cache("a", 1, size, n_layers=4))
        held = receiver.inbox.bytes_in_use
        assert 0 < held <= BUDGET
        with pytest.raises(errors.BudgetExceededError) as refused:  # the first still held
            await sender.send(address, testing.synthetic_cache("b", 1, size, n_layers=4))
        assert "no room" in str(refused.value)
        assert receiver.inbox.bytes_in_use == held  # nothing of it taken
        with pytest.raises(errors.BudgetExceededError):  # larger than the whole budget
            await sender.send(address, testing.synthetic_cache("c", 1, 2 * BUDGET, n_layers=4))
        (await receiver.take("a", 1, timeout_s=5)).release()
        assert receiver.inbox.bytes_in_use == 0
        retry = testing.synthetic_cache("b", 1, size, n_layers=4)
        await sender.send(address, retry)  # the room is back
        got = await receiver.take("b", 1, timeout_s=5)
        assert testing.digest(got) == testing.digest(retry)
        got.release()
    finally:
        await sender.close()
        await receiver.close()


@pytest.mark.parametrize(("backend", "size"), PATHS)
def test_a_kv_past_the_receivers_budget_is_refused_until_room_comes_back(
    backend: str, size: int
) -> None:
    asyncio.run(_budgeted(backend, size))


@pytest.mark.parametrize("backend", ["tcp", pytest.param("ucx", marks=_UCX)])
def test_a_layered_kv_past_the_budget_is_refused_at_its_open(backend: str) -> None:
    """Past the eager bound the KV goes layer by layer; its OPEN is refused all the same."""
    settings = TransportSettings(memory_budget_bytes=BUDGET)

    async def body() -> None:
        receiver = make_receiver(backend, settings)
        address = await receiver.start()
        sender = make_sender(backend, settings)
        cache = testing.synthetic_cache("l", 1, 8 * BUDGET, n_layers=4)  # past 4 MiB
        try:
            with pytest.raises(errors.BudgetExceededError):
                await sender.send(address, cache)
            assert receiver.inbox.bytes_in_use == 0
        finally:
            await sender.close()
            await receiver.close()

    asyncio.run(body())
