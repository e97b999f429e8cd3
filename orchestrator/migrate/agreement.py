"""How alike two outputs are. Pure.

``exact``: equal strings. ``char_similarity``: difflib's ratio over characters (2·matches /
total length, 1.0 for equal strings). ``token_similarity``: the same over whitespace-separated
words, which ignores how a tokenizer split them. Comparing outputs only says something for
greedy or seeded requests; sampled ones differ by design.
"""

from __future__ import annotations

from dataclasses import dataclass
from difflib import SequenceMatcher

MAX_COMPARED = 2000
"""Characters compared: difflib is quadratic in the worst case, and the samples keep this many."""


@dataclass(frozen=True, slots=True)
class Agreement:
    exact: bool
    char_similarity: float
    token_similarity: float


def compare(a: str, b: str) -> Agreement:
    a, b = a[:MAX_COMPARED], b[:MAX_COMPARED]
    if a == b:
        return Agreement(True, 1.0, 1.0)
    chars = SequenceMatcher(None, a, b, autojunk=False).ratio()
    words = SequenceMatcher(None, a.split(), b.split(), autojunk=False).ratio()
    return Agreement(False, chars, words)
