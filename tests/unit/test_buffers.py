"""BufferPool: receive buffers larger than 256 KiB are recycled (a fresh one faults its
pages in), within their size class, up to the pool's idle bound. Bodies: eager OPENs'
bodies being read at once are bounded; a read past the bound waits for room."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from transport.buffers import Bodies, BufferPool, size_class

KIB = 1 << 10
MIB = 1 << 20


def test_size_classes_leave_at_most_an_eighth_of_the_enclosing_power_of_two() -> None:
    assert size_class(256 * KIB) == 256 * KIB  # not pooled: exactly what was asked
    for n in (256 * KIB + 1, 1 * MIB, 1 * MIB + 5000, 3 * MIB + 1, 64 * MIB - 7):
        cap = size_class(n)
        assert n <= cap < n + (1 << n.bit_length()) // 8
        assert size_class(cap) == cap  # a class is its own class


def test_buffers_past_256_kib_are_reused_and_small_ones_are_not_pooled() -> None:
    pool = BufferPool(64 * MIB)
    small = pool.acquire(256 * KIB)
    pool.release(small)
    assert pool.idle_bytes == 0  # malloc's heap serves these warm
    assert pool.fresh == 0

    first = pool.acquire(1 * MIB)
    assert first.nbytes == 1 * MIB
    assert first.dtype == np.uint8
    assert pool.fresh == 1
    pool.release(first)
    assert pool.idle_bytes == size_class(1 * MIB)
    # Another size in the same class gets the same memory, trimmed to what was asked.
    again = pool.acquire(1 * MIB - 100)
    assert again.nbytes == 1 * MIB - 100
    assert np.shares_memory(again, first)
    assert pool.fresh == 1
    assert pool.idle_bytes == 0
    # While it is out, the next one is fresh.
    other = pool.acquire(1 * MIB)
    assert not np.shares_memory(other, again)
    assert pool.fresh == 2


def test_the_idle_bound_and_foreign_buffers() -> None:
    pool = BufferPool(3 * MIB - 1)
    a, b, c = (pool.acquire(1 * MIB) for _ in range(3))
    for buf in (a, b, c):
        pool.release(buf)
    assert pool.idle_bytes == 2 * size_class(1 * MIB)  # the third would pass the bound
    pool.release(np.empty(1 * MIB + 3, dtype=np.uint8))  # not a class: not kept
    assert pool.idle_bytes == 2 * size_class(1 * MIB)
    pool.clear()
    assert pool.idle_bytes == 0


def test_bodies_being_read_are_bounded_and_a_waiting_read_goes_once_there_is_room() -> None:
    """Two 1 MiB bodies fit a 2.5 MiB bound; the third waits until one is read, then
    gets its buffer; a body larger than the bound is read when it is alone."""

    async def main() -> None:
        bodies = Bodies(BufferPool(64 * MIB), int(2.5 * MIB))
        first, second = bodies.read(MIB), bodies.read(MIB)
        await first.__aenter__()
        await second.__aenter__()
        assert bodies.reading == 2 * MIB
        third = asyncio.ensure_future(_hold(bodies, MIB, asyncio.Event(), wait=False))
        await asyncio.sleep(0.01)
        assert not third.done()  # waiting for room: no buffer taken
        assert bodies.reading == 2 * MIB
        await first.__aexit__(None, None, None)
        assert await asyncio.wait_for(third, 1) == MIB  # it went, and ended
        await second.__aexit__(None, None, None)
        assert bodies.reading == 0
        assert await _hold(bodies, 4 * MIB, asyncio.Event(), wait=False) == 4 * MIB  # alone

    asyncio.run(main())


def test_a_read_cancelled_while_waiting_takes_nothing_and_leaves_room_for_others() -> None:
    async def main() -> None:
        bodies = Bodies(BufferPool(64 * MIB), MIB)
        release = asyncio.Event()
        holder = asyncio.ensure_future(_hold(bodies, MIB, release))
        await asyncio.sleep(0.01)
        waiter = asyncio.ensure_future(_hold(bodies, MIB, asyncio.Event(), wait=False))
        await asyncio.sleep(0.01)
        waiter.cancel()  # its deadline passed while it waited
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert bodies.reading == MIB  # the holder's alone
        release.set()
        await holder
        assert bodies.reading == 0
        assert await _hold(bodies, MIB, asyncio.Event(), wait=False) == MIB

    asyncio.run(main())


async def _hold(bodies: Bodies, nbytes: int, release: asyncio.Event, *, wait: bool = True) -> int:
    """Read a body of ``nbytes`` (take its buffer), until ``release`` when ``wait``."""
    async with bodies.read(nbytes) as buffer:
        if wait:
            await release.wait()
        return int(buffer.nbytes)
