"""The request spec (`orchestrator.core.spec`), failover's retryability table and the shared
protocol constants (`orchestrator.api.protocol`). Pure."""

from __future__ import annotations

import math
from dataclasses import replace

import grpc
import pytest

from orchestrator import errors
from orchestrator.api import protocol
from orchestrator.control.failover import CAUSES, Verdict, retryable, verdict
from orchestrator.core.records import RequestRecord, WorkerInfo
from orchestrator.core.sampling import SamplingParams
from orchestrator.core.spec import ContextExceededError, GenerateInput, RequestLimits, RequestSpec
from orchestrator.core.state import State
from transport import errors as terr

MODEL = WorkerInfo("d0", "decode", "a:1", "a:2", "tcp", "m", "f", 100, 50, 1, 1000)
OK = GenerateInput("r", token_ids=(1, 2), max_tokens=8, stop=("\n",))


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"request_id": "x" * 257}, "request_id"),
        ({"request_id": "\N{SLIGHTLY SMILING FACE}" * 65}, "request_id"),  # 260 bytes
        ({"request_id": "a b"}, "request_id"),
        ({"token_ids": None, "text": "a\ud800"}, "prompt"),
        ({"token_ids": None, "chat": (("user", "\udfff"),)}, "prompt"),
        ({"stop": ("\ud800",)}, "stop"),
        ({"text": "hi"}, "prompt"),  # two prompts
        ({"token_ids": ()}, "prompt"),
        ({"token_ids": None, "text": "  "}, "prompt"),
        ({"token_ids": None, "chat": ()}, "prompt"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2049}, "max_tokens"),
        ({"sampling": SamplingParams(temperature=math.nan)}, "temperature"),
        ({"sampling": SamplingParams(temperature=1e39)}, "temperature"),  # inf as float32
        ({"sampling": SamplingParams(temperature=0.5, top_p=1e-46)}, "top_p"),  # 0 as float32
        ({"stop": ("",)}, "stop"),
        ({"stop": tuple("abcdefghi")}, "stop"),
        ({"chunk_window_ms": 1001}, "chunk_window_ms"),
        ({"chunk_window_ms": -1}, "chunk_window_ms"),
    ],
)
def test_limits_name_the_invalid_field(change: dict[str, object], field: str) -> None:
    with pytest.raises(errors.InvalidRequestError) as err:
        RequestLimits().check(replace(OK, **change))  # type: ignore[arg-type]
    assert err.value.field == field


def test_a_stop_string_refused_says_why() -> None:
    with pytest.raises(errors.InvalidRequestError, match="a stop string may not be empty"):
        RequestLimits().check(replace(OK, stop=("x", "")))
    with pytest.raises(errors.InvalidRequestError, match="at most 8 stop strings, got 9"):
        RequestLimits().check(replace(OK, stop=tuple("abcdefghi")))
    with pytest.raises(errors.InvalidRequestError, match="at most 256 characters, got 257"):
        RequestLimits().check(replace(OK, stop=("x" * 257,)))
    RequestLimits().check(replace(OK, stop=("x" * 256,)))


def test_a_huge_number_refused_is_not_echoed_whole() -> None:
    huge = 10**4000  # a client's JSON integer: no size limit
    with pytest.raises(errors.InvalidRequestError) as info:
        RequestLimits().check(replace(OK, max_tokens=huge))
    assert len(str(info.value)) < 200
    with pytest.raises(errors.InvalidRequestError) as info:
        RequestLimits().check(replace(OK, sampling=replace(OK.sampling, min_tokens=huge)))
    assert len(str(info.value)) < 200


def test_limits_are_settings() -> None:
    RequestLimits().check(OK)
    RequestLimits(max_tokens=8).check(OK)
    with pytest.raises(errors.InvalidRequestError, match=r"\[1, 7\]"):
        RequestLimits(max_tokens=7).check(OK)


def test_the_prompt_is_checked_against_the_model() -> None:
    RequestLimits.check_vocab((0, 49), MODEL)
    with pytest.raises(errors.InvalidRequestError, match="vocabulary"):
        RequestLimits.check_vocab((50,), MODEL)
    RequestLimits.check_prompt((1,) * 92, 8, MODEL)
    with pytest.raises(ContextExceededError, match="context of 100") as info:
        RequestLimits.check_prompt((1,) * 93, 8, MODEL)
    assert (info.value.prompt_tokens, info.value.max_tokens, info.value.context) == (93, 8, 100)
    assert isinstance(info.value, errors.InvalidRequestError)
    assert info.value.field == "prompt"
    with pytest.raises(errors.InvalidRequestError, match="tokenizes to nothing"):
        RequestLimits.check_prompt((), 8, MODEL)


