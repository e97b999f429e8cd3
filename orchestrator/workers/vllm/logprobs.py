"""vLLM's log-probabilities as pdorch's (`orchestrator.core.logprobs`). Pure: no vLLM import.

vLLM returns, per scored position, a mapping token id -> ``Logprob`` (``.logprob``,
``.rank``) holding the ``k`` most probable tokens there and the position's own token. With
``logprobs_mode="raw_logprobs"`` (the host sets it) these are the log-softmax of the model's
raw logits, taken before any logits processor: pdorch's seeded draw (`sampler`), which
masks the logits down to the drawn token, changes none of them — the same numbers the
reference engine computes. The alternatives are re-ranked here most probable first, ties to
the lower id (`core.logprobs.top_of`'s order), so a token outside the top ``k`` but tied with
the last of them ranks as the reference engine ranks it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from orchestrator.core.logprobs import TokenLogprob, TopLogprob


def token_logprob(token: int, scored: Mapping[int, Any] | None, n: int) -> TokenLogprob:
    """``token``'s log-probability at one position, with ``n`` alternatives, from vLLM's
    mapping for that position."""
    if scored is None or token not in scored:
        raise ValueError(f"vLLM returned no log-probability for token {token}")
    ranked = sorted(scored.items(), key=lambda item: (-float(item[1].logprob), int(item[0])))
    top = tuple(TopLogprob(int(i), float(lp.logprob)) for i, lp in ranked[: max(n, 0)])
    return TokenLogprob(int(token), float(scored[token].logprob), top)


def output_logprobs(
    tokens: Sequence[int], scored: Sequence[Mapping[int, Any] | None] | None, n: int
) -> list[TokenLogprob]:
    """Each output token's, from vLLM's list for the same tokens."""
    if scored is None or len(scored) < len(tokens):
        raise ValueError(f"vLLM returned log-probabilities for fewer than {len(tokens)} tokens")
    return [token_logprob(t, s, n) for t, s in zip(tokens, scored, strict=False)]


def prompt_logprobs(
    tokens: Sequence[int], scored: Sequence[Mapping[int, Any] | None] | None, n: int
) -> list[TokenLogprob]:
    """Each prompt token's: vLLM's list has one entry per prompt token, None for the first
    (nothing predicts it), as `core.logprobs.prompt_logprobs` has."""
    if not tokens:
        return []
    if scored is None or len(scored) != len(tokens):
        got = "none" if scored is None else len(scored)
        raise ValueError(f"vLLM returned {got} prompt log-probabilities for {len(tokens)} tokens")
    out = [TokenLogprob(int(tokens[0]), None)]
    out += [token_logprob(t, s, n) for t, s in zip(tokens[1:], scored[1:], strict=True)]
    return out
