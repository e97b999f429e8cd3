"""The relay's tap (`control.mux.Tap`): a decode stream's plain chunks relayed in the
worker call's step, past the request's reader — in order, journalled before handed, with
everything that ends or fails a stream still left to the reader, and a stream whose chunks
all go past its reader never taken for silent.

A `MuxStream` fed by the test (as a ``DecodeMany`` batch would), read through
`WorkerLegs._watched` by a `Relay` over `MemoryStore`: no gRPC, no workers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Coroutine
from typing import Any, cast

import pytest

from orchestrator import errors
from orchestrator.api import common_pb2, worker_pb2
from orchestrator.control.journal import JournalWriter
from orchestrator.control.legs import WorkerLegs
from orchestrator.control.mux import MuxStream, Tap
from orchestrator.control.relay import Relay
from orchestrator.control.run import OutChunk, Run
from orchestrator.control.settings import ControlSettings
from orchestrator.core.records import WorkerInfo
from orchestrator.core.spec import RequestSpec
from orchestrator.core.state import Edge
from orchestrator.store.memory import MemoryStore
from orchestrator.store.settings import StoreSettings

LIMIT_S = 10.0
WORKER = WorkerInfo("decode-0", "decode", "127.0.0.1:1", "", "tcp", "m", "f", 64, 10, 1, 1)


def run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(asyncio.wait_for(coro, LIMIT_S))


class NoCall:
    """The shared call a stream cancels itself on (nothing to cancel here)."""

    def cancel(self, sid: int) -> None:
        pass


def chunk(index: int, *, finish: bool = False, text: str = "") -> worker_pb2.TokenChunk:
    reason = common_pb2.FINISH_REASON_LENGTH if finish else common_pb2.FINISH_REASON_UNSPECIFIED
    return worker_pb2.TokenChunk(
        index=index, token_ids=[100 + index], text=text or f"<{index}>", finish_reason=reason
    )


def test_a_stream_offers_a_chunk_to_its_tap_only_with_none_queued_before_it() -> None:
    async def main() -> None:
        stream = MuxStream(cast(Any, NoCall()), 0)
        taken: list[int] = []
        accept = True

        def take(c: worker_pb2.TokenChunk) -> bool:
            if accept:
                taken.append(c.index)
            return accept

        stream.tap = Tap()
        stream._deliver(chunk(0))  # no take set: queued
        stream.tap.take = take
        stream._deliver(chunk(1))  # one is queued before it: queued too, in order
        assert taken == []
        assert [c.index for c in [await anext(stream), await anext(stream)]] == [0, 1]
        stream._deliver(chunk(2))
        stream._deliver(chunk(3))
        assert taken == [2, 3]
        assert not stream._chunks
        accept = False  # declined (an end, say): the reader gets it
        stream._deliver(chunk(4, finish=True))
        assert (await anext(stream)).index == 4

    run(main())


def test_a_tap_that_fails_leaves_the_chunk_to_the_reader(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        stream = MuxStream(cast(Any, NoCall()), 0)

        def take(c: worker_pb2.TokenChunk) -> bool:
            raise RuntimeError("a bug")

        stream.tap = Tap()
        stream.tap.take = take
        source = chunk(5)
        stream._deliver(source)
        got = await anext(stream)
        assert got.index == 5
        assert got is not source  # a copy of its own, not a view into the batch

    with caplog.at_level(logging.ERROR):
        run(main())
    assert "a tapped decode chunk failed" in caplog.text


class Driven:
    """A request relayed from a `MuxStream`, as a drive does: its reads counted."""

    def __init__(self, settings: ControlSettings, stop: tuple[str, ...] = ()) -> None:
        self.settings = settings
        self.store = MemoryStore(StoreSettings(url="memory://"))
        self.spec = RequestSpec("r", (1, 2, 3), 1000, stop=stop)
        self.run = Run(self.spec, 1, time.monotonic())
        self.stream = MuxStream(cast(Any, NoCall()), 0)
        self.stream.tap = self.run.tap
        self.handed: list[OutChunk] = []
        self._handed = asyncio.Event()
        self.run.deliver = self._hand
        self.read = 0
        """Chunks the request's reader took (each a wake of its drive)."""
        self.writer = JournalWriter(self.store, 1.0)
        self.relay = Relay(self.store, settings, self.writer, None)
        legs = WorkerLegs(cast(Any, None), settings, self._alive)
        self.watched = legs._watched(self.stream, WORKER, self.run.check)

    async def _alive(self, worker: WorkerInfo) -> bool:
        return True

    def _hand(self, out: OutChunk) -> None:
        self.handed.append(out)
        self._handed.set()

    async def first(self) -> None:
        """Chunk 0, through the reader; its relay sets the tap (before its write lands)."""
        self.stream._deliver(chunk(0))
        await self._handed.wait()
        assert self.run.tap.take is not None

    async def start(self) -> None:
        await self.store.create(self.spec.record("a"))
        await self.store.transition("r", Edge.AGGREGATE, epoch=1)

    async def _counted(self) -> AsyncGenerator[worker_pb2.TokenChunk, None]:
        async for c in self.watched:
            self.read += 1
            yield c

    async def relayed(self) -> list[OutChunk]:
        return [c async for c in self.relay.relay(self.run, self._counted())]


