"""Sampling parameters and the deterministic draw. Pure (numpy only).

Determinism across workers: the random draw for output token *i* of a request depends only
on (seed, i) — never on how many draws a process made before — so any worker that continues
a request (after a failover, or a prefill/decode split) continues it identically. Every
engine draws with `sample`: the reference engine in its decode loop, vLLM through
`orchestrator.workers.vllm.sampler` (a logits processor inside vLLM's worker process).

The draw, defined so that it can be computed exactly without sorting the whole vocabulary:

1. p = softmax(logits / temperature) in float64 (normalised by the sum in vocabulary order);
2. tokens are ranked by p, highest first, ties to the lower id; c_k is the running sum of the
   ranked p (accumulated in rank order);
3. the nucleus is the ranks up to the first k with c_k >= top_p, with mass M = c_k (top_p = 1,
   or no rank reaching it: every token, M = 1);
4. u = ``numpy.random.default_rng([seed, i]).random()``; the token is the first rank with
   c_k > u * M (float rounding can leave none: then the nucleus's last token with p > 0).

Only the ranks up to the chosen one matter, and the tokens with p >= some floor are always a
prefix of the ranking, with the same running sums as in a full sort; so `sample` ranks the
tokens above `_FLOORS[0]` first and lowers the floor only when the draw falls beyond them
(measured, SmolLM2's 49k vocabulary inside vLLM: ~0.3 ms a draw, most of it the softmax;
ranking the whole vocabulary took ~5 ms).

Before step 1, two rules that depend on the token history (the prompt and the output tokens
before *i* — which a continuing worker has too, so they keep the draw a function of the
request alone): ``repetition_penalty`` r divides the positive logits of every token in the
history by r and multiplies the negative ones by r (transformers' and vLLM's rule); while
i < ``min_tokens`` the model's end-of-sequence tokens are masked out. Both apply to greedy
requests too (the argmax of the processed logits).

``top_k`` and ``min_p`` narrow the ranking before the nucleus: only the k highest ranks, and
only tokens with p >= min_p * max(p), are candidates; ``top_p`` then applies to the
candidates' distribution (renormalised: the nucleus ends at the first rank whose running sum
reaches top_p * C, C the candidates' mass — vLLM's order: top-k, then top-p), and the draw
picks the first rank with c_k > u * M. Without top_k and min_p the draw is exactly steps 1-4.

``ignore_eos`` and the log-probability counts (``logprobs``, ``prompt_logprobs``) change no
draw; they travel with the sampling parameters because every engine needs them where it
draws (`orchestrator.core.logprobs` computes the log-probabilities).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

_FLOORS = (1e-4, 1e-8, 0.0)
"""Probability floors of the candidates ranked, in turn. Above 1e-4 are at most 10^4 tokens
(usually a few dozen) holding most of the mass at usual temperatures; 0 ranks them all."""

MAX_LOGPROBS = 20
"""Most alternatives a request may ask per token (OpenAI's ``top_logprobs`` bound; vLLM's
default ``max_logprobs``)."""
MAX_REPETITION_PENALTY = 100.0
MAX_TEMPERATURE = 100.0
"""Highest ``temperature`` a request may ask: far past any useful one (at 100 a 49k
vocabulary's draw is all but uniform), and a bound that survives the wire's 32-bit float
(1e39 would arrive as inf)."""
FLOAT32_TINY = 2.0**-126
"""The smallest normal 32-bit float (~1.18e-38), the least ``top_p`` may be: ``temperature``
and ``top_p`` travel in protobuf ``float`` fields, where a smaller positive value becomes a
subnormal, or 0 (out of its rule: a worker would refuse what the front admitted)."""


SEED_LIMIT = 2**63
"""Seeds are in [0, 2^63): a signed 64-bit integer on every wire and in every engine."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 0.0
    """0 means greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p."""
    seed: int = 0
    top_k: int = 0
    """Only the k most probable tokens are candidates; 0: no limit."""
    min_p: float = 0.0
    """Only tokens with probability >= min_p * the top token's are candidates; 0: no limit."""
    repetition_penalty: float = 1.0
    """> 1 discourages tokens already in the prompt or output; 1: off."""
    min_tokens: int = 0
    """End-of-sequence tokens are masked until this many output tokens exist."""
    ignore_eos: bool = False
    """An end-of-sequence token does not end the request (it is output like any other)."""
    logprobs: int | None = None
    """Report each output token's log-probability with this many alternatives; None: off."""
    prompt_logprobs: int | None = None
    """The same for the prompt's tokens (completions' ``echo``); None: off."""

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def processes_logits(self) -> bool:
        """Whether the draw changes logits before choosing (penalty, EOS mask): a greedy
        request is then more than the model's argmax."""
        return self.repetition_penalty != 1.0 or self.min_tokens > 0

    def problems(self) -> list[tuple[str, str]]:
        """(field, message) for every invalid value; empty when valid."""
        out = []
        # Both bounds are 32-bit floats: every value inside them rounds to one inside them
        # (rounding is monotonic), so what a front admits a worker accepts.
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:  # NaN fails too
            out.append(("temperature", f"must be in [0, {MAX_TEMPERATURE:g}]"))
        if not FLOAT32_TINY <= self.top_p <= 1.0:
            out.append(("top_p", f"must be in (0, 1], at least {FLOAT32_TINY:.8g}"))
        if not 0 <= self.seed < SEED_LIMIT:
            out.append(("seed", "must be in [0, 2^63)"))
        if not 0 <= self.top_k < 2**31:
            out.append(("top_k", "must be >= 0 (0: no limit)"))
        if not math.isfinite(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            out.append(("min_p", "must be in [0, 1]"))
        r = self.repetition_penalty
        if not math.isfinite(r) or not 0.0 < r <= MAX_REPETITION_PENALTY:
            out.append(("repetition_penalty", f"must be in (0, {MAX_REPETITION_PENALTY:g}]"))
        if not 0 <= self.min_tokens < 2**31:
            out.append(("min_tokens", "must be >= 0"))
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            if n is not None and not 0 <= n <= MAX_LOGPROBS:
                out.append((name, f"must be in [0, {MAX_LOGPROBS}]"))
        return out


def sample(
    logits: np.ndarray,
    params: SamplingParams,
    index: int,
    history: Sequence[int] = (),
    eos: Sequence[int] = (),
) -> int:
    """Pick output token ``index`` from a 1-D array of logits (float32/64). ``history``: the
    tokens before it (prompt and earlier outputs), for ``repetition_penalty``; ``eos``: the
    model's end-of-sequence ids, masked while ``index < min_tokens``."""
    if params.processes_logits:
        logits = _processed(logits, params, index, history, eos)
    if params.greedy:
        return int(np.argmax(logits))
    probs = logits.astype(np.float64)  # one buffer, computed in place
    probs /= params.temperature
    top = probs.max()
    if not np.isfinite(top):  # every token masked (-inf), or junk: nothing to draw from
        return int(np.argmax(logits))
    probs -= top
    np.exp(probs, out=probs)
    probs /= probs.sum()
    u = float(np.random.default_rng([params.seed, index]).random())
    kept = _candidates(probs, params)
    if kept is None:
        return _pick(probs, params.top_p, u)
    return _pick_among(probs, kept, params.top_p, u)


def _processed(
    logits: np.ndarray,
    params: SamplingParams,
    index: int,
    history: Sequence[int],
    eos: Sequence[int],
) -> np.ndarray:
    """A copy of ``logits`` with the history's penalty and the EOS mask applied."""
    out = np.array(logits, dtype=np.float32)  # the engine's buffer stays as it was
    if params.repetition_penalty != 1.0 and len(history):
        seen = np.unique(np.asarray(history, dtype=np.int64))
        seen = seen[(seen >= 0) & (seen < len(out))]
        values = out[seen]
        out[seen] = np.where(
            values > 0, values / params.repetition_penalty, values * params.repetition_penalty
        )
    if index < params.min_tokens and len(eos):
        ids = np.asarray(eos, dtype=np.int64)
        out[ids[(ids >= 0) & (ids < len(out))]] = -np.inf
    return out


def _candidates(probs: np.ndarray, params: SamplingParams) -> tuple[float, int] | None:
    """(floor, count): the candidates are the ``count`` highest ranks among the tokens with
    p >= floor — None when top_k and min_p leave every token in."""
    n = len(probs)
    count = params.top_k if 0 < params.top_k < n else n
    floor = params.min_p * float(probs.max()) if params.min_p > 0 else 0.0
    if count < n:  # the k-th largest p: every token at or above it ranks among the first k
        floor = max(floor, float(np.partition(probs, n - count)[n - count]))
    if count == n and floor <= 0.0:
        return None
    return floor, count


def _pick_among(probs: np.ndarray, kept: tuple[float, int], top_p: float, u: float) -> int:
    """The draw over the candidates ``kept`` (`_candidates`), top_p renormalised to them."""
    floor, count = kept
    ids = np.flatnonzero(probs >= floor)
    ranked = ids[np.argsort(-probs[ids], kind="stable")][:count]
    running = np.cumsum(probs[ranked])
    last = len(running) - 1
    if top_p < 1.0:
        last = min(last, int(np.searchsorted(running, top_p * float(running[-1]))))
        running = running[: last + 1]
    at = int(np.searchsorted(running, u * float(running[-1]), side="right"))
    return int(ranked[min(at, last)])  # past the end only by rounding: the last candidate


def _pick(probs: np.ndarray, top_p: float, u: float) -> int:
    """Steps 2-4 of the module's definition, over the most probable tokens first."""
    for floor in _FLOORS:
        ids = np.flatnonzero(probs >= floor)  # ascending ids: the stable sort ranks ties so
        ranked = ids[np.argsort(-probs[ids], kind="stable")]
        running = np.cumsum(probs[ranked])
        complete = len(ranked) == len(probs)
        mass, last = 1.0, -1
        if top_p < 1.0:
            end = int(np.searchsorted(running, top_p))  # first running sum >= top_p
            if end < len(running):
                mass, last = float(running[end]), end
                running = running[: end + 1]
            elif not complete:
                continue
        at = int(np.searchsorted(running, u * mass, side="right"))  # first sum > u * M
        if at < len(running):
            return int(ranked[at])
        if last >= 0:  # rounding: u * M came out as M
            return int(ranked[last])
        if complete:
            return int(ranked[np.flatnonzero(probs[ranked] > 0)[-1]])
    raise AssertionError("the last floor ranks every token")  # pragma: no cover
