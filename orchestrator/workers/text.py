"""Incremental detokenisation: text deltas that concatenate to the full output's text."""

from __future__ import annotations

from collections.abc import Callable, Sequence


class TextDeltas:
    """Turns a growing list of output token ids into text deltas.

    Text ending in U+FFFD (a multi-byte character split across tokens) is held back until
    the next token completes it, so deltas never carry half a character. An output that
    ends mid-character (cut by its token limit) ends at its last whole character: the
    unfinished bytes stay in the token ids, never in the text as U+FFFD.
    """

    def __init__(self, detokenize: Callable[[Sequence[int]], str], tokens: Sequence[int] = ()):
        self._detok = detokenize
        self.tokens: list[int] = list(tokens)
        self._emitted = len(self._safe(detokenize(self.tokens))) if self.tokens else 0

    @staticmethod
    def _safe(text: str) -> str:
        return text.rstrip("\ufffd")

    def push(self, new: Sequence[int]) -> str:
        self.tokens.extend(new)
        text = self._safe(self._detok(self.tokens))
        delta = text[self._emitted :]
        self._emitted = max(self._emitted, len(text))
        return delta

    def push_ends(self, new: Sequence[int]) -> tuple[str, list[int]]:
        """`push`, and where each new token's text ends in the delta (characters; a token
        whose text waits for the next one to complete a character ends where the one
        before it did): `TokenChunk.text_ends`. A token at a time beyond the first."""
        if len(new) == 1:
            delta = self.push(new)
            return delta, [len(delta)]
        parts: list[str] = []
        ends: list[int] = []
        end = 0
        for token in new:
            part = self.push([token])
            parts.append(part)
            end += len(part)
            ends.append(end)
        return "".join(parts), ends

    def flush(self) -> str:
        """At the end of the stream: whatever is left but an unfinished last character."""
        text = self._safe(self._detok(self.tokens))
        delta = text[self._emitted :]
        self._emitted = len(text)
        return delta
