"""Recycled receive buffers.

A fresh 64 MiB numpy array is fresh pages: every first touch is a page fault, and when UCX
writes into it from another process (CMA) that cost dominates — 1.5 GB/s into new buffers
against 6 GB/s into reused ones, measured here. Receivers therefore take payload buffers from
this pool, and a consumer that is done with a `KvCache` calls ``release()`` to return its
buffer. A cache never released is simply garbage-collected; the pool only loses a reuse.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator

import numpy as np

_MIN_POOLED = 256 << 10
"""Buffers up to this are not pooled: malloc serves them from its heap, pages already in
(a 128 or 256 KiB eager transfer measured the same either way, tcp). Larger ones came
back as fresh pages (mmap, or a heap trimmed on free): a 1 MiB eager transfer took
1.6–1.8 ms with its buffers allocated per transfer, 0.83–0.86 ms pooled."""


def size_class(nbytes: int, min_pooled: int = _MIN_POOLED) -> int:
    """Round up to 1/8 of the enclosing power of two: at most 12.5 % slack per buffer."""
    if nbytes <= min_pooled:
        return nbytes
    step = 1 << max(16, nbytes.bit_length() - 4)
    return -(-nbytes // step) * step


class BufferPool:
    def __init__(self, max_idle_bytes: int, min_pooled: int = _MIN_POOLED) -> None:
        self._max_idle = max_idle_bytes
        self._min = min_pooled
        """Buffers up to this size are allocated each time, not pooled."""
        self._idle: dict[int, list[np.ndarray]] = {}
        self._idle_bytes = 0
        self._lock = threading.Lock()  # release() may come from any thread
        self.fresh = 0
        """Buffers of a pooled size allocated because none idle fit (each one's first
        touch faults its pages in)."""

    @property
    def idle_bytes(self) -> int:
        return self._idle_bytes

    def acquire(self, nbytes: int) -> np.ndarray:
        """A uint8 array of exactly ``nbytes`` (its contents are garbage)."""
        if nbytes <= self._min:
            return np.empty(nbytes, dtype=np.uint8)
        cap = size_class(nbytes, self._min)
        with self._lock:
            free = self._idle.get(cap)
            if free:
                self._idle_bytes -= cap
                return free.pop()[:nbytes]
            self.fresh += 1
        return np.empty(cap, dtype=np.uint8)[:nbytes]

    def release(self, buf: np.ndarray) -> None:
        """Return a buffer from `acquire` (drop every view of it first)."""
        base = buf.base if isinstance(buf.base, np.ndarray) else buf
        cap = base.nbytes
        if cap <= self._min or size_class(cap, self._min) != cap:
            return
        with self._lock:
            if self._idle_bytes + cap > self._max_idle:
                return
            self._idle.setdefault(cap, []).append(base)
            self._idle_bytes += cap

    def clear(self) -> None:
        with self._lock:
            self._idle.clear()
            self._idle_bytes = 0


class Bodies:
    """Where a receiver's links read large message bodies in place (`link.read_message`:
    an eager KV's OPEN): buffers from the receiver's pool, at most ``max_bytes`` of them
    being read at once. A body's buffer is taken when its message's head arrives, before
    its bytes — or the KV header inside — can be checked, so without a bound peers that
    send heads and stall would hold connections × `control.MAX_BODY`. Past the bound a
    read waits for room (its link is not read meanwhile: TCP pushes back on its sender),
    within its caller's deadline; a body alone always fits. One event loop's."""

    def __init__(self, pool: BufferPool, max_bytes: int) -> None:
        self.pool = pool
        self.max_bytes = max_bytes
        self.reading = 0
        """Bytes of the bodies being read now."""
        self._room: list[asyncio.Future[None]] = []

    @contextlib.asynccontextmanager
    async def read(self, nbytes: int) -> AsyncIterator[np.ndarray]:
        """A buffer of ``nbytes`` to read a body into, counted until the block ends (the
        buffer itself is the caller's: it gives it back to `pool` once done with it)."""
        while self.reading and self.reading + nbytes > self.max_bytes:
            room = asyncio.get_running_loop().create_future()
            self._room.append(room)
            try:
                await room
            finally:
                if room in self._room:  # cancelled (its deadline): no longer waiting
                    self._room.remove(room)
        self.reading += nbytes
        try:
            yield self.pool.acquire(nbytes)
        finally:
            self.reading -= nbytes
            waiting, self._room = self._room, []
            for room in waiting:  # each looks again; those that still do not fit wait on
                if not room.done():
                    room.set_result(None)
