"""An asyncio event loop on a thread of its own, for code that lives inside vLLM's processes.

vLLM calls the connector's worker side synchronously from its model runner; pdorch's transport
is asyncio. The connector runs its `KvSender`/`KvReceiver` and its control link on this loop
and hands work over with `submit` (a coroutine, from any thread) — the model runner never
blocks on the network except where the connector decides to wait (a prefill step's end).

**Not on the model runner's core.** vLLM's CPU worker binds its compute threads, the model
runner thread among them, to the cores it computes on (`init_cpu_threads_env`; on this 2-core
VM ``core ids=[0]``, CPU 1 "reserved") before the connector starts, and a thread inherits its
creator's affinity: the loop thread was held to the one core whose thread computes the
forward and busy-polls vLLM's message queue between steps — and on a machine running the
prefill and decode engines, both model runners share it. Under load the loop then ran
seconds late: a probe on it measured 1.2 s between a step's bind and its first layer, and
6-7 s during a run of steps (`pdorch demo --engine vllm`, a loaded 2-core VM), long enough
for the prefill's ALIVE (every ``keepalive_s``, `OutgoingTransfer.hold`) to miss the decode
receiver's 5 s idle deadline. The loop thread widens its own affinity to every CPU the
process may use (`_unpin`): it needs little CPU, but soon. (What this does not cure: the
loop shares the GIL with the model runner; a whole process stalled is a stalled sender.)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

log = logging.getLogger(__name__)


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
        _unpin()
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


def _unpin() -> None:
    """Let the calling thread run on every CPU this process may use, whatever core the
    thread that started it was bound to (the kernel keeps it within the cgroup's cpuset)."""
    if not hasattr(os, "sched_setaffinity"):  # (not Linux: no binding to undo)
        return
    cpus = set(range(os.cpu_count() or 1))
    try:
        os.sched_setaffinity(0, cpus)  # 0: this thread
    except OSError as exc:
        log.warning("KV loop thread left on CPUs %s: %s", sorted(os.sched_getaffinity(0)), exc)


async def _cancel_all() -> None:
    me = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not me]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
