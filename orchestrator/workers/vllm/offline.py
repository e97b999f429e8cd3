"""vLLM on its own, no pdorch: the reference that pdorch's vLLM workers are checked against.

``python -m orchestrator.workers.vllm.offline --model-dir DIR [--max-tokens N]
[--sampling T:SEED ...]`` renders each prompt (the 20 of `pdorch bench precision`, or
one per line of ``--prompts``) with the model's chat template, runs them all through
``vllm.LLM.generate`` in one call — what a user of vLLM would do — with the engine settings
`engine.VllmSettings` gives pdorch's workers, and prints one JSON object:
``{"runs": [[{"prompt": ..., "prompt_ids": [...], "output_ids": [...],
"finish": ...}, ...], ...]}``, one run per ``--sampling``. End-of-sequence tokens are not
in ``output_ids`` (pdorch does not stream them). A separate process: vLLM starts its engine
core with ``spawn``. Sampled runs draw with pdorch's logits processor (`sampler`), as
pdorch's vLLM workers do: vLLM's own seeded generator restarts in every vLLM request, which
breaks pdorch's contract across a prefill/decode split or a failover.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

from orchestrator.api import convert
from orchestrator.bench.precision import prompts_from_text
from orchestrator.core.sampling import SamplingParams as Sampling
from orchestrator.workers.vllm.engine import VllmSettings, model_info


def default_prompts() -> list[str]:
    """`pdorch bench precision`'s 20 shipped chat prompts."""
    text = resources.files("orchestrator.bench").joinpath("precision_prompts.txt").read_text()
    return prompts_from_text(text)


def run(
    settings: VllmSettings,
    prompts: Sequence[str],
    max_tokens: int,
    samplings: Sequence[tuple[float, int]] = ((0.0, 0),),
) -> list[list[dict[str, object]]]:
    """Per (temperature, seed) of ``samplings``: every prompt's outputs (temperature 0:
    greedy, no seed)."""
    from vllm import LLM, SamplingParams, TokensPrompt  # noqa: PLC0415 - a heavy import

    from orchestrator.workers.vllm import sampler  # noqa: PLC0415 - imports vLLM

    llm = LLM(
        model=str(settings.model_dir),
        dtype=settings.dtype,
        max_model_len=settings.max_model_len,
        enforce_eager=settings.enforce_eager,
        kv_cache_memory_bytes=settings.kv_cache_bytes,
        max_num_seqs=settings.max_num_seqs,
        logits_processors=[sampler.PROCESSOR],
    )
    tokenizer = llm.get_tokenizer()
    eos = set(model_info(settings).eos_token_ids)
    prompt_ids = []
    for p in prompts:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
        )
        prompt_ids.append(list(tokenizer.encode(str(text), add_special_tokens=False)))
    runs = []
    for temperature, seed in samplings:
        # what a worker receives for it: the wire's temperature is a float32
        pdorch = convert.sampling_from_pb(convert.sampling_to_pb(Sampling(temperature, seed=seed)))
        sampling = SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0,  # sampled: pdorch's draw picks the token vLLM's argmax returns
            stop_token_ids=sorted(eos),
            extra_args=None if pdorch.greedy else sampler.extra_args(pdorch, 0),
        )
        outputs = llm.generate([TokensPrompt(prompt_token_ids=i) for i in prompt_ids], sampling)
        runs.append(
            [
                {
                    "prompt": p,
                    "prompt_ids": ids,
                    "output_ids": [int(t) for t in out.outputs[0].token_ids if t not in eos],
                    "finish": out.outputs[0].finish_reason,
                }
                for p, ids, out in zip(prompts, prompt_ids, outputs, strict=True)
            ]
        )
    return runs


def _sampling(text: str) -> tuple[float, int]:
    temperature, _, seed = text.partition(":")
    return float(temperature), int(seed or 0)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m orchestrator.workers.vllm.offline")
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--prompts", default="", help="file: one prompt per line (default: 20)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument(
        "--sampling",
        type=_sampling,
        action="append",
        default=[],
        metavar="T:SEED",
        help="temperature:seed of a run (repeatable; default one greedy run, 0:0)",
    )
    args = ap.parse_args(argv)
    prompts = (
        [line for line in Path(args.prompts).read_text().splitlines() if line.strip()]
        if args.prompts
        else default_prompts()
    )
    settings = VllmSettings(model_dir=Path(args.model_dir))
    runs = run(settings, prompts, args.max_tokens, args.sampling or [(0.0, 0)])
    print(json.dumps({"runs": runs}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
