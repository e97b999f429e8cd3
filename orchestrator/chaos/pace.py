"""Why a fault ran late: the runner's process busy, or the machine not running it.

A fault is executed from the runner's event loop; when it runs after it was due, either the
runner's process was busy (its CPU time grew about as fast as the clock: the loop, or its
other threads — gRPC's, heals in threads — holding it up) or the machine gave it little CPU
(a loaded host: its CPU time barely grew). `LoopPace` samples the runner's time and its
process CPU time on the loop, so a late fault can say which (`cpu_share`).
"""

from __future__ import annotations

import asyncio
import bisect
import time
from collections import deque
from collections.abc import Callable

from orchestrator.aio import cancel_and_wait

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
        """Sample now and every ``every_s`` until `stop` (a second call: no second task)."""
        if self._task is not None:
            return
        self.sample()  # a fault due at once has a sample to look back to

        async def run() -> None:
            while True:
                await asyncio.sleep(self._every_s)
                self.sample()

        self._task = asyncio.create_task(run(), name="pdorch-chaos-pace")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None

    def cpu_share(self, t: float) -> float | None:
        """The runner's CPU time over the wall time, from the last sample at or before
        ``t`` until now (0.0 to 1.0 for one busy thread; more with several), or None when
        no sample is that old."""
        times = [s[0] for s in self._samples]
        i = bisect.bisect_right(times, t) - 1
        if i < 0:
            return None
        at, cpu = self._samples[i]
        wall = self._now() - at
        return round(max(0.0, self._cpu() - cpu) / wall, 3) if wall > 0 else None
