"""`orchestrator.core.sampling`: greedy, nucleus, and the (seed, index) determinism that lets
any worker continue a request exactly where another left it."""

from __future__ import annotations

import math

import numpy as np
import pytest

from orchestrator.api import convert
from orchestrator.core.sampling import (
    FLOAT32_TINY,
    MAX_TEMPERATURE,
    SamplingParams,
    _pick,
    sample,
)

# Probabilities 0.5, 0.3, 0.15, 0.05: nucleus boundaries at 0.5, 0.8, 0.95, 1.0.
PROBS = np.array([0.5, 0.3, 0.15, 0.05])
LOGITS = np.log(PROBS).astype(np.float32)


def _draws(params: SamplingParams, logits: np.ndarray = LOGITS, n: int = 400) -> list[int]:
    return [sample(logits, params, i) for i in range(n)]


@pytest.mark.parametrize(
    ("logits", "expected"),
    [
        ([0.1, 3.0, -1.0], 1),
        ([-5.0, -4.0, -4.5], 1),
        ([2.0, 2.0, 1.0], 0),  # ties go to the lowest id
        ([np.float32(1e-7), 0.0], 0),
    ],
)
def test_greedy_is_argmax(logits: list[float], expected: int) -> None:
    assert sample(np.array(logits, dtype=np.float32), SamplingParams(), 0) == expected


def test_greedy_ignores_seed_and_index() -> None:
    logits = np.random.default_rng(7).standard_normal(1000).astype(np.float32)
    expected = int(np.argmax(logits))
    for seed in (0, 1, 2**62):
        for index in (0, 1, 999):
            assert sample(logits, SamplingParams(seed=seed, top_p=0.5), index) == expected


@pytest.mark.parametrize(
    ("top_p", "allowed"),
    [(0.3, {0}), (0.5, {0}), (0.7, {0, 1}), (0.9, {0, 1, 2}), (1.0, {0, 1, 2, 3})],
)
def test_top_p_keeps_the_smallest_set_reaching_p(top_p: float, allowed: set[int]) -> None:
    draws = _draws(SamplingParams(temperature=1.0, top_p=top_p, seed=3))
    assert set(draws) == allowed  # 400 draws: every allowed token shows up, nothing else


def test_unfiltered_frequencies_follow_the_distribution() -> None:
    draws = np.array(_draws(SamplingParams(temperature=1.0, seed=11), n=4000))
    freq = np.bincount(draws, minlength=4) / len(draws)
    np.testing.assert_allclose(freq, PROBS, atol=0.03)


def test_low_temperature_concentrates_on_the_mode() -> None:
    draws = _draws(SamplingParams(temperature=0.05, seed=5))
    assert draws.count(0) == len(draws)


def test_same_seed_and_index_give_the_same_token() -> None:
    params = SamplingParams(temperature=1.0, seed=42)
    assert _draws(params) == _draws(params)


def test_different_seeds_give_different_streams() -> None:
    a = _draws(SamplingParams(temperature=1.0, seed=1))
    b = _draws(SamplingParams(temperature=1.0, seed=2))
    assert a != b


def test_draw_depends_on_index_not_on_draw_order_or_global_state() -> None:
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=9)
    in_order = {i: sample(LOGITS, params, i) for i in range(200)}
    order = np.random.default_rng(0).permutation(200)
    np.random.seed(123)  # the global numpy RNG must play no part
    shuffled = {}
    for i in order:
        sample(LOGITS, SamplingParams(temperature=1.0, seed=int(i)), int(i))  # unrelated draws
        shuffled[int(i)] = sample(LOGITS, params, int(i))
    assert shuffled == in_order


def test_float32_and_float64_logits_agree() -> None:
    params = SamplingParams(temperature=0.7, top_p=0.9, seed=4)
    assert _draws(params, LOGITS) == _draws(params, LOGITS.astype(np.float64))


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (SamplingParams(temperature=-0.1), "temperature"),
        (SamplingParams(temperature=float("nan")), "temperature"),
        (SamplingParams(top_p=0.0), "top_p"),
        (SamplingParams(top_p=1.5), "top_p"),
        # Finite in a Python float, but inf / 0 in the wire's 32-bit float (QA vLLM #1).
        (SamplingParams(temperature=1e39), "temperature"),
        (SamplingParams(temperature=MAX_TEMPERATURE * 1.001), "temperature"),
        (SamplingParams(temperature=math.inf), "temperature"),
        (SamplingParams(top_p=1e-46), "top_p"),
        (SamplingParams(top_p=FLOAT32_TINY / 2), "top_p"),
        (SamplingParams(seed=-1), "seed"),
        (SamplingParams(seed=2**63), "seed"),
    ],
)
def test_problems_name_the_invalid_field(params: SamplingParams, field: str) -> None:
    assert [f for f, _ in params.problems()] == [field]


