"""The replica's stream watchdog (`control.legs.Watchdogs`): one task checks every watched
stream each step — a run's flags, a stream's silence, and the heartbeats of the workers
whose streams are quiet, asked once per worker — and interrupts only the reads in trouble.

Streams are `MuxStream`s fed by the test, read through `WorkerLegs._watched`: no gRPC, no
workers, no store.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, cast

import pytest

from orchestrator import errors
from orchestrator.api import worker_pb2
from orchestrator.control.legs import WorkerLegs
from orchestrator.control.mux import MuxStream
from orchestrator.control.settings import ControlSettings
from orchestrator.core.records import WorkerInfo

STEP_S = 0.05


def worker(name: str) -> WorkerInfo:
    return WorkerInfo(name, "decode", "127.0.0.1:1", "", "tcp", "m", "f", 64, 10, 1, 1)


class NoCall:
    def cancel(self, sid: int) -> None:
        pass


class Heartbeats:
    """`Alive`: the workers named dead are not; every ask counted."""

    def __init__(self) -> None:
        self.dead: set[str] = set()
        self.asked: list[str] = []
        self.broken = False

    async def __call__(self, w: WorkerInfo) -> bool:
        self.asked.append(w.worker_id)
        if self.broken:
            raise RuntimeError("a bug in the heartbeat check")
        return w.worker_id not in self.dead


def run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(asyncio.wait_for(coro, 10))


async def read_all(legs: WorkerLegs, stream: MuxStream, w: WorkerInfo) -> list[int]:
    return [c.index async for c in legs._watched(stream, w, lambda: None)]


def watchdog_tasks() -> list[asyncio.Task[Any]]:
    return [t for t in asyncio.all_tasks() if t.get_name() == "pdorch-stream-watchdog"]


def test_one_task_watches_every_stream_and_a_dead_worker_fails_only_its_own() -> None:
    async def main() -> None:
        beats = Heartbeats()
        legs = WorkerLegs(cast(Any, None), ControlSettings(watch_interval_s=STEP_S), beats)
        a, b = worker("decode-a"), worker("decode-b")
        streams = [MuxStream(cast(Any, NoCall()), i) for i in range(20)]
        readers = [
            asyncio.create_task(read_all(legs, s, a if i < 10 else b))
            for i, s in enumerate(streams)
        ]
        await asyncio.sleep(STEP_S * 4)
        assert len(watchdog_tasks()) == 1  # not one per stream
        # Quiet streams: each step asks each worker once, not once per stream.
        asked_a, asked_b = beats.asked.count("decode-a"), beats.asked.count("decode-b")
        assert 2 <= asked_a <= 5
        assert abs(asked_a - asked_b) <= 1

        beats.dead.add("decode-a")
        for s in streams[10:]:  # b's streams go on
            s._deliver(worker_pb2.TokenChunk(index=0, token_ids=[1], text="x"))
        for r in readers[:10]:
            with pytest.raises(errors.WorkerError) as lost:
                await r
            assert lost.value.phase == "heartbeat"
        assert not any(r.done() for r in readers[10:])
        for s in streams[10:]:
            s._finish(None)
        assert [await r for r in readers[10:]] == [[0]] * 10
        await asyncio.sleep(STEP_S * 2)
        assert watchdog_tasks() == []  # ended with its last stream

    run(main())


def test_a_failing_heartbeat_check_is_logged_and_the_streams_still_watched(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def main() -> None:
        beats = Heartbeats()
        settings = ControlSettings(watch_interval_s=STEP_S, token_timeout_s=STEP_S * 6)
        legs = WorkerLegs(cast(Any, None), settings, beats)
        stream = MuxStream(cast(Any, NoCall()), 0)
        beats.broken = True
        reader = asyncio.create_task(read_all(legs, stream, worker("decode-a")))
        with pytest.raises(errors.WorkerError) as silent:  # still judged silent in the end
            await reader
        assert silent.value.phase == "silence"

    with caplog.at_level(logging.ERROR):
        run(main())
    assert "the heartbeat check of decode-a failed" in caplog.text


def test_a_stream_read_elsewhere_is_not_silent_nor_asked_about() -> None:
    """A reader busy elsewhere (not waiting on the stream) is never interrupted."""

    async def main() -> None:
        beats = Heartbeats()
        settings = ControlSettings(watch_interval_s=STEP_S, token_timeout_s=STEP_S * 2)
        legs = WorkerLegs(cast(Any, None), settings, beats)
        stream = MuxStream(cast(Any, NoCall()), 0)
        watched = legs._watched(stream, worker("decode-a"), lambda: None)
        stream._deliver(worker_pb2.TokenChunk(index=0, token_ids=[1], text="x"))
        assert (await anext(watched)).index == 0
        await asyncio.sleep(STEP_S * 5)  # the reader holds the chunk: no read waiting
        assert beats.asked == []
        stream._deliver(worker_pb2.TokenChunk(index=1, token_ids=[2], text="y"))
        assert (await anext(watched)).index == 1
        await watched.aclose()

    run(main())


def test_a_slow_heartbeat_check_never_holds_back_a_runs_flags() -> None:
    """The store answering slowly (a partition, a Redis failover) delays the heartbeats'
    verdict only: a run flagged meanwhile (its lease lost, cancelled) is interrupted at the
    next step, whatever the number of workers asked about."""

    async def main() -> None:
        async def slow(w: WorkerInfo) -> bool:
            await asyncio.sleep(STEP_S * 40)
            return True

        legs = WorkerLegs(cast(Any, None), ControlSettings(watch_interval_s=STEP_S), slow)
        flagged = False

        def check() -> None:
            if flagged:
                raise errors.UnavailableError("the run's lease was lost")

        workers = [worker(f"decode-{i}") for i in range(10)]
        streams = [MuxStream(cast(Any, NoCall()), i) for i in range(10)]
        mine = legs._watched(streams[0], workers[0], check)
        readers = [
            asyncio.create_task(read_all(legs, s, w))
            for s, w in zip(streams[1:], workers[1:], strict=True)
        ]
        reading = asyncio.create_task(anext(mine))
        await asyncio.sleep(STEP_S * 4)  # every worker's heartbeat check is now in flight
        flagged = True
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(errors.UnavailableError, match="lease was lost"):
            await reading
        assert asyncio.get_running_loop().time() - t0 < STEP_S * 4
        for s in streams[1:]:
            s._finish(None)
        await asyncio.gather(*readers)

    run(main())


def test_a_failing_checkpoint_is_logged_once_and_silence_still_judged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def main() -> None:
        settings = ControlSettings(watch_interval_s=STEP_S, token_timeout_s=STEP_S * 6)
        legs = WorkerLegs(cast(Any, None), settings, Heartbeats())

        def broken() -> None:
            raise RuntimeError("a bug in the checkpoint")

        stream = MuxStream(cast(Any, NoCall()), 0)
        with pytest.raises(errors.WorkerError) as silent:
            await anext(legs._watched(stream, worker("decode-a"), broken))
        assert silent.value.phase == "silence"

    with caplog.at_level(logging.ERROR):
        run(main())
    assert caplog.text.count("a stream's checkpoint failed") == 1
