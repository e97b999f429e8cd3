"""`orchestrator.core.logprobs` and how log probabilities travel: computed from raw logits,
carried by journal entries (whose old form still reads), and by the record's sampling list
(whose old form and body hash are unchanged). Issue 17 defect 13."""

from __future__ import annotations

import asyncio
import json

import grpc
import numpy as np
import pytest

from orchestrator import errors
from orchestrator.api import convert
from orchestrator.control.clients import translated
from orchestrator.core import logprobs as lps
from orchestrator.core.records import JournalEntry
from orchestrator.core.sampling import SamplingParams
from orchestrator.core.spec import GenerateInput, RequestSpec
from tests.unit.control_fakes import rpc_error

LOGITS = np.log(np.array([0.5, 0.3, 0.15, 0.05])).astype(np.float32)


def test_token_logprob_is_log_softmax_of_raw_logits_with_ranked_alternatives() -> None:
    scored = lps.token_logprob(LOGITS + 7.0, 2, 2)  # a shift changes no probability
    assert scored.token_id == 2
    assert scored.logprob == pytest.approx(np.log(0.15), abs=1e-6)
    assert [t.token_id for t in scored.top] == [0, 1]
    assert [t.logprob for t in scored.top] == pytest.approx(np.log([0.5, 0.3]), abs=1e-6)
    assert lps.token_logprob(LOGITS, 0, 0).top == ()


def test_alternatives_tie_to_the_lower_id() -> None:
    top = lps.top_of(lps.log_softmax(np.zeros(10)), 3)
    assert [t.token_id for t in top] == [0, 1, 2]


def test_prompt_logprobs_score_token_j_plus_1_by_row_j() -> None:
    rows = np.stack([LOGITS, LOGITS[::-1].copy(), LOGITS])
    got = lps.prompt_logprobs(rows, [3, 0, 0], 1)
    assert got[0] == lps.TokenLogprob(3, None)
    assert got[1].logprob == pytest.approx(np.log(0.5), abs=1e-6)  # row 0 scores token 0
    assert got[2].logprob == pytest.approx(np.log(0.05), abs=1e-6)  # row 1 is reversed
    assert got[2].top[0].token_id == 3


def test_named_fills_texts() -> None:
    named = lps.token_logprob(LOGITS, 1, 1).named(lambda t: f"<{t}>")
    assert named.text == "<1>"
    assert named.top[0].text == "<0>"


def test_journal_entry_round_trips_logprobs_and_reads_the_old_form() -> None:
    scored = lps.token_logprob(LOGITS, 1, 2).named(str)
    prompt = (lps.TokenLogprob(5, None, (), "a"), scored)
    entry = JournalEntry(0, (1,), "x", (scored,), prompt)
    assert JournalEntry.from_json(entry.to_json()) == entry
    plain = JournalEntry(3, (4, 5), "yz")
    assert json.loads(plain.to_json()) == [3, [4, 5], "yz"]  # unchanged without logprobs
    assert JournalEntry.from_json('[3, [4, 5], "yz"]') == plain


def test_logprobs_round_trip_through_protobuf() -> None:
    scored = lps.token_logprob(LOGITS, 1, 2).named(str)
    first = lps.TokenLogprob(5, None, (), "a")
    for lp in (scored, first):
        assert convert.logprob_from_pb(convert.logprob_to_pb(lp)) == lp


def test_record_sampling_keeps_old_form_and_hash_and_round_trips_new_fields() -> None:
    inp = GenerateInput(request_id="r", token_ids=(1, 2), sampling=SamplingParams(0.7, 0.5, 42))
    spec = RequestSpec.admitted(inp, "r", (1, 2))
    record = spec.record("me", created_at=0.0)
    assert record.sampling == [0.7, 0.5, 42]  # what older replicas wrote and read
    assert RequestSpec.from_record(record) == spec
    full = SamplingParams(
        0.7,
        0.5,
        42,
        top_k=5,
        min_p=0.1,
        repetition_penalty=1.3,
        min_tokens=2,
        ignore_eos=True,
        logprobs=3,
        prompt_logprobs=0,
    )
    rich = RequestSpec.admitted(
        GenerateInput(request_id="r", token_ids=(1, 2), sampling=full), "r", (1, 2)
    )
    assert RequestSpec.from_record(rich.record("me", created_at=0.0)) == rich
    assert rich.body_hash() != spec.body_hash()


@pytest.mark.parametrize(
    ("details", "field"),
    [
        ("logprobs: not supported by the vLLM engine", "logprobs"),
        ("prompt_logprobs: not supported by the vLLM engine", "prompt_logprobs"),
        ("token_ids: 9000 tokens exceed the context of 8192", "prompt"),
        ("first_index >= max_tokens", "prompt"),
    ],
)
def test_a_worker_refusing_a_parameter_is_an_error_naming_it(details: str, field: str) -> None:
    """A vLLM worker refuses log probabilities with INVALID_ARGUMENT "<parameter>: why";
    the orchestrator names that parameter to its client (the gateway's 400 ``param``)."""

    async def main() -> None:
        with pytest.raises(errors.InvalidRequestError) as info:
            async with translated("d0", "decode"):
                raise rpc_error(grpc.StatusCode.INVALID_ARGUMENT, details)
        assert info.value.field == field

    asyncio.run(main())