_EDGES = [1e-46, FLOAT32_TINY / 2, FLOAT32_TINY, math.nextafter(FLOAT32_TINY, 1.0), 0.1]
_EDGES += [math.nextafter(1.0, 0.0), 1.0, 2.0, MAX_TEMPERATURE, 1e38, 1e39, 3.5e38]


@pytest.mark.parametrize("temperature", [0.0, *_EDGES])
@pytest.mark.parametrize("top_p", _EDGES)
def test_what_the_front_admits_the_worker_accepts(temperature: float, top_p: float) -> None:
    """QA vLLM #1: the fronts check Python floats; the worker gets them through protobuf's
    32-bit ``float`` fields (1e39 arrived as inf, 1e-46 as 0, and the worker refused them).
    Whatever passes the rule must pass it again on the far side."""
    params = SamplingParams(temperature=temperature, top_p=top_p, seed=1)
    if params.problems():
        return
    on_the_wire = convert.sampling_from_pb(convert.sampling_to_pb(params))
    assert on_the_wire.problems() == [], on_the_wire


def test_valid_params_have_no_problems() -> None:
    assert SamplingParams(temperature=1.3, top_p=0.2, seed=2**63 - 1).problems() == []
    assert SamplingParams().greedy
    assert not SamplingParams(temperature=0.1).greedy


def _by_full_sort(logits: np.ndarray, params: SamplingParams, index: int) -> int:
    """The module's definition, computed the plain way: every token ranked."""
    probs = logits.astype(np.float64) / params.temperature
    probs = np.exp(probs - probs.max())
    probs /= probs.sum()
    ranked = np.argsort(-probs, kind="stable")
    running = np.cumsum(probs[ranked])
    mass, end = 1.0, len(ranked)
    if params.top_p < 1.0 and (k := int(np.searchsorted(running, params.top_p))) < end:
        mass, end = float(running[k]), k + 1
    u = np.random.default_rng([params.seed, index]).random()
    at = int(np.searchsorted(running[:end], u * mass, side="right"))
    if at < end:
        return int(ranked[at])
    return int(ranked[:end][probs[ranked[:end]] > 0][-1])


def _vocab(rng: np.random.Generator, kind: str, size: int) -> np.ndarray:
    """Logits shaped like a language model's (a few likely tokens, a long tail), flat ones
    (no token above the first floor), tied ones, and ones with masked (-inf) tokens."""
    if kind == "peaked":
        logits = rng.standard_normal(size) * 2.0
        logits[rng.choice(size, 5, replace=False)] += rng.uniform(6, 12, 5)
    elif kind == "flat":
        logits = rng.standard_normal(size) * 0.1
    elif kind == "tied":
        logits = rng.integers(0, 4, size).astype(np.float64)
    else:  # masked
        logits = rng.standard_normal(size) * 3.0
        logits[rng.random(size) < 0.5] = -np.inf
    return logits.astype(np.float32)


@pytest.mark.parametrize("kind", ["peaked", "flat", "tied", "masked"])
@pytest.mark.parametrize("top_p", [1.0, 0.95, 0.5])
def test_ranking_only_the_top_tokens_draws_what_a_full_sort_draws(kind: str, top_p: float) -> None:
    """`sample` ranks the tokens above a probability floor first and lowers it only when the
    draw falls beyond them; the token is the one the full ranking gives, every time —
    including draws below the first floor (checked to happen), ties and masked tokens."""
    rng = np.random.default_rng([7, len(kind), int(top_p * 100)])
    tail = 0
    for case in range(40):
        logits = _vocab(rng, kind, 49152 if case % 8 == 0 else int(rng.choice([50, 3000])))
        params = SamplingParams(temperature=float(rng.choice([0.5, 1.0, 2.0])), top_p=top_p,
                                seed=int(rng.integers(2**62)))  # fmt: skip
        got, want = sample(logits, params, case), _by_full_sort(logits, params, case)
        assert got == want, (kind, case)
        probs = np.exp((logits.astype(np.float64) - logits.max()) / params.temperature)
        tail += bool(probs[got] / probs.sum() < 1e-4)
    if kind == "flat":  # no token above the first floor in the largest vocabulary
        assert tail > 0, "no draw exercised the lowered floors"


# ------------------------------------------- issue 17 defect 12: the parameters honoured

RNG_LOGITS = (np.random.default_rng(3).standard_normal(300) * 3).astype(np.float32)


def test_defaults_draw_exactly_as_before_the_new_parameters() -> None:
    """top_k 0, min_p 0, penalty 1, min_tokens 0 take the original path: same tokens."""
    p = SamplingParams(temperature=0.8, top_p=0.9, seed=5)
    for i in range(50):
        probs = np.exp((RNG_LOGITS.astype(np.float64) - RNG_LOGITS.max()) / 0.8)
        probs /= probs.sum()
        u = float(np.random.default_rng([5, i]).random())
        assert sample(RNG_LOGITS, p, i) == _pick(probs, 0.9, u)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_top_k_keeps_the_k_most_probable(k: int) -> None:
    draws = _draws(SamplingParams(temperature=1.0, top_k=k, seed=3))
    assert set(draws) == set(range(k))


