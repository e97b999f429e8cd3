"""Stop strings over a stream of deltas (`orchestrator.core.stops`): the text given out is
the whole text cut where the first stop string begins — however it is split into chunks —
none of a stop string is ever given out, and what is held stays shorter than the longest
stop string."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.core import stops


def _cut(whole: str, strings: list[str]) -> tuple[str, bool]:
    at = [whole.find(s) for s in strings if s and s in whole]
    return (whole[: min(at)], True) if at else (whole, False)


@given(
    st.lists(st.text(alphabet="ab<>é😀 ", max_size=6), max_size=12),
    st.lists(st.text(alphabet="ab<>é😀 ", min_size=1, max_size=5), min_size=1, max_size=3),
)
@settings(max_examples=800, deadline=None)
def test_what_is_given_out_is_the_whole_text_cut_at_the_first_stop_string(
    deltas: list[str], strings: list[str]
) -> None:
    held, out, stopped = "", "", False
    for i, delta in enumerate(deltas):
        part = stops.split(held, delta, strings, end=i == len(deltas) - 1)
        out += part.out
        held = part.held
        assert len(held) < max(map(len, strings))
        assert not any(s in out for s in strings)  # never a stop string given out
        if part.stopped:
            stopped = True
            break
    expected, expected_stop = _cut("".join(deltas), strings)
    assert (out + held, stopped) == (expected, expected_stop) or (
        not deltas and (out, stopped) == ("", False)
    )


@pytest.mark.parametrize(
    ("deltas", "strings", "given_out"),
    [
        ([" ", "5", ",", " ", "6"], [" 5"], ""),  # begins in the first chunk: nothing leaks
        ([" ", "5", ",", " ", "6", ",", " ", "7", ","], ["6, 7"], " 5, "),
        ([" ", "5", ",", " ", "6", ",", " ", "7", ","], ["5, 6"], " "),
        (["ab", "c"], ["bd"], "abc"),  # held "b" goes out when "c" shows it is no stop
    ],
)
def test_a_stop_string_spanning_chunks_leaves_nothing_of_itself(
    deltas: list[str], strings: list[str], given_out: str
) -> None:
    held, out = "", ""
    for i, delta in enumerate(deltas):
        part = stops.split(held, delta, strings, end=i == len(deltas) - 1)
        out, held = out + part.out, part.held
        if part.stopped:
            break
    assert out + held == given_out


def test_found_says_whether_the_chunk_completes_a_stop_string() -> None:
    assert stops.found("<<S", "TOP>>", ["<<STOP>>"])
    assert not stops.found("<<S", "TO", ["<<STOP>>"])
    assert not stops.found("abc", "def", [""])  # an empty stop string matches nothing


def test_a_client_that_has_every_token_is_still_owed_the_text_held_until_the_end() -> None:
    """The end gives out the text it held in a chunk with no tokens, at the index after the
    last one: a client resuming with every token is owed it (the journal's readers give it
    too), not one resuming earlier than that chunk's index only."""
    from orchestrator.control.run import OutChunk  # noqa: PLC0415
    from orchestrator.control.sessions import _wanted  # noqa: PLC0415

    held_out = OutChunk("r", 6, [], "<5>")
    assert _wanted(held_out, 6)
    assert _wanted(held_out, 0)
    assert not _wanted(OutChunk("r", 6, [], ""), 6)


@given(
    st.lists(st.text(alphabet="ab<>é😀 ", max_size=3), min_size=1, max_size=12),
    st.text(alphabet="ab<>é😀 ", min_size=1, max_size=4),
    st.data(),
)
@settings(max_examples=800, deadline=None)
def test_a_stopped_chunk_keeps_its_tokens_up_to_the_one_completing_the_stop_string(
    tokens: list[str], stop: str, data: st.DataObject
) -> None:
    """Tokens (their texts) in chunks of any sizes, each chunk saying where its tokens'
    texts end: the tokens counted are those up to the first whose text completes the stop
    string in the whole text (all of them when it never appears)."""
    cuts: list[int] = []
    if len(tokens) > 1:
        cuts = sorted(set(data.draw(st.lists(st.integers(1, len(tokens) - 1), max_size=6))))
    bounds = [0, *cuts, len(tokens)]
    held, counted = "", 0
    for a, b in itertools.pairwise(bounds):
        texts = tokens[a:b]
        ends = [sum(map(len, texts[: i + 1])) for i in range(len(texts))]
        part = stops.split(held, "".join(texts), [stop], end=b == len(tokens))
        held = part.held
        if part.stopped:
            counted += stops.tokens_kept(ends, len(texts), part.stop_end)
            break
        counted += len(texts)
    whole = "".join(tokens)
    if stop in whole:
        stop_end = whole.find(stop) + len(stop)
        expected = next(
            k for k in range(1, len(tokens) + 1) if len("".join(tokens[:k])) >= stop_end
        )
    else:
        expected = len(tokens)
    assert counted == expected


def test_without_one_text_end_per_token_every_token_is_kept() -> None:
    assert stops.tokens_kept([], 4, 3) == 4  # a worker that does not say
    assert stops.tokens_kept([1, 2], 4, 1) == 4  # not one per token
    assert stops.tokens_kept([3, 1, 4, 5], 4, 1) == 4  # out of order
    assert stops.tokens_kept([0, 0, 2, 5], 4, 1) == 3  # tokens without text before it
    assert stops.tokens_kept([1, 2, 3, 4], 4, 9) == 4  # never reached: all
