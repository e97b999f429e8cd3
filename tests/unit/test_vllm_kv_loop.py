"""The vLLM connector's loop thread is not held to the core of the thread that started it.

vLLM's CPU worker binds its model runner thread to one core before the connector starts its
loop thread, and a thread inherits its creator's affinity: the loop (the prefill's ALIVE
while a forward computes, the decode's receiver) then waited behind the forward and vLLM's
busy-polling on that core, seconds under load (`kv_loop`'s docstring has the figures)."""

from __future__ import annotations

import os
import threading

import pytest

from orchestrator.workers.vllm.kv_loop import LoopThread

_ALLOWED = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()

pytestmark = [
    pytest.mark.timeout(30),
    pytest.mark.skipif(len(_ALLOWED) < 2, reason="needs CPU affinity and two CPUs"),
]


async def _affinity() -> set[int]:
    return os.sched_getaffinity(0)


def test_the_loop_thread_runs_on_every_cpu_though_its_starter_is_bound_to_one() -> None:
    seen: dict[str, set[int]] = {}

    def model_runner() -> None:  # binds itself as vLLM's CPU worker does, then starts the loop
        os.sched_setaffinity(0, {min(_ALLOWED)})
        loop = LoopThread("test-kv-unpinned")
        loop.start()
        try:
            seen["loop"] = loop.submit(_affinity()).result(10)
        finally:
            loop.stop()
        seen["runner"] = os.sched_getaffinity(0)

    thread = threading.Thread(target=model_runner, name="test-model-runner")
    thread.start()
    thread.join(20)
    assert seen["runner"] == {min(_ALLOWED)}  # the starter's binding is its own business
    assert seen["loop"] == _ALLOWED
