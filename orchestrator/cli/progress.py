"""Progress lines on stderr for steps that take more than a moment (cluster start, model
loading): ``step ... 12 s (2/3 workers)`` updated in place on a terminal, a line when the
step starts and one when it ends elsewhere (logs, CI), nothing at all when quiet (``--json``)."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import TextIO

TICK_S = 0.5
"""How often the live line is redrawn."""


class Progress:
    def __init__(self, *, quiet: bool = False, stream: TextIO | None = None) -> None:
        self.quiet = quiet
        self.stream = stream if stream is not None else sys.stderr
        self.live = not quiet and self.stream.isatty()

    def say(self, text: str) -> None:
        if not self.quiet:
            print(text, file=self.stream, flush=True)

    @contextlib.contextmanager
    def step(self, what: str, detail: Callable[[], str] | None = None) -> Iterator[None]:
        """Time ``what``; on a terminal, redraw ``what ... N s (detail())`` until it ends."""
        if self.quiet:
            yield
            return
        start = time.monotonic()
        done = threading.Event()
        ticker = None
        if not self.live:  # a log: one line when the step starts, one when it ends
            print(f"{what} ...", file=self.stream, flush=True)
        else:
            ticker = threading.Thread(
                target=self._tick, args=(what, detail, start, done), name="progress", daemon=True
            )
            ticker.start()
        outcome = "FAILED"
        try:
            yield
            outcome = "done"
        except (KeyboardInterrupt, asyncio.CancelledError):
            # Ctrl-C (or `pdorch down`): not a failure. Under `asyncio.run` (`pdorch chaos
            # run`) Ctrl-C reaches the step as the main task's cancellation, not as
            # KeyboardInterrupt (asyncio.Runner turns SIGINT into `Task.cancel`).
            outcome = "interrupted"
            raise
        finally:
            done.set()
            if ticker is not None:
                ticker.join()
            elapsed = time.monotonic() - start
            end = "\r\033[K" if self.live else ""
            print(f"{end}{what}: {outcome} in {elapsed:.1f} s", file=self.stream, flush=True)

    def _tick(
        self, what: str, detail: Callable[[], str] | None, start: float, done: threading.Event
    ) -> None:
        while not done.wait(TICK_S):
            extra = ""
            if detail is not None:
                with contextlib.suppress(Exception):  # a detail is best effort, never fatal
                    extra = f"  ({detail()})"
            line = f"{what} ... {time.monotonic() - start:.0f} s{extra}"
            self.stream.write(f"\r\033[K{line}")
            self.stream.flush()
