"""BufferPool: receive buffers larger than 256 KiB are recycled (a fresh one faults its
pages in), within their size class, up to the pool's idle bound."""

from __future__ import annotations

import numpy as np

from transport.buffers import BufferPool, size_class

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
