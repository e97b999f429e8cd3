"""Incremental detokenisation (`orchestrator.workers.text`) and the plain records
(`orchestrator.core.records`) that travel through the store.

The detokenizer here is a byte-level fake: each token id maps to a few bytes and the text is
their concatenation decoded with ``errors="replace"``, which is exactly how a byte-level BPE
tokenizer shows a character split across tokens (a trailing U+FFFD).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.core.logprobs import TokenLogprob
from orchestrator.core.records import (
    JournalEntry,
    RequestRecord,
    WorkerInfo,
    body_hash,
    unjournalled_after,
)
from orchestrator.core.state import State
from orchestrator.workers.text import TextDeltas

FUZZ = settings(max_examples=200, deadline=None, derandomize=True, database=None)

# "é" is C3 A9, "€" is E2 82 AC, "😀" is F0 9F 98 80.
VOCAB: dict[int, bytes] = {
    1: b"h",
    2: b"i",
    3: b" ",
    4: b"\xc3",
    5: b"\xa9",
    6: b"\xe2",
    7: b"\x82",
    8: b"\xac",
    9: b"\xf0\x9f",
    10: b"\x98\x80",
    11: b"\xff",  # never valid UTF-8
    12: "é".encode(),
}


def detok(ids: Sequence[int]) -> str:
    return b"".join(VOCAB[i] for i in ids).decode("utf-8", errors="replace")


def deltas(tokens: Sequence[Sequence[int]]) -> list[str]:
    """Push each group in turn; the flush comes last."""
    td = TextDeltas(detok)
    return [*(td.push(group) for group in tokens), td.flush()]


# ------------------------------------------------------------------ TextDeltas


def test_ascii_deltas_are_each_tokens_text() -> None:
    assert deltas([[1], [2], [3], [1]]) == ["h", "i", " ", "h", ""]


def test_two_byte_char_split_across_tokens_is_held_back() -> None:
    assert deltas([[1], [4], [5], [2]]) == ["h", "", "é", "i", ""]


def test_three_byte_char_split_three_ways_is_held_back() -> None:
    assert deltas([[6], [7], [8]]) == ["", "", "€", ""]


def test_four_byte_char_split_in_two_is_held_back() -> None:
    assert deltas([[1, 9], [10]]) == ["h", "😀", ""]


def test_several_tokens_in_one_push() -> None:
    assert deltas([[1, 4, 5, 6], [7, 8, 2]]) == ["hé", "€i", ""]


def test_no_delta_carries_half_a_character() -> None:
    for delta in deltas([[4], [5], [6], [7], [8], [9], [10], [12]]):
        assert "\ufffd" not in delta


def test_an_output_cut_mid_character_ends_at_its_last_whole_character() -> None:
    # max_tokens cut "é" after its first byte: no U+FFFD in the text (issue 19: "…🌍🌍�")
    td = TextDeltas(detok)
    assert td.push([1, 4]) == "h"
    assert td.flush() == ""
    assert td.flush() == ""
    assert deltas([[1, 9]]) == ["h", ""]


def test_a_truly_invalid_byte_is_released_with_the_next_text() -> None:
    # A lone 0xFF can never be completed: it shows once real text follows it.
    assert deltas([[11], [1]]) == ["", "\ufffdh", ""]


def test_a_started_character_broken_by_the_next_token_is_released() -> None:
    # C3 followed by "h" is an invalid sequence: the replacement char becomes final text.
    assert deltas([[4], [1]]) == ["", "\ufffdh", ""]


def test_resuming_from_existing_tokens_emits_only_what_follows() -> None:
    td = TextDeltas(detok, [1, 2])
    assert td.tokens == [1, 2]
    assert td.push([3]) == " "


def test_resuming_mid_character_holds_the_partial_back() -> None:
    td = TextDeltas(detok, [1, 4])  # "h" + first byte of "é": only "h" counts as emitted
    assert td.push([5]) == "é"
    assert td.tokens == [1, 4, 5]


def test_push_ends_says_where_each_tokens_text_ends_in_the_delta() -> None:
    td = TextDeltas(detok)
    # "h", the two halves of "é" (the first ends where "h" did), "€" in three, "i"
    assert td.push_ends([1, 4, 5, 6, 7, 8, 2]) == ("hé€i", [1, 1, 2, 2, 2, 3, 4])
    assert td.push_ends([3]) == (" ", [1])
    assert td.push_ends([]) == ("", [])
    assert "".join(deltas([[1, 4, 5, 6, 7, 8, 2], [3]])) == "hé€i "  # as push would


def test_push_of_nothing_is_empty() -> None:
    td = TextDeltas(detok)
    assert td.push([]) == ""
    assert td.push([1]) == "h"
    assert td.push([]) == ""


def test_deltas_concatenate_to_the_full_text() -> None:
    groups = [[1], [4], [5, 6], [7], [8, 9], [10, 11], [2], [4]]
    ids = [i for g in groups for i in g]
    # ... but for a last character left unfinished (4 starts a "é" nothing completes)
    assert "".join(deltas(groups)) == detok(ids).removesuffix("\ufffd")


@FUZZ
@given(
    text=st.text(st.characters(exclude_characters="\ufffd"), max_size=40),
    data=st.data(),
)
def test_random_byte_splits_concatenate_to_the_text(text: str, data: st.DataObject) -> None:
    raw = text.encode()
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(raw) - 1)))) if raw else [])
    pieces = [raw[a:b] for a, b in zip([0, *cuts], [*cuts, len(raw)], strict=True) if a < b]
    vocab = dict(enumerate(pieces))

    def fake(ids: Sequence[int]) -> str:
        return b"".join(vocab[i] for i in ids).decode("utf-8", errors="replace")

    ids = list(vocab)
    sizes = data.draw(st.lists(st.integers(1, 4), min_size=len(ids), max_size=len(ids)))
    td = TextDeltas(fake)
    out: list[str] = []
    at = 0
    for size in sizes:
        if at >= len(ids):
            break
        out.append(td.push(ids[at : at + size]))
        at += size
    out.append(td.push(ids[at:]))
    tail = td.flush()
    assert tail == ""  # valid UTF-8 leaves nothing held back at the end
    assert "".join(out) == text
    assert all("\ufffd" not in d for d in out)


# ------------------------------------------------------------------ RequestRecord


def full_record(state: State = State.DECODING) -> RequestRecord:
    return RequestRecord(
        request_id="req-ü-1",
        state=state,
        epoch=3,
        body_hash="ab" * 16,
        prompt_tokens=17,
        max_tokens=64,
        created_at=1_700_000_000.123456,
        owner="orch-1",
        mode="disaggregated",
        prefill_worker="p1",
        decode_worker="d2",
        output_tokens=12,
        kv_bytes=123_456_789,
        finish_reason="length",
        error='boom: "quoted", comma, newline\n',
        timings={"queue_ms": 0.1, "prefill_ms": 12.5, "ttft_ms": 1 / 3},
    )


@pytest.mark.parametrize("state", list(State))
def test_record_round_trips_through_fields(state: State) -> None:
    record = full_record(state)
    fields = record.to_fields()
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in fields.items())
    assert fields["state"] == state.value
    assert RequestRecord.from_fields(fields) == record


def test_record_fields_are_plain_strings() -> None:
    fields = full_record().to_fields()
    assert fields["epoch"] == "3"
    assert fields["output_tokens"] == "12"
    assert fields["state"] == "decoding"
    assert float(fields["created_at"]) == 1_700_000_000.123456


def test_record_defaults_round_trip() -> None:
    record = RequestRecord("r", State.QUEUED, 0, "h", 5, 8, 0.0)
    assert RequestRecord.from_fields(record.to_fields()) == record


def test_record_from_only_the_required_fields() -> None:
    fields = {
        "request_id": "r",
        "state": "queued",
        "epoch": "2",
        "body_hash": "h",
        "prompt_tokens": "5",
        "max_tokens": "8",
        "created_at": "1.5",
    }
    assert RequestRecord.from_fields(fields) == RequestRecord("r", State.QUEUED, 2, "h", 5, 8, 1.5)


def test_record_from_unknown_state_is_refused() -> None:
    fields = full_record().to_fields()
    fields["state"] = "exploded"
    with pytest.raises(ValueError, match="exploded"):
        RequestRecord.from_fields(fields)


# ------------------------------------------------------------------ WorkerInfo


def test_worker_info_round_trips_through_json() -> None:
    info = WorkerInfo(
        worker_id="d1",
        role="decode",
        address="127.0.0.1:50051",
        kv_address="127.0.0.1:6000",
        transport="ucx",
        model="tiny",
        fingerprint="sha:abc",
        max_context=4096,
        vocab_size=32_000,
        kv_bytes_per_token=1024,
        kv_capacity_bytes=1 << 33,
        kv_used_bytes=1 << 20,
        active=7,
        gpu_kind="H200",
    )
    text = info.to_json()
    assert WorkerInfo.from_json(text) == info
    assert WorkerInfo.from_json(text.encode()) == info
    assert info.kv_free_bytes == (1 << 33) - (1 << 20)


def test_worker_info_json_is_canonical() -> None:
    a = WorkerInfo("w", "prefill", "a:1", "", "tcp", "m", "f", 10, 20, 30, 40)
    b = WorkerInfo("w", "prefill", "a:1", "", "tcp", "m", "f", 10, 20, 30, 40)
    assert a.to_json() == b.to_json()
    assert a.to_json().startswith('{"active": 0, "address": "a:1"')  # sorted keys


# ------------------------------------------------------------------ JournalEntry


@pytest.mark.parametrize(
    "entry",
    [
        JournalEntry(0, (1, 2, 3), "abc"),
        JournalEntry(41, (), ""),
        JournalEntry(7, (128_000,), 'é€😀 "q"\n\\'),
        JournalEntry(3, (5,), "\ufffd"),
    ],
)
def test_journal_entry_round_trips_through_json(entry: JournalEntry) -> None:
    assert JournalEntry.from_json(entry.to_json()) == entry
    assert JournalEntry.from_json(entry.to_json().encode()) == entry
    # Written as json.dumps writes it (journals already in Redis read the same).
    assert entry.to_json() == json.dumps([entry.index, list(entry.token_ids), entry.text])


@given(
    st.integers(0, 2**31),
    st.lists(st.integers(0, 2**31), max_size=8),
    st.text(st.characters(blacklist_categories=()), max_size=40),  # lone surrogates too
)
@settings(max_examples=300)
def test_journal_entry_is_written_as_json_dumps_writes_it(
    index: int, ids: list[int], text: str
) -> None:
    entry = JournalEntry(index, tuple(ids), text)
    assert entry.to_json() == json.dumps([index, ids, text])
    assert JournalEntry.from_json(entry.to_json()) == entry


def test_a_journal_entry_carries_the_finish_of_the_chunk_that_ended_its_request() -> None:
    """The finish rides in the fourth element, beside log-probabilities when there are any;
    a journal written before it existed reads as no finish."""
    ended = JournalEntry(5, (7,), "x", finish="stop")
    assert json.loads(ended.to_json()) == [5, [7], "x", {"finish": "stop"}]
    alone = JournalEntry(6, (), "", finish="eos")
    scored = JournalEntry(0, (1,), "a", (TokenLogprob(1, -0.5),), finish="length")
    for entry in (ended, alone, scored):
        assert JournalEntry.from_json(entry.to_json()) == entry
    assert json.loads(scored.to_json())[3]["finish"] == "length"
    assert JournalEntry.from_json('[5, [7], "x", {"logprobs": [], "prompt": []}]').finish == ""


def test_journal_entry_decodes_to_tuples() -> None:
    got = JournalEntry.from_json('[4, [9, 8], "x"]')
    assert got == JournalEntry(4, (9, 8), "x")
    assert isinstance(got.token_ids, tuple)


_CHUNKS = [JournalEntry(0, (1, 2), "ab"), JournalEntry(2, (3,), "c"), JournalEntry(3, (4,), "d")]


@pytest.mark.parametrize(
    ("journal_end", "pending"),
    [
        (4, 0),  # all landed: the last write's reply was lost (cancelled while awaiting it)
        (3, 1),  # the last chunk is missing
        (2, 2),  # the store lost its last two writes (AOF fsync window)
        (0, 3),  # it lost everything
        (1, None),  # inside a chunk: no resync is safe
        (5, None),  # past what this writer produced: not its journal
    ],
)
def test_unjournalled_after_resyncs_from_the_journal_end(
    journal_end: int, pending: int | None
) -> None:
    assert unjournalled_after(_CHUNKS, journal_end) == pending


def test_unjournalled_after_with_nothing_written() -> None:
    assert unjournalled_after([], 0) is None


# ------------------------------------------------------------------ body_hash


BODY = {"prompt": "hello", "max_tokens": 16, "sampling": {"temperature": 0.0, "seed": 1}}


def test_body_hash_is_pinned() -> None:
    # Stored hashes must stay comparable across processes and releases: pin the format.
    canonical = b'{"max_tokens":16,"prompt":"hello","sampling":{"seed":1,"temperature":0.0}}'
    assert body_hash(BODY) == hashlib.sha256(canonical).hexdigest()[:32]


def test_body_hash_ignores_key_order() -> None:
    reordered = {"sampling": {"seed": 1, "temperature": 0.0}, "max_tokens": 16, "prompt": "hello"}
    assert body_hash(reordered) == body_hash(BODY)


@pytest.mark.parametrize(
    "changed",
    [
        {**BODY, "prompt": "hello!"},
        {**BODY, "max_tokens": 17},
        {**BODY, "sampling": {"temperature": 0.0, "seed": 2}},
        {**BODY, "stop": []},
        {k: v for k, v in BODY.items() if k != "sampling"},
    ],
)
def test_body_hash_changes_with_the_body(changed: dict[str, object]) -> None:
    assert body_hash(changed) != body_hash(BODY)


def test_body_hash_shape() -> None:
    h = body_hash(BODY)
    assert len(h) == 32
    assert all(c in "0123456789abcdef" for c in h)


def test_a_journal_entry_carries_the_text_held_for_a_stop_string() -> None:
    """Text that may begin a stop string (`core.stops`) rides in the fourth element as
    "held" — what a replica taking the request over gives out first; none, none written."""
    waiting = JournalEntry(3, (9,), "ab", held="<s")
    assert json.loads(waiting.to_json()) == [3, [9], "ab", {"held": "<s"}]
    assert JournalEntry.from_json(waiting.to_json()) == waiting
    assert json.loads(JournalEntry(3, (9,), "ab").to_json()) == [3, [9], "ab"]
