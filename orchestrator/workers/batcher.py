"""The decode loop of a worker: one engine thread steps every active sequence in turn.

Each iteration hands the engine all active sequences (up to ``max_batch``) in one
`Engine.decode_step` call — the reference engine steps them one after another inside that
call (interleaving), an engine that batches could do one forward pass — and delivers each
new token to its sequence's queue. Sequences join and leave between iterations, so a new
request starts decoding within one step of arriving.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from orchestrator.workers.engine import DecodeState, Engine

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(eq=False)
class Sequence:
    request_id: str
    state: DecodeState
    tokens: asyncio.Queue[int | BaseException] = field(default_factory=asyncio.Queue)
    compute_s: float = 0.0
    """Engine time spent on this sequence: its share (1/batch) of every step it was in."""


class EngineRunner:
    """Runs engine calls on the worker's single engine thread (engines are not thread-safe)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pdorch-engine")

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


class DecodeBatcher:
    def __init__(self, runner: EngineRunner, max_batch: int = 16) -> None:
        self._runner = runner
        self._max_batch = max_batch
        self._active: list[Sequence] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def active(self) -> int:
        return len(self._active)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="pdorch-decode-loop")

    def add(self, seq: Sequence) -> None:
        self._active.append(seq)
        self._wake.set()

    def remove(self, seq: Sequence) -> None:
        with contextlib.suppress(ValueError):
            self._active.remove(seq)

    async def _run(self) -> None:
        cursor = 0
        while True:
            if not self._active:
                self._wake.clear()
                await self._wake.wait()
                continue
            # Round-robin window so more than max_batch sequences all make progress.
            n = len(self._active)
            take = min(n, self._max_batch)
            batch = [self._active[(cursor + i) % n] for i in range(take)]
            cursor = (cursor + take) % max(n, 1)
            started = time.perf_counter()
            try:
                tokens = await self._runner.call(
                    self._runner.engine.decode_step, [s.state for s in batch]
                )
            except Exception as exc:
                log.exception("decode step failed")
                for s in batch:
                    self.remove(s)
                    s.tokens.put_nowait(exc)
                continue
            share = (time.perf_counter() - started) / len(batch)
            for s, t in zip(batch, tokens, strict=True):
                s.compute_s += share
                if s in self._active:
                    s.tokens.put_nowait(t)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
