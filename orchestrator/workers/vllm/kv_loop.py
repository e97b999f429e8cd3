"""An asyncio event loop on a thread of its own, for code that lives inside vLLM's processes.

vLLM calls the connector's worker side synchronously from its model runner; pdorch's transport
is asyncio. The connector runs its `KvSender`/`KvReceiver` and its control link on this loop
and hands work over with `submit` (a coroutine, from any thread) — the model runner never
blocks on the network except where the connector decides to wait (a prefill step's end).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class LoopThread:
    def __init__(self, name: str) -> None:
        self._name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            raise RuntimeError(f"loop thread {self._name} is not running")
        return self._loop

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()
        self._ready.wait()

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            loop.close()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run ``coro`` on the loop; the future is thread-safe."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, fn: Callable[..., Any], *args: Any) -> None:
        """Call ``fn(*args)`` on the loop, soon (fire and forget)."""
        self.loop.call_soon_threadsafe(fn, *args)

    def stop(
        self, closing: Coroutine[Any, Any, None] | None = None, timeout_s: float = 5.0
    ) -> None:
        """Run ``closing`` (if any), cancel what is left, stop the loop. Idempotent."""
        if self._thread is None or self._loop is None:
            if closing is not None:
                closing.close()
            return
        loop = self._loop
        if closing is not None:
            with contextlib.suppress(Exception):
                self.submit(closing).result(timeout_s)
        with contextlib.suppress(Exception):
            self.submit(_cancel_all()).result(timeout_s)
        loop.call_soon_threadsafe(loop.stop)
        self._thread.join(timeout_s)
        self._thread = None


async def _cancel_all() -> None:
    me = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not me]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
