"""vLLM's per-position log-probability mappings as pdorch's (`workers.vllm.logprobs`): the
token's value, the alternatives re-ranked most probable first with ties to the lower id (as
`core.logprobs.top_of` ranks them), the prompt's first token unscored, and a clear error when
vLLM's answer lacks what was asked. Pure: no vLLM needed."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from orchestrator.api import common_pb2
from orchestrator.core import logprobs as core
from orchestrator.workers.vllm import logprobs as vl
from orchestrator.workers.vllm.accounting import ChunkStream


@dataclass
class _Logprob:  # vLLM's Logprob's shape
    logprob: float
    rank: int


def _vllm_position(lp: np.ndarray, token: int, k: int) -> dict[int, _Logprob]:
    """What vLLM returns for one position: the token first, then its top k (vLLM's order)."""
    order = np.argsort(-lp, kind="stable")
    out = {token: _Logprob(float(lp[token]), int((lp > lp[token]).sum()) + 1)}
    out.update({int(i): _Logprob(float(lp[i]), r + 1) for r, i in enumerate(order[:k])})
    return out


def test_a_position_equals_the_reference_computation() -> None:
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(4, 50))
    lp = core.log_softmax(logits)
    for raw, row, token in zip(logits, lp, [7, 0, 49, 12], strict=True):
        for k in (0, 1, 5):
            got = vl.token_logprob(token, _vllm_position(row, token, k), k)
            assert got == core.token_logprob(raw, token, k)


def test_ties_rank_to_the_lower_id_and_an_outside_token_is_not_an_alternative() -> None:
    scored = {
        9: _Logprob(-2.0, 3),
        4: _Logprob(-1.0, 2),
        8: _Logprob(-1.0, 1),
        1: _Logprob(-0.5, 1),
    }
    got = vl.token_logprob(9, scored, 3)
    assert got.logprob == -2.0
    assert [(t.token_id, t.logprob) for t in got.top] == [(1, -0.5), (4, -1.0), (8, -1.0)]


def test_prompt_first_token_is_unscored_and_missing_scores_are_errors() -> None:
    lp = core.log_softmax(np.arange(10.0))
    tokens = [3, 5, 9]
    scored = [None, _vllm_position(lp, 5, 2), _vllm_position(lp, 9, 2)]
    got = vl.prompt_logprobs(tokens, scored, 2)
    assert got[0] == core.TokenLogprob(3, None)
    assert [g.logprob for g in got[1:]] == [float(lp[5]), float(lp[9])]
    assert [t.token_id for t in got[1].top] == [9, 8]
    with pytest.raises(ValueError, match="prompt log-probabilities"):
        vl.prompt_logprobs(tokens, scored[:2], 2)
    with pytest.raises(ValueError, match="fewer than 2"):
        vl.output_logprobs([5, 9], scored[1:2], 2)
    with pytest.raises(ValueError, match="token 4"):
        vl.token_logprob(4, scored[1], 2)


def test_chunk_stream_carries_each_token_s_and_the_prompt_s_on_the_first_chunk() -> None:
    def lp(token: int) -> common_pb2.TokenLogprob:
        return common_pb2.TokenLogprob(token_id=token, logprob=-float(token))

    prompt = [common_pb2.TokenLogprob(token_id=1), lp(2)]
    s = ChunkStream(lambda ids: "x" * len(ids), first_index=0, max_tokens=9, eos=[99])
    assert s.push([], None, 0.0, (), prompt) == []  # held until a chunk goes out
    (first,) = s.push([5, 6], None, 1.0, [lp(5), lp(6)])
    assert [p.token_id for p in first.prompt_logprobs] == [1, 2]
    assert [(p.token_id, p.logprob) for p in first.logprobs] == [(5, -5.0), (6, -6.0)]
    token, end = s.push([7, 99], "stop", 1.0, [lp(7), lp(99)])  # EOS: not streamed, unscored
    assert ([p.token_id for p in token.logprobs], list(end.logprobs)) == ([7], [])
    assert not token.prompt_logprobs
    assert not end.prompt_logprobs