def test_top_k_then_top_p_renormalises_over_the_k() -> None:
    # top_k 2: candidates 0.5, 0.3 (mass 0.8); top_p 0.6 of 0.8 = 0.48 -> only token 0.
    assert set(_draws(SamplingParams(temperature=1.0, top_k=2, top_p=0.6, seed=1))) == {0}
    # top_p 0.7 of 0.8 = 0.56 -> tokens 0 and 1.
    assert set(_draws(SamplingParams(temperature=1.0, top_k=2, top_p=0.7, seed=1))) == {0, 1}


def test_top_k_frequencies_follow_the_renormalised_distribution() -> None:
    draws = np.array(_draws(SamplingParams(temperature=1.0, top_k=2, seed=11), n=4000))
    freq = np.bincount(draws, minlength=4) / len(draws)
    np.testing.assert_allclose(freq, [0.5 / 0.8, 0.3 / 0.8, 0, 0], atol=0.03)


@pytest.mark.parametrize(("min_p", "allowed"), [(0.2, {0, 1, 2}), (0.5, {0, 1}), (1.0, {0})])
def test_min_p_keeps_tokens_near_the_top(min_p: float, allowed: set[int]) -> None:
    # p_max 0.5: min_p 0.2 keeps p >= 0.1, 0.5 keeps p >= 0.25, 1.0 keeps the top token only
    assert set(_draws(SamplingParams(temperature=1.0, min_p=min_p, seed=2))) == allowed


def test_top_k_ties_go_to_the_lower_id() -> None:
    logits = np.zeros(6, dtype=np.float32)
    assert set(_draws(SamplingParams(temperature=1.0, top_k=2, seed=4), logits)) == {0, 1}


def test_large_vocabulary_top_k_and_min_p_draw_only_candidates() -> None:
    logits = (np.random.default_rng(9).standard_normal(50_000) * 2).astype(np.float32)
    top5 = set(np.argsort(-logits, kind="stable")[:5].tolist())
    draws = _draws(SamplingParams(temperature=1.0, top_k=5, seed=8), logits, n=200)
    assert set(draws) <= top5
    assert len(set(draws)) > 1
    probs = np.exp(logits.astype(np.float64) - logits.max())
    allowed = set(np.flatnonzero(probs >= 0.3).tolist())
    assert set(_draws(SamplingParams(temperature=1.0, min_p=0.3, seed=8), logits)) <= allowed


def test_repetition_penalty_discourages_seen_tokens_greedy_too() -> None:
    logits = np.array([2.0, 1.9, -1.0, -1.1], dtype=np.float32)
    plain = SamplingParams()
    penalised = SamplingParams(repetition_penalty=1.2)
    assert sample(logits, plain, 0, history=[0]) == 0  # no penalty: history unused
    assert sample(logits, penalised, 0, history=[0]) == 1  # 2.0 / 1.2 < 1.9
    assert sample(logits, penalised, 0, history=[5, 7]) == 0  # ids outside: ignored
    negative = np.array([-1.0, -1.1], dtype=np.float32)
    assert sample(negative, penalised, 0, history=[0]) == 1  # -1.0 * 1.2 < -1.1
    assert logits[0] == 2.0  # the caller's buffer is untouched


def test_min_tokens_masks_eos_until_the_index() -> None:
    logits = np.array([0.0, 5.0, 1.0], dtype=np.float32)  # token 1 is EOS, and the argmax
    p = SamplingParams(min_tokens=3)
    assert [sample(logits, p, i, eos=[1]) for i in range(5)] == [2, 2, 2, 1, 1]
    for seed in range(100):
        sampled = SamplingParams(temperature=1.0, min_tokens=3, seed=seed)
        assert 1 not in [sample(logits, sampled, i, eos=[1]) for i in range(3)]


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (SamplingParams(top_k=-1), "top_k"),
        (SamplingParams(min_p=1.5), "min_p"),
        (SamplingParams(min_p=math.nan), "min_p"),
        (SamplingParams(repetition_penalty=0.0), "repetition_penalty"),
        (SamplingParams(repetition_penalty=math.inf), "repetition_penalty"),
        (SamplingParams(min_tokens=-1), "min_tokens"),
        (SamplingParams(logprobs=21), "logprobs"),
        (SamplingParams(prompt_logprobs=-1), "prompt_logprobs"),
    ],
)
def test_new_parameters_are_validated(params: SamplingParams, field: str) -> None:
    assert [f for f, _ in params.problems()] == [field]
