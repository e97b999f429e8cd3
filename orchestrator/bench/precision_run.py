"""Runs `pdorch bench precision` in one process: an engine, its KV converted or not.

For each prompt (through the model's chat template): one prefill; then two greedy decodes
from it — one adopting the prefill's KV unchanged (what a native transfer delivers), one
adopting it after `transport.kvcodec.round_trip` (conversion, the wire encoding and strict
decoding, conversion back: what a transfer in that dtype delivers). Only the prompt's KV is
converted, as in a disaggregated request; the KV of generated tokens stays the engine's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from importlib import resources

from orchestrator.bench.precision import PrecisionReport, PromptResult, prompts_from_text, summarize
from orchestrator.core.sampling import SamplingParams
from orchestrator.workers.engine import Engine, KvLayers
from transport import kvcodec
from transport.wire import DType

WIRE_DTYPES = {"fp16": DType.FLOAT16, "bf16": DType.BFLOAT16, "fp8": DType.FLOAT8_E4M3}
GREEDY = SamplingParams(temperature=0.0)


def default_prompts() -> list[str]:
    """The shipped prompt set (20 varied chat prompts)."""
    text = resources.files("orchestrator.bench").joinpath("precision_prompts.txt").read_text()
    return prompts_from_text(text)


def generate(engine: Engine, kv: KvLayers, prompt_ids: list[int], first: int, n: int) -> list[int]:
    """Greedy output tokens 0..n-1 (stopping after EOS) continuing from a prompt's KV."""
    out = [first]
    eos = set(engine.info.eos_token_ids)
    state = engine.start_decode(kv, prompt_ids, first, 1, GREEDY)
    while len(out) < n and out[-1] not in eos:
        out.append(engine.decode_step([state])[0])
    return out


def compare_prompt(engine: Engine, prompt: str, wire: DType, max_tokens: int) -> PromptResult:
    ids = engine.chat_tokens([("user", prompt)])
    result = engine.prefill(ids, GREEDY)
    source = engine.info.kv_dtype
    reference = generate(engine, result.kv, ids, result.first_token, max_tokens)
    converted = kvcodec.round_trip(result.kv, source, wire)
    candidate = generate(engine, converted, ids, result.first_token, max_tokens)
    return PromptResult(prompt, tuple(reference), tuple(candidate))


def kv_bytes_ratio(engine: Engine, wire: DType, tokens: int = 64) -> float:
    """Wire bytes / engine bytes of a ``tokens``-long KV, per-head scales included."""
    info = engine.info
    shape = (info.kv_heads, tokens, info.head_dim)
    elements = 2 * info.n_layers * info.kv_heads * tokens * info.head_dim
    scales = 2 * info.n_layers * shape[0] * 4 if wire is DType.FLOAT8_E4M3 else 0
    return (elements * wire.itemsize + scales) / (elements * info.kv_dtype.itemsize)


def run_precision(
    engine: Engine,
    dtype: str,
    prompts: Sequence[str],
    max_tokens: int,
    on_prompt: Callable[[int, PromptResult], None] | None = None,
) -> PrecisionReport:
    wire = WIRE_DTYPES[dtype]
    started = time.perf_counter()
    results = []
    for i, prompt in enumerate(prompts):
        r = compare_prompt(engine, prompt, wire, max_tokens)
        results.append(r)
        if on_prompt is not None:
            on_prompt(i, r)
    return summarize(
        engine.info.name,
        dtype,
        max_tokens,
        results,
        kv_bytes_ratio(engine, wire),
        time.perf_counter() - started,
    )
