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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

_FLOORS = (1e-4, 1e-8, 0.0)
"""Probability floors of the candidates ranked, in turn. Above 1e-4 are at most 10^4 tokens
(usually a few dozen) holding most of the mass at usual temperatures; 0 ranks them all."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 0.0
    """0 means greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p."""
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def problems(self) -> list[tuple[str, str]]:
        """(field, message) for every invalid value; empty when valid."""
        out = []
        if not math.isfinite(self.temperature) or self.temperature < 0:
            out.append(("temperature", "must be a finite number >= 0"))
        if not math.isfinite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            out.append(("top_p", "must be in (0, 1]"))
        if not 0 <= self.seed < 2**63:
            out.append(("seed", "must be in [0, 2^63)"))
        return out


def sample(logits: np.ndarray, params: SamplingParams, index: int) -> int:
    """Pick output token ``index`` from a 1-D array of logits (float32/64)."""
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
    return _pick(probs, params.top_p, u)


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
