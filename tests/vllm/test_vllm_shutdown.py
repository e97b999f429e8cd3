"""A vLLM worker's engine stopping: quietly when it is told to, loudly when it dies.

Each test runs one `VllmHost` (decode role, TCP) in a process of its own (this file run as a
script), serves one request, then stops it — `VllmHost.close`, as a worker's SIGTERM or
``pdorch down`` does — or kills its engine core. Runs in the vLLM venv (skipped elsewhere).
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
]

DEAD = "output_handler failed"
"""What vLLM logs (with `EngineDeadError`'s traceback) when its output handler fails."""
SHUT_DOWN = "vLLM engine shut down"


def _run(mode: str) -> str:
    from orchestrator.workers.model_files import ensure_smollm2  # noqa: PLC0415 - transformers

    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_LOGGING_STREAM="ext://sys.stderr")
    argv = [sys.executable, __file__, mode, str(ensure_smollm2())]
    proc = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=540,
        env=env,
        check=False,
        start_new_session=True,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "@@done" in out, out[-4000:]
    return out


def test_a_clean_stop_logs_one_line_and_no_traceback() -> None:
    """The shutdown thread is held back before it cancels vLLM's output handler, as a busy
    worker's GIL holds it: the handler used to take `EngineDeadError` meanwhile."""
    out = _run("stop")
    assert DEAD not in out
    assert "Traceback" not in out
    assert out.count(SHUT_DOWN) == 1


def test_an_engine_that_dies_is_still_reported_as_an_error() -> None:
    out = _run("kill")
    assert "ERROR" in out
    assert DEAD in out
    assert "@@dead EngineDeadError" in out


# ------------------------------------------------------------------ the engine's process


async def _serve(mode: str, model: Path) -> None:
    from vllm import SamplingParams, TokensPrompt  # noqa: PLC0415
    from vllm.v1.engine import async_llm  # noqa: PLC0415

    from orchestrator.workers.vllm.engine import VllmHost, VllmSettings  # noqa: PLC0415

    cancel = async_llm.cancel_task_threadsafe

    def held_back(task: asyncio.Task[None]) -> None:
        time.sleep(0.5)  # the loop turns meanwhile: the output handler reads on
        cancel(task)

    async_llm.cancel_task_threadsafe = held_back
    settings = VllmSettings(model_dir=model, role="decode", max_model_len=512, kv_report_blocks=0)
    host = VllmHost(settings)
    await host.start("127.0.0.1", 0)
    llm = host._llm
    prompt, sampling = TokensPrompt(prompt_token_ids=[1, 2, 3, 4]), SamplingParams(max_tokens=2)
    async for _ in llm.generate(prompt, sampling, "r1"):
        pass
    if mode == "kill":
        for proc in llm.engine_core.resources.engine_manager.processes:
            os.kill(proc.pid, signal.SIGKILL)  # the engine core dies under it
        try:  # the request waits until vLLM finds its engine core gone
            async with asyncio.timeout(120):
                async for _ in llm.generate(prompt, sampling, "r2"):
                    pass
        except Exception as exc:  # what a request sees, printed for the test
            print(f"@@dead {type(exc).__name__}", flush=True)
    del llm  # the host holds the engine alone, as in a worker (no __del__ at exit)
    await host.close()
    print("@@done", flush=True)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s %(message)s")
    asyncio.run(_serve(sys.argv[1], Path(sys.argv[2])))
