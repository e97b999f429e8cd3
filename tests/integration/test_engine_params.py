"""Issue 17 defects 12 and 13 in the engines (the reference engine on the seeded tiny model,
the simulated engine): min_tokens, ignore_eos, top_k, min_p and repetition_penalty in the
seeded draw, and log probabilities — each the same whether a request runs uninterrupted or
is continued elsewhere (a prefill/decode split, a failover's re-prefill of prompt +
generated tokens)."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from orchestrator.api import common_pb2, convert, worker_pb2
from orchestrator.core.logprobs import TokenLogprob
from orchestrator.core.sampling import SamplingParams
from orchestrator.workers.engine import Engine
from orchestrator.workers.hf_engine import HfEngine
from orchestrator.workers.model_files import load_engine
from orchestrator.workers.reference_host import ReferenceHost
from orchestrator.workers.sim_engine import SimEngine, SimSpec

PROMPT = "Name three colours."


@pytest.fixture(scope="module")
def engine() -> HfEngine:
    return load_engine("tiny")


def _run(
    engine: Engine, ids: list[int], p: SamplingParams, n: int, first_index: int = 0
) -> tuple[list[int], list[TokenLogprob | None]]:
    """Tokens first_index.. of a request whose history is ``ids``, and their log-probs."""
    result = engine.prefill(ids, p, first_index)
    tokens, scores = [result.first_token], [result.first_logprob]
    state = engine.start_decode(result.kv, ids, result.first_token, first_index + 1, p)
    for _ in range(n - 1):
        tokens += engine.decode_step([state])
        scores.append(state.logprobs.pop(state.generated - 1, None))
    return tokens, scores


def test_min_tokens_masks_the_end_of_sequence(engine: HfEngine) -> None:
    """Make the greedy first token the model's EOS: without min_tokens it is drawn, with
    min_tokens it cannot be until that many tokens exist (prefill and decode alike)."""
    ids = engine.tokenize(PROMPT)
    eos = engine.prefill(ids, SamplingParams()).first_token
    masked = load_engine("tiny")
    masked.info = replace(masked.info, eos_token_ids=(eos,))
    assert masked.prefill(ids, SamplingParams()).first_token == eos
    tokens, _ = _run(masked, ids, SamplingParams(min_tokens=6), 6)
    assert eos not in tokens
    sampled, _ = _run(masked, ids, SamplingParams(temperature=1.0, seed=1, min_tokens=6), 6)
    assert eos not in sampled


class _Context:
    async def abort(self, code: Any, details: str) -> None:
        raise AssertionError(f"aborted: {code} {details}")


async def _generate(engine: Engine, ids: list[int], sampling: SamplingParams) -> list[Any]:
    host = ReferenceHost(engine, kv_capacity_bytes=1 << 30, max_batch=4)
    await host.start("127.0.0.1", 0)
    try:
        req = worker_pb2.AggregatedRequest(
            request_id="r",
            epoch=1,
            token_ids=ids,
            sampling=convert.sampling_to_pb(sampling),
            max_tokens=5,
            prompt_tokens=len(ids),
        )
        return [c async for c in host.generate(req, _Context())]  # type: ignore[arg-type]
    finally:
        await host.close()


def test_ignore_eos_streams_through_the_end_of_sequence(engine: HfEngine) -> None:
    """The worker ended the stream at the EOS whatever the request said."""
    ids = engine.tokenize(PROMPT)
    eos = engine.prefill(ids, SamplingParams()).first_token
    masked = load_engine("tiny")
    masked.info = replace(masked.info, eos_token_ids=(eos,))
    ended = asyncio.run(_generate(masked, ids, SamplingParams()))
    assert [t for c in ended for t in c.token_ids] == []
    assert ended[-1].finish_reason == common_pb2.FINISH_REASON_EOS
    kept = asyncio.run(_generate(masked, ids, SamplingParams(ignore_eos=True)))
    tokens = [t for c in kept for t in c.token_ids]
    assert len(tokens) == 5
    assert tokens[0] == eos
    assert kept[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH


CONTINUED = [
    SamplingParams(temperature=0.9, seed=4, repetition_penalty=1.5, top_k=20, min_p=0.02),
    SamplingParams(repetition_penalty=2.0, logprobs=2),
    SamplingParams(temperature=1.2, seed=7, top_p=0.9, top_k=50, logprobs=3),
]


@pytest.mark.parametrize("params", CONTINUED)
def test_a_continuation_draws_what_the_uninterrupted_request_draws(
    engine: HfEngine, params: SamplingParams
) -> None:
    """Tokens 6.. from a re-prefill of prompt + 6 generated tokens (a failover) equal the
    uninterrupted request's — the penalty reads the same history — and so do their
    log-probabilities (to float rounding: a re-prefill computes in one pass what decoding
    computed step by step)."""
    ids = engine.tokenize(PROMPT)
    whole, whole_lps = _run(engine, ids, params, 12)
    other = load_engine("tiny")
    rest, rest_lps = _run(other, ids + whole[:6], params, 6, first_index=6)
    assert rest == whole[6:]
    if params.logprobs is None:
        assert set(whole_lps) == {None}
        return
    for a, b in zip(whole_lps[6:], rest_lps, strict=True):
        assert a is not None
        assert b is not None
        assert a.token_id == b.token_id
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t.token_id for t in a.top] == [t.token_id for t in b.top]
        assert len(a.top) == params.logprobs


def test_repetition_penalty_stops_a_greedy_loop(engine: HfEngine) -> None:
    ids = engine.tokenize("a")
    looping, _ = _run(engine, ids, SamplingParams(), 10)
    assert len(set(looping)) <= 2  # the tiny model repeats itself greedily
    varied, _ = _run(engine, ids, SamplingParams(repetition_penalty=3.0), 10)
    assert len(set(varied)) > len(set(looping))


def test_prompt_logprobs_score_what_decoding_scored(engine: HfEngine) -> None:
    """The log-probabilities of a prefill's prompt positions equal those the tokens had
    when they were generated (echo of a request's own output)."""
    ids = engine.tokenize(PROMPT)
    p = SamplingParams(logprobs=2)
    tokens, scores = _run(engine, ids, p, 8)
    echoed = engine.prefill(ids + tokens, replace(p, prompt_logprobs=2)).prompt_logprobs
    assert len(echoed) == len(ids) + len(tokens)
    assert echoed[0].logprob is None
    for gen, prompt in zip(scores, echoed[len(ids) :], strict=True):
        assert gen is not None
        assert prompt.logprob is not None
        assert prompt.token_id == gen.token_id
        assert prompt.logprob == pytest.approx(gen.logprob, abs=1e-4)
    assert all(lp.logprob is not None and lp.logprob <= 0 for lp in echoed[1:])
    # Only a request's first prefill scores the prompt (a failover's has it journalled).
    assert engine.prefill(ids, replace(p, prompt_logprobs=2), first_index=3).prompt_logprobs == ()


def test_log_probabilities_reach_the_worker_stream_with_texts(engine: HfEngine) -> None:
    ids = engine.tokenize(PROMPT)
    chunks = asyncio.run(
        _generate(engine, ids, SamplingParams(ignore_eos=True, logprobs=1, prompt_logprobs=1))
    )
    tokens = [t for c in chunks for t in c.token_ids]
    scores = [convert.logprob_from_pb(m) for c in chunks for m in c.logprobs]
    assert [s.token_id for s in scores] == tokens
    assert all(s.text == engine.detokenize([s.token_id]) for s in scores)
    prompt = [convert.logprob_from_pb(m) for m in chunks[0].prompt_logprobs]
    assert [s.token_id for s in prompt] == ids
    assert "".join(s.text for s in prompt) == PROMPT
    assert sum(len(c.prompt_logprobs) for c in chunks[1:]) == 0


def test_simulated_engine_log_probabilities_survive_a_split() -> None:
    sim = SimEngine(SimSpec.parse("llama-3-8b@L4"))
    ids = sim.tokenize("a prompt of seven words for you")
    p = SamplingParams(temperature=0.7, seed=3, logprobs=2, prompt_logprobs=2)
    whole, whole_lps = _run(sim, ids, p, 8)
    rest, rest_lps = _run(sim, ids + whole[:4], p, 4, first_index=4)
    assert rest == whole[4:]
    assert rest_lps == whole_lps[4:]
    prompt = sim.prefill(ids, p).prompt_logprobs
    assert len(prompt) == len(ids)
    assert prompt[0].logprob is None
    assert all(lp.logprob is not None and lp.logprob < 0 for lp in prompt[1:])
    assert all(len(lp.top) == 2 for lp in prompt[1:])
    # The made-up distribution ranks the greedy token first.
    greedy = sim.prefill(ids, SamplingParams(logprobs=1))
    assert greedy.first_logprob is not None
    assert greedy.first_logprob.top[0].token_id == greedy.first_token
    assert np.isclose(greedy.first_logprob.logprob, greedy.first_logprob.top[0].logprob)
