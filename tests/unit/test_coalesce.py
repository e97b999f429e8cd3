"""A worker's token stream coalesced to one chunk per flush window (`workers.coalesce`)."""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import pytest

from orchestrator.api import common_pb2, worker_pb2
from orchestrator.workers.coalesce import MAX_FLUSH_S, coalesced, due, merge, window_of

LIMIT_S = 5.0


def run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(asyncio.wait_for(coro, LIMIT_S))


def chunk(index: int, finish: int = 0) -> worker_pb2.TokenChunk:
    if finish:
        return worker_pb2.TokenChunk(index=index, text="!", finish_reason=finish)
    return worker_pb2.TokenChunk(
        index=index, token_ids=[index], text=f"<{index}>", compute_ms=1.0,
        logprobs=[common_pb2.TokenLogprob(token_id=index, logprob=-1.0)],
    )  # fmt: skip


async def source(n: int, gap_s: float, finish: bool = True) -> AsyncIterator[worker_pb2.TokenChunk]:
    """``n`` one-token chunks ``gap_s`` apart, then a finish chunk."""
    for i in range(n):
        if i:
            await asyncio.sleep(gap_s)
        yield chunk(i)
    if finish:
        yield chunk(n, common_pb2.FINISH_REASON_LENGTH)


def flat(chunks: list[worker_pb2.TokenChunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def test_chunks_within_a_window_go_out_merged_and_contiguous() -> None:
    async def main() -> None:
        got = [c async for c in coalesced(source(20, 0.005), 0.05)]
        assert flat(got) == list(range(20))  # every token once, in order
        at = 0
        for c in got:  # each chunk starts where the previous ended
            assert c.index == at
            at += len(c.token_ids)
        assert len(got[0].token_ids) == 1  # the first token is never held back
        assert len(got) < 8  # ~100 ms of tokens in 50 ms windows, not 20 messages
        assert got[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert "".join(c.text for c in got) == "".join(f"<{i}>" for i in range(20)) + "!"
        assert sum(c.compute_ms for c in got) == 20.0
        assert [lp.token_id for c in got for lp in c.logprobs] == list(range(20))

    run(main())


def test_no_window_passes_every_chunk_through() -> None:
    async def main() -> None:
        got = [c async for c in coalesced(source(5, 0.0), 0.0)]
        assert len(got) == 6
        assert flat(got) == list(range(5))

    run(main())


def test_a_slow_stream_is_not_delayed() -> None:
    # Tokens further apart than the window each go out as they come.
    async def main() -> None:
        got = [c async for c in coalesced(source(4, 0.03), 0.01)]
        assert [len(c.token_ids) for c in got[:4]] == [1, 1, 1, 1]

    run(main())


def test_the_hosts_error_ends_the_stream_after_what_came_before() -> None:
    async def failing() -> AsyncIterator[worker_pb2.TokenChunk]:
        yield chunk(0)
        yield chunk(1)
        raise RuntimeError("engine died")

    async def main() -> None:
        got: list[worker_pb2.TokenChunk] = []

        async def consume() -> None:
            async for c in coalesced(failing(), 0.05):
                got.append(c)

        with pytest.raises(RuntimeError, match="engine died"):
            await consume()
        assert flat(got) == [0, 1]  # delivered before the error

    run(main())


def test_closing_early_stops_the_host_stream() -> None:
    closed = asyncio.Event

    async def main() -> None:
        ended = closed()

        async def endless() -> AsyncIterator[worker_pb2.TokenChunk]:
            i = 0
            try:
                while True:
                    yield chunk(i)
                    i += 1
                    await asyncio.sleep(0.001)
            finally:
                ended.set()

        stream = coalesced(endless(), 0.01)
        async for c in stream:
            if c.index > 5:
                break
        await stream.aclose()  # what grpc does to a cancelled call's handler
        await asyncio.wait_for(ended.wait(), 1.0)

    run(main())


def test_the_window_is_bounded() -> None:
    assert window_of(-5) == 0.0
    assert window_of(20) == 0.02
    assert window_of(1e9) == MAX_FLUSH_S


def test_the_first_chunk_goes_out_alone_even_with_more_ready() -> None:
    # A decode stream's first chunk is the prefill's token: the orchestrator completes its
    # log-probability from the prefill's answer, so it is never merged with later ones.
    async def main() -> None:
        got = [c async for c in coalesced(source(6, 0.0), 0.05)]
        assert [len(c.token_ids) for c in got] == [1, 5]
        assert got[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH

    run(main())


@pytest.mark.parametrize("fails", [False, True])
def test_the_streams_end_is_not_held_back_by_the_window(fails: bool) -> None:
    """A stream that ends inside a window (its finish, or the host's error) goes out at
    once with what is pending: a non-streamed answer asks a 1 s window and must not wait
    for it after its last token."""

    async def short() -> AsyncIterator[worker_pb2.TokenChunk]:
        async for c in source(4, 0.01, finish=not fails):
            yield c
        if fails:
            raise RuntimeError("engine died")

    async def main() -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        got: list[worker_pb2.TokenChunk] = []
        with pytest.raises(RuntimeError) if fails else contextlib.nullcontext():
            async for c in coalesced(short(), 1.0):
                got.append(c)
        assert loop.time() - started < 0.5  # not the window's 1 s
        assert flat(got) == [0, 1, 2, 3]
        assert [len(c.token_ids) for c in got] == [1, 3]  # still merged
        if not fails:
            assert got[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH

    run(main())


def test_aligned_windows_are_slots_of_the_clock() -> None:
    assert due(1.23, 0.1, aligned=False) == pytest.approx(1.33)
    assert due(1.23, 0.1, aligned=True) == pytest.approx(1.3)  # the next slot's start
    assert due(1.3, 0.1, aligned=True) == pytest.approx(1.4)  # never the same slot twice
    assert due(0.0, 0.5, aligned=True) == pytest.approx(0.5)
    # 3 * 0.1 is 0.30000000000000004 and 0.3 / 0.1 is 2.9999999999999996: a send at a
    # slot's start (or a hair before it, a timer firing early) is in that slot.
    assert due(3 * 0.1, 0.1, aligned=True) == pytest.approx(0.4)
    assert due(0.3, 0.1, aligned=True) == pytest.approx(0.4)
    assert due(0.4 - 1e-6, 0.1, aligned=True) == pytest.approx(0.5)


def test_aligned_streams_started_apart_send_at_the_same_instants() -> None:
    """Two streams started half a window apart: after their first chunks (sent at once)
    every chunk of both goes out at the start of a slot of the clock (give or take the
    loop's lateness), at most one per slot per stream, the two in the same slots, and the
    tokens stay contiguous (`workers.mux` batches them into one message). Unaligned, the
    two would send half a window apart."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        window = 0.05
        sent: list[list[float]] = [[], []]
        got: list[list[worker_pb2.TokenChunk]] = [[], []]

        async def one(n: int) -> None:
            await asyncio.sleep(window / 2 * n)
            async for c in coalesced(source(30, 0.007), window, aligned=True):
                sent[n].append(loop.time())
                got[n].append(c)

        await asyncio.gather(one(0), one(1))
        slots: list[set[int]] = []
        for times, chunks in zip(sent, got, strict=True):
            assert flat(chunks) == list(range(30))
            assert len(chunks[0].token_ids) == 1  # the first is never held back
            held = [t for t, c in zip(times[1:], chunks[1:], strict=True) if not c.finish_reason]
            mine = [math.floor((t + 0.002) / window) for t in held]  # the end cuts its window
            assert len(mine) == len(set(mine))  # one chunk per slot at most
            lateness = sorted(t - k * window for t, k in zip(held, mine, strict=True))
            assert lateness[len(lateness) // 2] < window / 4, lateness  # sent at slot starts
            slots.append(set(mine))
        assert len(slots[0] & slots[1]) >= 2  # both streams in the same slots

    run(main())


def test_merged_chunks_keep_each_tokens_text_end_in_the_merged_text() -> None:
    into = worker_pb2.TokenChunk(index=0, token_ids=[1, 2], text="ab", text_ends=[1, 2])
    merge(into, worker_pb2.TokenChunk(index=2, text="", token_ids=[]))  # nothing to move
    merge(into, worker_pb2.TokenChunk(index=2, token_ids=[3], text="cde", text_ends=[3]))
    assert list(into.text_ends) == [1, 2, 5]
    assert into.text == "abcde"
    merge(into, worker_pb2.TokenChunk(index=3, token_ids=[4], text="f"))  # says nothing
    assert list(into.text_ends) == []  # no longer one per token: dropped
