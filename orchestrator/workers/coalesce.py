"""Coalescing a token stream: at most one chunk per flush window, so one message carries
many tokens.

Every token a worker streams costs the orchestrator a gRPC read, a journal write and a
relay to the client, whatever the chunk holds: the messages, not the tokens, are what cost.
`coalesced` merges the chunks a host yields (`merge`) so that a stream sends at most one
message per ``window_s``:

- a chunk is sent at once when the previous one went out at least ``window_s`` ago; the
  first chunk always, and alone (time to first token is never delayed, and the first chunk
  of a decode stream — the token the prefill sampled — keeps its own shape: the
  orchestrator completes its log-probability from the prefill's answer);
- otherwise it waits until ``window_s`` after the previous send, and everything the host
  yielded meanwhile goes out with it, in one chunk;
- the stream's end (a chunk with a finish reason, or the host's end or error) is never
  held back: it cuts the window short and goes out at once, merged with what is pending
  (a non-streamed answer, read only at its end, is not delayed by its window).

With ``aligned`` (the streams of one `DecodeMany` call, `workers.mux`) the windows are
slots of the loop's clock (multiples of ``window_s``): a chunk waits for the start of the
slot after the previous send's, so every stream with the same window sends at the same
instants and one batch carries them all. Still at most one chunk per slot and a token waits
at most ``window_s``; the first chunk and the end still go at once.

So a token waits at most ``window_s`` and the stream's indices stay contiguous: a merged
chunk starts at the first merged chunk's index and carries every token after it in order.
The window is the caller's (the orchestrator asks for it per request, ``flush_ms`` in
`DecodeRequest`/`AggregatedRequest`), capped by `MAX_FLUSH_S`; 0 sends every chunk as it
comes.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator

from orchestrator.aio import cancel_and_wait
from orchestrator.api import worker_pb2
from orchestrator.core.spec import MAX_CHUNK_WINDOW_MS

MAX_FLUSH_S = MAX_CHUNK_WINDOW_MS / 1000
"""The longest a worker holds a token back, whatever a request asks (`MAX_CHUNK_WINDOW_MS`)."""

_End = BaseException | None
"""The pump's last item: the host's error, or None when its stream ended."""


def merge(into: worker_pb2.TokenChunk, later: worker_pb2.TokenChunk) -> None:
    """Append ``later`` (the next chunk of the same stream) to ``into``; its tokens' text
    ends move by ``into``'s text (dropped when either chunk lacks them)."""
    if len(into.text_ends) == len(into.token_ids) and len(later.text_ends) == len(later.token_ids):
        base = len(into.text)
        into.text_ends.extend(base + end for end in later.text_ends)
    else:
        del into.text_ends[:]
    into.token_ids.extend(later.token_ids)
    into.text += later.text
    into.compute_ms += later.compute_ms
    into.logprobs.extend(later.logprobs)
    into.prompt_logprobs.extend(later.prompt_logprobs)
    if later.finish_reason:
        into.finish_reason = later.finish_reason


def window_of(flush_ms: float) -> float:
    """The window, in seconds, a request's ``flush_ms`` asks for (bounded)."""
    return min(max(flush_ms, 0.0) / 1000, MAX_FLUSH_S)


class _Source:
    """The host's chunks, pumped into a queue by a task of their own (``pdorch-stream-
    coalesce``), and a wait that the stream's end cuts short."""

    def __init__(self, chunks: AsyncIterator[worker_pb2.TokenChunk]) -> None:
        self.queue: asyncio.Queue[worker_pb2.TokenChunk | _End] = asyncio.Queue()
        self.ending = False
        """The stream's end (a finish chunk, the host's end or error) is queued."""
        self._wake: asyncio.Future[None] | None = None
        self.task = asyncio.create_task(self._pump(chunks), name="pdorch-stream-coalesce")

    async def _pump(self, chunks: AsyncIterator[worker_pb2.TokenChunk]) -> None:
        end: _End = None
        try:
            async for chunk in chunks:
                self.queue.put_nowait(chunk)
                if chunk.finish_reason:
                    self._ended()
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            end = exc
        self.queue.put_nowait(end)
        self._ended()

    def _ended(self) -> None:
        self.ending = True
        self._stop_waiting()

    def _stop_waiting(self) -> None:
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    async def wait(self, seconds: float) -> None:
        """Wait ``seconds``, or less: not at all once the stream's end is queued."""
        if seconds <= 0 or self.ending:
            return
        loop = asyncio.get_running_loop()
        self._wake = loop.create_future()
        timer = loop.call_later(seconds, self._stop_waiting)
        try:
            await self._wake
        finally:
            timer.cancel()
            self._wake = None


SLOT_SLACK_S = 1e-4
"""A send this close before a slot's start counts as in that slot (a timer may fire a
little early, and ``k * window`` in floating point may fall just short of slot ``k``)."""


def due(last: float, window_s: float, aligned: bool) -> float:
    """When the chunk after one sent at ``last`` goes out: a window later, or (``aligned``)
    at the start of the next slot of the clock."""
    if not aligned:
        return last + window_s
    return (math.floor((last + SLOT_SLACK_S) / window_s) + 1) * window_s


async def coalesced(
    chunks: AsyncIterator[worker_pb2.TokenChunk], window_s: float, *, aligned: bool = False
) -> AsyncIterator[worker_pb2.TokenChunk]:
    """``chunks``, at most one per ``window_s`` (see the module's docstring)."""
    if window_s <= 0:
        async for chunk in chunks:
            yield chunk
        return
    loop = asyncio.get_running_loop()
    source = _Source(chunks)
    queue = source.queue
    last: float | None = None
    """When the previous chunk went out (None: none yet)."""
    try:
        while True:
            item = await queue.get()
            if not isinstance(item, worker_pb2.TokenChunk):
                if item is not None:
                    raise item
                return
            if not item.finish_reason and last is not None:
                # The window: what comes meanwhile joins; the stream's end cuts it short.
                await source.wait(due(last, window_s, aligned) - loop.time())
            ended, end = False, None
            while last is not None and not item.finish_reason and not queue.empty():
                more = queue.get_nowait()
                if not isinstance(more, worker_pb2.TokenChunk):
                    ended, end = True, more
                    break
                merge(item, more)
            yield item
            last = loop.time()
            if end is not None:
                raise end
            if ended or item.finish_reason:
                return
    finally:
        await cancel_and_wait(source.task)