def test_a_resumed_spec_is_the_admitted_one() -> None:
    """Intake and takeover build the same spec; the record's sampling and hash come from it."""
    inp = replace(OK, sampling=SamplingParams(0.7, 0.9, 42), tenant="acme")
    spec = RequestSpec.admitted(inp, "r", (5, 6, 7))
    record = spec.record("owner", created_at=1.0)
    assert (record.state, record.epoch, record.prompt_tokens) == (State.QUEUED, 1, 3)
    assert record.sampling == [0.7, 0.9, 42]
    stored = RequestRecord.from_fields(record.to_fields())
    assert RequestSpec.from_record(stored) == spec
    assert record.body_hash == spec.body_hash()


def test_the_chunk_window_is_how_not_what() -> None:
    """The window a client asks is not part of the body (a resubmission may ask another)
    nor of the record (a replica taking the request over streams at its own)."""
    spec = RequestSpec.admitted(replace(OK, chunk_window_ms=1000), "r", (5, 6))
    assert spec.chunk_window_ms == 1000
    assert spec.body_hash() == replace(spec, chunk_window_ms=0).body_hash()
    stored = RequestRecord.from_fields(spec.record("owner", created_at=1.0).to_fields())
    assert RequestSpec.from_record(stored).chunk_window_ms == 0


def test_the_body_hash_ignores_the_tenant_and_sees_the_body() -> None:
    spec = RequestSpec("r", (1, 2), 8)
    assert replace(spec, tenant="other").body_hash() == spec.body_hash()
    assert replace(spec, max_tokens=9).body_hash() != spec.body_hash()
    assert replace(spec, sampling=SamplingParams(seed=1)).body_hash() != spec.body_hash()


# ------------------------------------------------------------------- retryability


def _worker(phase: str, *, retryable: bool) -> errors.WorkerError:
    return errors.WorkerError("w", "m", retryable=retryable, phase=phase)


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (_worker("decode", retryable=True), True),
        (_worker("decode", retryable=False), False),  # e.g. FAILED_PRECONDITION
        (_worker("prefill", retryable=False), False),
        (_worker("heartbeat", retryable=False), True),  # the watcher gave up on the worker
        (_worker("silence", retryable=False), True),
        (_worker("stream", retryable=False), True),
        (errors.UnavailableError("no workers"), True),
        (errors.OverloadedError("no KV room"), True),
        (errors.StaleEpochError("fenced"), False),
        (errors.LeaseLostError("taken over"), False),
        (errors.RequestEndedError("cancelled elsewhere"), False),
        (errors.InvalidRequestError("prompt", "bad"), False),
        (RuntimeError("bug"), False),
    ],
)
def test_retryability_is_decided_by_type_and_phase(exc: BaseException, expected: bool) -> None:
    assert retryable(exc) is expected


def test_a_call_phase_defers_to_the_status_code() -> None:
    assert verdict(_worker("decode", retryable=True)) is Verdict.BY_STATUS
    assert {"prefill", "decode", "generate", "heartbeat", "other"} <= CAUSES


# ------------------------------------------------------------------------ protocol


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (terr.StaleEpochError("old"), grpc.StatusCode.ABORTED),
        (terr.ChecksumMismatchError("bits"), grpc.StatusCode.DATA_LOSS),
        (terr.TransferTimeoutError("slow"), grpc.StatusCode.DEADLINE_EXCEEDED),
        (terr.PeerLostError("gone"), grpc.StatusCode.UNAVAILABLE),
    ],
)
def test_a_failed_kv_transfer_maps_to_a_retryable_status(
    exc: terr.TransportError, code: grpc.StatusCode
) -> None:
    assert protocol.transport_status(exc) is code
    assert code in protocol.RETRYABLE_CODES  # the orchestrator re-prefills elsewhere


def test_the_kv_receivers_faults_are_blamed_on_it() -> None:
    assert protocol.blames_kv_target(terr.PeerLostError("gone"))
    assert protocol.blames_kv_target(terr.PeerRejectedError("not a decode identity"))
    assert not protocol.blames_kv_target(terr.ChecksumMismatchError("bits"))