def test_plain_chunks_go_past_the_reader_and_the_end_through_it() -> None:
    async def main() -> None:
        d = Driven(ControlSettings())
        await d.start()
        relaying = asyncio.create_task(d.relayed())
        await d.first()
        for i in range(1, 50):
            d.stream._deliver(chunk(i))
        d.stream._deliver(chunk(50, finish=True))
        d.stream._finish(None)
        ends = await relaying
        assert d.read == 2  # the first chunk and the end: 49 chunks woke nothing
        assert [c.index for c in d.handed] == list(range(51))  # in order, none twice
        assert [e.index for e in await d.store.journal("r")] == list(range(51))
        assert [(e.finish_reason, e.index) for e in ends] == [("length", 51)]
        assert d.run.tap.take is None  # off once the relay is done

    run(main())


def test_a_stop_string_and_a_wrong_index_are_left_to_the_reader() -> None:
    async def main() -> None:
        d = Driven(ControlSettings(), stop=("END",))
        await d.start()
        relaying = asyncio.create_task(d.relayed())
        await d.first()
        d.stream._deliver(chunk(1))
        d.stream._deliver(chunk(2, text="xxENDyy"))  # the reader cuts it and finishes
        ends = await relaying
        assert d.read == 2
        assert [(e.finish_reason, e.index) for e in ends] == [("stop", 3)]
        assert d.handed[-1].text == "xx"

        d = Driven(ControlSettings())
        await d.start()
        relaying = asyncio.create_task(d.relayed())
        await d.first()
        d.stream._deliver(chunk(1))
        d.stream._deliver(chunk(3))  # an index skipped: the reader fails the attempt
        with pytest.raises(errors.WorkerError, match="token index 3, expected 2"):
            await relaying
        assert [c.index for c in d.handed] == [0, 1]

    run(main())


def test_a_stream_whose_chunks_all_go_past_the_reader_is_not_silent() -> None:
    """Silence is time since the stream's last chunk, not since its reader's last read."""
    settings = ControlSettings(token_timeout_s=0.3, watch_interval_s=0.05)

    async def main() -> None:
        d = Driven(settings)
        await d.start()
        relaying = asyncio.create_task(d.relayed())
        await d.first()
        for i in range(1, 16):  # 0.75 s of chunks, every 0.05 s, all past the reader
            await asyncio.sleep(0.05)
            d.stream._deliver(chunk(i))
        assert not relaying.done()
        assert d.read == 1
        t0 = time.monotonic()
        with pytest.raises(errors.WorkerError) as silent:  # then nothing: silent
            await relaying
        assert silent.value.phase == "silence"
        assert 0.2 <= time.monotonic() - t0 < 1.0

    run(main())


def test_a_stop_string_split_over_many_chunks_is_found_and_none_of_it_given_out() -> None:
    """The run holds only the text a stop string may begin in (`core.stops`), however long
    the output: a stop string spread over three chunks, after 200 chunks of text, is cut
    where it begins — its beginning, in chunks relayed before, was held, never given out."""

    async def main() -> None:
        d = Driven(ControlSettings(), stop=("<<STOP>>", "no"))
        await d.start()
        relaying = asyncio.create_task(d.relayed())
        await d.first()
        for i in range(1, 200):
            d.stream._deliver(chunk(i, text=f"word{i} "))
            assert len(d.run.held) <= len("<<STOP>>") - 1
        for i, piece in enumerate(("tail <<S", "TOP", ">> more"), start=200):
            d.stream._deliver(chunk(i, text=piece))
        ends = await relaying
        assert [(e.finish_reason, e.index) for e in ends] == [("stop", 203)]
        assert "".join(c.text for c in d.handed).endswith("word199 tail ")
        assert d.run.held == ""

    run(main())


def test_text_without_a_token_journals_what_it_leaves_held() -> None:
    """A chunk of text alone (no token) that extends the text held for a stop string: the
    journal says what is held now (a replica taking over gives it out), and the end gives
    it out."""

    async def main() -> None:
        d = Driven(ControlSettings(), stop=("<<S!",))
        await d.start()
        relaying = asyncio.create_task(d.relayed())
        await d.first()
        d.stream._deliver(chunk(1, text="x <<"))
        d.stream._deliver(worker_pb2.TokenChunk(index=2, text="S"))
        d.stream._deliver(chunk(2, finish=True, text="."))
        d.stream._finish(None)
        ends = await relaying
        assert [(e.finish_reason, e.index) for e in ends] == [("length", 3)]
        journal = await d.store.journal("r")
        assert [e.held for e in journal] == ["", "<<", "<<S", ""]
        assert "".join(e.text for e in journal) == "<0>x <<S."
        assert "".join(c.text for c in d.handed) == "<0>x <<S."

    run(main())


def test_the_tokens_after_the_one_completing_a_stop_string_are_not_the_clients() -> None:
    """A chunk of four tokens whose third completes the stop string: the clients, the
    journal and the request's count get three (the worker said where each token's text
    ends: `TokenChunk.text_ends`); without the ends, all four count as before."""

    async def main(ends: list[int], expected: int) -> None:
        d = Driven(ControlSettings(), stop=("END",))
        await d.start()
        relaying = asyncio.create_task(d.relayed())
        await d.first()
        d.stream._deliver(
            worker_pb2.TokenChunk(
                index=1, token_ids=[7, 8, 9, 10], text="aabENDcdd", text_ends=ends
            )
        )
        ends_out = await relaying
        assert [(e.finish_reason, e.index) for e in ends_out] == [("stop", 1 + expected)]
        assert d.handed[-1].token_ids == [7, 8, 9, 10][:expected]
        assert d.handed[-1].text == "aab"
        journal = await d.store.journal("r")
        assert journal[-1].token_ids == (7, 8, 9, 10)[:expected]
        assert len(d.run.output) == 1 + expected

    asyncio.run(asyncio.wait_for(main([2, 4, 7, 9], 3), LIMIT_S))
    asyncio.run(asyncio.wait_for(main([], 4), LIMIT_S))  # a worker that does not say
