"""vLLM alone, no pdorch: streamed greedy requests through vLLM's ``AsyncLLM`` with the engine
settings pdorch's vLLM workers use, at the concurrency levels of ``pdorch bench engine`` and
with its prompts (the 20 shipped chat prompts) and token limit. The floor pdorch's engine
bench figures compare with: what the orchestrator, gRPC and the worker add is the difference.

    python tests/gpu/vllm_baseline.py [--concurrency 1,4,8] [--rounds 2] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

from vllm import SamplingParams, TokensPrompt
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.async_llm import AsyncLLM

from orchestrator.workers.model_files import ensure_smollm2
from orchestrator.workers.vllm.engine import VllmSettings, model_info
from orchestrator.workers.vllm.offline import default_prompts

Sample = tuple[float, float | None, int]
"""TTFT ms, TPOT ms (None for one token), tokens."""


async def _one(llm: Any, ids: list[int], rid: str, sampling: Any) -> Sample:
    started = time.perf_counter()
    first = last = 0.0
    tokens = 0
    async for out in llm.generate(TokensPrompt(prompt_token_ids=ids), sampling, rid):
        n = len(out.outputs[0].token_ids)
        if n:
            last = time.perf_counter()
            first = first or last
            tokens += n
    tpot = (last - first) * 1000 / (tokens - 1) if tokens > 1 else None
    return (first - started) * 1000, tpot, tokens


async def _run(levels: list[int], rounds: int, max_tokens: int) -> list[dict[str, float]]:
    s = VllmSettings(model_dir=ensure_smollm2())
    llm = AsyncLLM.from_engine_args(
        AsyncEngineArgs(
            model=str(s.model_dir),
            dtype=s.dtype,
            max_model_len=s.max_model_len,
            enforce_eager=s.enforce_eager,
            kv_cache_memory_bytes=s.kv_cache_bytes,
            max_num_seqs=s.max_num_seqs,
            disable_log_stats=True,
        )
    )
    tok = llm.get_tokenizer()
    prompts = []
    for p in default_prompts():
        text = tok.apply_chat_template(
            [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
        )
        prompts.append(list(tok.encode(str(text), add_special_tokens=False)))
    sampling = SamplingParams(
        max_tokens=max_tokens,
        temperature=0,
        stop_token_ids=list(model_info(s).eos_token_ids),
        output_kind=RequestOutputKind.DELTA,
        detokenize=False,
    )
    ids = iter(range(10**9))
    for i in range(2):  # warm-up, as the engine bench does
        await _one(llm, prompts[i], f"warm-{next(ids)}", sampling)
    results = []
    for n, c in enumerate(levels):
        queue = [prompts[(n * 7 + i) % len(prompts)] for i in range(c * rounds)]
        samples: list[Sample] = []

        async def slot(queue: list[list[int]], samples: list[Sample]) -> None:
            while queue:
                samples.append(await _one(llm, queue.pop(), f"r-{next(ids)}", sampling))

        started = time.perf_counter()
        await asyncio.gather(*(slot(queue, samples) for _ in range(c)))
        wall = time.perf_counter() - started
        tpots = [t for _, t, _ in samples if t is not None]
        results.append(
            {
                "concurrency": c,
                "requests": len(samples),
                "ttft_ms": statistics.median(f for f, _, _ in samples),
                "tpot_ms": statistics.median(tpots) if tpots else 0.0,
                "tokens_per_s": sum(k for _, _, k in samples) / wall,
            }
        )
    llm.shutdown()
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", default="1,4,8")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",") if c]
    results = asyncio.run(_run(levels, args.rounds, args.max_tokens))
    print("vLLM alone (AsyncLLM, pdorch's engine settings), streamed greedy")
    print(f"{'streams':>8} {'requests':>9} {'TTFT ms':>9} {'TPOT ms':>9} {'tok/s':>7}")
    for r in results:
        print(
            f"{r['concurrency']:>8} {r['requests']:>9} {r['ttft_ms']:>9.1f} "
            f"{r['tpot_ms']:>9.1f} {r['tokens_per_s']:>7.1f}"
        )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
