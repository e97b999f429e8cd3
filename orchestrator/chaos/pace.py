"""Why a fault ran late: the runner's loop busy, or the machine not running it.

A fault is executed from the runner's event loop; when it runs after it was due, either the
runner itself was busy (its CPU time grew by about the lateness) or the machine gave it no
CPU (a loaded host: its CPU time barely grew). `LoopPace` samples the runner's time and its
process CPU time (every thread) on the loop, so a late fault can say which.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import time
from collections import deque
from collections.abc import Callable

SAMPLE_EVERY_S = 0.05
"""How often the loop samples its clock and CPU time (a late fault looks back to its due
time; a sample is at most this much before it)."""
KEEP_S = 120.0
"""How far back samples are kept (a trigger's due time is when it was seen: recent)."""


class LoopPace:
    """Samples of (runner time, process CPU time), taken on the runner's loop."""

    def __init__(
        self,
        now: Callable[[], float],
        cpu: Callable[[], float] = time.process_time,
        every_s: float = SAMPLE_EVERY_S,
    ) -> None:
        self._now = now
        self._cpu = cpu
        self._every_s = every_s
        self._samples: deque[tuple[float, float]] = deque(maxlen=int(KEEP_S / every_s) + 1)
        self._task: asyncio.Task[None] | None = None

    def sample(self) -> None:
        self._samples.append((self._now(), self._cpu()))

    def start(self) -> None:
        async def run() -> None:
            while True:
                self.sample()
                await asyncio.sleep(self._every_s)

        self._task = asyncio.create_task(run(), name="pdorch-chaos-pace")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def cpu_since(self, t: float) -> float | None:
        """The runner's CPU seconds from the last sample at or before ``t`` until now, or
        None when no sample is that old."""
        times = [s[0] for s in self._samples]
        i = bisect.bisect_right(times, t) - 1
        if i < 0:
            return None
        return max(0.0, self._cpu() - self._samples[i][1])
