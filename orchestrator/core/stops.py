"""Stop strings over a stream of text deltas: what a client may be given now, and what must
wait because a stop string may begin in it.

The output ends where the first stop string begins, and none of the stop string is
output — however the text is split into chunks. A stop string may begin in one chunk and
end in a later one, and text a client was given cannot be taken back, so the text that
might begin a stop string is *held*: after each chunk the longest end of the text that is
the beginning of some stop string (at most the longest stop string less one character)
waits with the run (`Run.held`, journalled with the chunk: `JournalEntry.held`) until the
next chunk shows whether it starts the stop string (then it is dropped) or not (then it
goes out). The stream's end gives out what is held.

Why the held text is all a search needs: a stop string found later begins in the held text
or after it. One beginning before it would have made a longer end of the text the
beginning of a stop string, and that end would be held.

The tokens a stopped chunk keeps (`tokens_kept`): those up to the one whose text completes
the stop string, as vLLM counts them — the tokens a worker produced after it are not the
client's output (not relayed, journalled or counted), when the worker says where each
token's text ends in the chunk (`TokenChunk.text_ends`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Split:
    """One delta, split: ``out`` for the clients now, ``held`` kept for later; ``stopped``
    when a stop string was found (``out`` ends where it begins, nothing is held), and
    ``stop_end``: where it ends in the delta (characters; 0 when none was found)."""

    out: str
    held: str
    stopped: bool
    stop_end: int = 0


def split(held: str, delta: str, stops: Sequence[str], *, end: bool = False) -> Split:
    """The text before ``delta`` that was held, and ``delta``: what goes out now. At the
    stream's ``end`` (with no stop string found) everything goes out."""
    text = held + delta
    first, length = -1, 0
    for s in stops:
        at = text.find(s) if s else -1
        if at != -1 and (first == -1 or at < first):
            first, length = at, len(s)
    if first != -1:
        # A stop string ends in the delta: none fits in the held text alone (it is shorter).
        return Split(text[:first], "", True, max(first + length - len(held), 0))
    if end:
        return Split(text, "", False)
    keep = _beginning_kept(text, stops)
    return Split(text[: len(text) - keep], text[len(text) - keep :], False)


def tokens_kept(text_ends: Sequence[int], tokens: int, stop_end: int) -> int:
    """Of a chunk's ``tokens`` whose texts end at ``text_ends`` (characters into the chunk's
    text, one per token, not decreasing), how many a stop string ending at ``stop_end``
    keeps: up to the first whose text reaches it. All of them when the ends are not one per
    token (a worker that does not report them) or out of order."""
    if len(text_ends) != tokens or any(b < a for a, b in itertools.pairwise(text_ends)):
        return tokens
    for i, end in enumerate(text_ends):
        if end >= stop_end:
            return i + 1
    return tokens


def found(held: str, delta: str, stops: Sequence[str]) -> bool:
    """Whether ``held`` + ``delta`` holds a stop string (the chunk would end the stream)."""
    text = held + delta
    return any(s and s in text for s in stops)


def _beginning_kept(text: str, stops: Sequence[str]) -> int:
    """The length of the longest end of ``text`` that begins some stop string (shorter than
    that stop string: a whole one would have been found)."""
    longest = max((len(s) for s in stops), default=0)
    for n in range(min(len(text), longest - 1), 0, -1):
        end = text[-n:]
        if any(s.startswith(end) for s in stops if len(s) > n):
            return n
    return 0
