"""A loopback TCP fault proxy: delay, bandwidth limit, dropped connections, corrupted bytes.

One proxy listens in front of one real address (a worker's gRPC port, a decode worker's TCP
KV port, an orchestrator) and forwards both directions chunk by chunk. Faults are switched
at run time by the chaos runner:

- ``delay_s``: every chunk is held until ``delay_s`` after it was read (order kept);
- ``bytes_per_s``: each direction of each connection is paced to this rate;
- ``corrupt_p``: each chunk has one byte flipped with this probability (seeded);
- `drop`: every open connection is aborted (RST), as a middlebox reset would.

Memory is bounded: a direction queues at most ``max_queued`` chunks before it stops reading.
The target can move (`retarget`) when the process behind it restarts on another port, so the
advertised address stays the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from dataclasses import dataclass

log = logging.getLogger(__name__)

_CHUNK = 64 << 10
_UPSTREAM_CONNECT_S = 10.0
"""How long a proxied connection waits for its target's. A target that is down refuses at
once and a stopped one is still connected by its kernel, so only the proxy's own loop held
back on a loaded machine takes long — 2 s failed one fault-free reference run's link (one
needless failover): the wait must not be what injects a fault."""


@dataclass(slots=True)
class LinkFaults:
    delay_s: float = 0.0
    bytes_per_s: float = 0.0
    """0: unlimited."""
    corrupt_p: float = 0.0

    def clear(self) -> None:
        self.delay_s = self.bytes_per_s = self.corrupt_p = 0.0


class FaultProxy:
    def __init__(self, name: str, target: str, *, seed: int = 0, max_queued: int = 64) -> None:
        self.name = name
        self.target = target
        self.faults = LinkFaults()
        self.address = ""
        self.corrupted = 0
        self.dropped = 0
        self._rng = random.Random(seed)  # noqa: S311 - reproducible faults, not secrets
        self._max_queued = max_queued
        self._server: asyncio.Server | None = None
        self._conns: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._connecting: set[asyncio.StreamWriter] = set()
        """Client sides whose connection to the target is being made."""

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        self._server = await asyncio.start_server(self._accept, host, port)
        bound = self._server.sockets[0].getsockname()
        self.address = f"{host}:{bound[1]}"
        return self.address

    def retarget(self, target: str) -> None:
        self.target = target

    def drop(self) -> int:
        """Abort every open connection (both sides see a reset), those still connecting to
        the target included. Returns how many."""
        writers = list(self._writers)
        connecting = list(self._connecting)
        for w in writers + connecting:
            w.transport.abort()
        dropped = len(writers) // 2 + len(connecting)
        self.dropped += dropped
        return dropped

    async def close(self) -> None:
        """Stop listening and reset every connection; handlers end on their own (aborted
        sockets read as EOF), the stragglers are cancelled after a grace period."""
        if self._server is not None:
            self._server.close()
        self.drop()
        if self._conns:
            _, late = await asyncio.wait(list(self._conns), timeout=3.0)
            for task in late:
                task.cancel()
            for task in late:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    # ------------------------------------------------------------------------ forwarding

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        host, _, port = self.target.rpartition(":")
        try:
            self._connecting.add(writer)
            try:
                up_reader, up_writer = await asyncio.wait_for(
                    asyncio.open_connection(host, int(port)), timeout=_UPSTREAM_CONNECT_S
                )
            except (OSError, TimeoutError):
                writer.transport.abort()  # the target is down: so is the link
                return
            finally:
                self._connecting.discard(writer)
            if writer.transport.is_closing():  # dropped while it connected
                up_writer.transport.abort()
                return
            self._writers.update((writer, up_writer))
            try:
                async with asyncio.TaskGroup() as group:
                    group.create_task(self._pump(reader, up_writer), name=f"{self.name}-up")
                    group.create_task(self._pump(up_reader, writer), name=f"{self.name}-down")
            except* (OSError, asyncio.IncompleteReadError):
                pass  # a side went away: the other is closed below
            finally:
                self._writers.difference_update((writer, up_writer))
                for w in (writer, up_writer):
                    w.transport.abort()
        finally:
            self._conns.discard(task)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue(self._max_queued)

        async def read() -> None:
            while data := await reader.read(_CHUNK):
                await queue.put((loop.time() + self.faults.delay_s, self._maybe_corrupt(data)))
            await queue.put(None)

        async def write() -> None:
            while (item := await queue.get()) is not None:
                release, data = item
                if (wait := release - loop.time()) > 0:
                    await asyncio.sleep(wait)  # the link's latency
                if (rate := self.faults.bytes_per_s) > 0:
                    await asyncio.sleep(len(data) / rate)  # the link's bandwidth
                writer.write(data)
                await writer.drain()
            if writer.can_write_eof():
                writer.write_eof()

        async with asyncio.TaskGroup() as group:
            group.create_task(read(), name=f"{self.name}-read")
            group.create_task(write(), name=f"{self.name}-write")

    def _maybe_corrupt(self, data: bytes) -> bytes:
        p = self.faults.corrupt_p
        if p <= 0 or self._rng.random() >= p:
            return data
        flipped = bytearray(data)
        flipped[self._rng.randrange(len(flipped))] ^= 0xFF
        self.corrupted += 1
        return bytes(flipped)
