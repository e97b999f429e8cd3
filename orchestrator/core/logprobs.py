"""Log-probabilities of tokens, as engines compute them and the journal keeps them. Pure.

A token's log-probability is the log-softmax of the model's *raw* logits at its position
(before temperature, penalties, top-k/top-p: what the model predicts, the number
log-likelihood evaluations need), computed in float64. Its alternatives are the ``n`` most
probable tokens there, most probable first, ties to the lower id — the same order as
`orchestrator.core.sampling`'s ranking.

Failover: a token's log-probability travels with it — in the worker's chunk, the journal
entry (`orchestrator.core.records.JournalEntry`) and the client's chunk — so a client that
resumes, or follows the request from another replica, reads exactly what the first stream
carried; nothing already sent is ever recomputed.

`to_json`/`from_json` are the journal's form: ``[id, text, logprob or null, [[id, text,
logprob], ...]]``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np


@dataclass(frozen=True, slots=True)
class TopLogprob:
    token_id: int
    logprob: float
    text: str = ""


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float | None
    """None for the first prompt token (nothing predicts it)."""
    top: tuple[TopLogprob, ...] = ()
    text: str = ""
    """The token alone, detokenized (filled by the worker, which has the tokenizer)."""

    def to_json(self) -> list[Any]:
        return [
            self.token_id,
            self.text,
            self.logprob,
            [[t.token_id, t.text, t.logprob] for t in self.top],
        ]

    @classmethod
    def from_json(cls, item: Sequence[Any]) -> TokenLogprob:
        token_id, text, logprob, top = item
        return cls(
            int(token_id),
            None if logprob is None else float(logprob),
            tuple(TopLogprob(int(i), float(lp), str(t)) for i, t, lp in top),
            str(text),
        )

    def named(self, text_of: Callable[[int], str]) -> TokenLogprob:
        """This with the texts of its token and alternatives filled by ``text_of``."""
        top = tuple(replace(t, text=text_of(t.token_id)) for t in self.top)
        return replace(self, text=text_of(self.token_id), top=top)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """log-softmax of a 1-D or 2-D (positions x vocabulary) array, in float64."""
    x = np.asarray(logits, dtype=np.float64)
    top = x.max(axis=-1, keepdims=True)
    shifted = x - np.where(np.isfinite(top), top, 0.0)
    out: np.ndarray = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    return out


def top_of(lp: np.ndarray, n: int) -> tuple[TopLogprob, ...]:
    """The ``n`` most probable tokens of one position's log-probabilities."""
    if n <= 0:
        return ()
    n = min(n, len(lp))
    part = np.argpartition(-lp, n - 1)[:n]  # a set containing the n best (ties: any)
    floor = lp[part].min()
    ids = np.flatnonzero(lp >= floor)  # every token tied at the boundary, in id order
    ranked = ids[np.argsort(-lp[ids], kind="stable")][:n]
    return tuple(TopLogprob(int(i), float(lp[i])) for i in ranked)


def token_logprob(logits: np.ndarray, token: int, n: int) -> TokenLogprob:
    """``token``'s log-probability under one position's raw ``logits``, with ``n``
    alternatives."""
    lp = log_softmax(logits)
    return TokenLogprob(token, float(lp[token]), top_of(lp, n))


def prompt_logprobs(logits: np.ndarray, tokens: Sequence[int], n: int) -> list[TokenLogprob]:
    """Each prompt token's log-probability: ``logits[j]`` are the raw logits after tokens
    0..j (a prefill's every position), so token j+1 is scored by row j; token 0 has none."""
    if len(tokens) == 0:
        return []
    out = [TokenLogprob(int(tokens[0]), None)]
    lp = log_softmax(logits[: len(tokens) - 1])
    for j, token in enumerate(tokens[1:]):
        out.append(TokenLogprob(int(token), float(lp[j, token]), top_of(lp[j], n)))
    return out
