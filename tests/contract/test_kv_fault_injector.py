"""The KV fault injector's link faults on real transfers, for each backend (issue 18 item 6:
over UCX, where no proxy can sit, ``bandwidth`` and ``drop`` used to be accepted and do
nothing, and ``delay`` held layer 1 only)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import pytest

from transport import errors
from transport.backends import make_receiver, make_sender
from transport.base import TransportSettings
from transport.control import EAGER_BYTES
from transport.receiver import KvReceiver
from transport.sender import KvSender
from transport.testing import KIB, MIB, FaultInjector, digest, synthetic_cache
from transport.ucx import ucx_available

BACKENDS = [
    "tcp",
    pytest.param(
        "ucx",
        marks=[
            pytest.mark.ucx,
            pytest.mark.skipif(not ucx_available(), reason="ucxx is not installed"),
        ],
    ),
]


Pair = tuple[KvSender, KvReceiver, str]


def _run(backend: str, body: Callable[[Pair], Awaitable[None]]) -> None:
    """``body(sender, receiver, address)`` on a fresh pair of this backend, in one loop."""

    async def main() -> None:
        settings = TransportSettings()
        receiver = make_receiver(backend, settings)
        address = await receiver.start()
        sender = make_sender(backend, settings)
        try:
            await body((sender, receiver, address))
        finally:
            await sender.close()
            await receiver.close()

    asyncio.run(main())


async def _timed_send(sender: KvSender, receiver: KvReceiver, address: str, rid: str) -> float:
    cache = synthetic_cache(rid, 1, 1 * MIB, n_layers=4)
    started = time.monotonic()
    await sender.send(address, cache)
    elapsed = time.monotonic() - started
    assert digest(await receiver.take(rid, 1, 5)) == digest(cache)
    return elapsed


@pytest.mark.parametrize("backend", BACKENDS)
def test_bandwidth_and_delay_slow_every_layer(backend: str) -> None:
    _run(backend, _bandwidth_and_delay_slow_every_layer)


async def _bandwidth_and_delay_slow_every_layer(pair: Pair) -> None:
    sender, receiver, address = pair
    injector = FaultInjector.parse("bw=4194304")  # 4 MiB/s: 1 MiB takes 0.25 s
    injector.attach(sender)
    assert await _timed_send(sender, receiver, address, "bw") >= 0.24
    injector.configure(FaultInjector.parse("lag=0.1"))  # 0.1 s for each of 4 layers
    assert await _timed_send(sender, receiver, address, "lag") >= 0.39
    injector.armed = False
    assert await _timed_send(sender, receiver, address, "clear") < 0.39


@pytest.mark.parametrize("backend", BACKENDS)
def test_drop_fails_transfers_until_healed(backend: str) -> None:
    _run(backend, _drop_fails_transfers_until_healed)


async def _drop_fails_transfers_until_healed(pair: Pair) -> None:
    sender, receiver, address = pair
    injector = FaultInjector.parse("drop=1")
    injector.attach(sender)
    with pytest.raises(errors.PeerLostError, match="link is down"):
        await sender.send(address, synthetic_cache("dropped", 1, 1 * MIB))
    with pytest.raises(errors.TransportError):
        await receiver.take("dropped", 1, timeout_s=1)
    assert receiver.inbox.bytes_in_use == 0  # the sender's abort freed what it reserved
    injector.armed = False  # healed: the next transfer goes through
    await _timed_send(sender, receiver, address, "after")


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_gate_holds_a_layer_and_announces_it(backend: str) -> None:
    _run(backend, _the_gate_holds_a_layer_and_announces_it)


async def _the_gate_holds_a_layer_and_announces_it(pair: Pair) -> None:
    sender, receiver, address = pair
    held: list[tuple[int, float]] = []
    injector = FaultInjector.parse("hold_layer=2,hold=0.3")
    injector.on_hold = lambda index: held.append((index, time.monotonic()))
    injector.attach(sender)
    assert await _timed_send(sender, receiver, address, "gated") >= 0.29
    assert [index for index, _ in held] == [2]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_small_kv_under_a_gate_is_in_flight_when_held(backend: str) -> None:
    # A KV small enough to go eager (one message) goes layer by layer while a timing fault
    # is on, so phase-triggered chaos ("sending") still hits a transfer whose header the
    # receiver accepted (memory reserved) and whose later layers are not sent yet.
    _run(backend, _a_small_kv_under_a_gate_is_in_flight_when_held)


async def _a_small_kv_under_a_gate_is_in_flight_when_held(pair: Pair) -> None:
    sender, receiver, address = pair
    reserved: list[int] = []
    injector = FaultInjector.parse("hold_layer=1,hold=0.2")
    injector.on_hold = lambda _index: reserved.append(receiver.inbox.bytes_in_use)
    injector.attach(sender)
    cache = synthetic_cache("small", 1, 8 * KIB, n_layers=4)
    assert cache.header.payload_bytes <= EAGER_BYTES
    await sender.send(address, cache)
    assert digest(await receiver.take("small", 1, 5)) == digest(cache)
    assert len(reserved) == 1
    assert reserved[0] >= cache.header.payload_bytes
