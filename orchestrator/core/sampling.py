"""Sampling parameters and the deterministic draw. Pure (numpy only).

Determinism across workers: the random draw for output token *i* of a request depends only
on (seed, i) — never on how many draws a process made before — so any worker that continues
a request (after a failover, or a prefill/decode split) continues it identically.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


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
    scaled = logits.astype(np.float64) / params.temperature
    scaled -= scaled.max()
    probs = np.exp(scaled)
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    if params.top_p < 1.0:
        cum = np.cumsum(probs[order])
        keep = int(np.searchsorted(cum, params.top_p) + 1)
        order = order[:keep]
    kept = probs[order] / probs[order].sum()
    rng = np.random.default_rng([params.seed, index])
    return int(order[int(rng.choice(len(order), p=kept))])
