"""The gateway's pure parts: OpenAI JSON → `Call`, chunks → OpenAI JSON/SSE, the error table."""

from __future__ import annotations

import json
from typing import Any

import pytest

from orchestrator import errors
from orchestrator.control.orchestrator import OutChunk
from orchestrator.core.logprobs import TokenLogprob, TopLogprob
from orchestrator.core.records import RequestRecord
from orchestrator.core.spec import MAX_CHUNK_WINDOW_MS, ContextExceededError
from orchestrator.core.state import State
from orchestrator.gateway import parse, render
from orchestrator.gateway.errors import ApiError, api_error_for
from orchestrator.gateway.settings import GatewaySettings

SETTINGS = GatewaySettings(completion_max_tokens=16, chat_max_tokens=100)


def completion(**body: Any) -> parse.Call:
    return parse.parse_completion({"model": "m", "prompt": "hi"} | body, "rid-1", SETTINGS)


def chat(**body: Any) -> parse.Call:
    messages = [{"role": "user", "content": "hi"}]
    return parse.parse_chat({"model": "m", "messages": messages} | body, "rid-1", SETTINGS)


def refused(fn: Any, param: str, **body: Any) -> ApiError:
    with pytest.raises(ApiError) as info:
        fn(**body)
    assert info.value.status == 400
    assert info.value.param == param
    return info.value


# ---------------------------------------------------------------------------- parse


def test_completion_defaults_follow_openai() -> None:
    call = completion()
    assert call.model == "m"
    assert not call.chat
    assert not call.stream
    assert not call.include_usage
    inp = call.inp
    assert inp.request_id == "rid-1"
    assert inp.text == "hi"
    assert inp.chat is None
    assert inp.token_ids is None
    assert inp.max_tokens == 16
    assert inp.sampling.temperature == 1.0
    assert inp.sampling.top_p == 1.0
    assert inp.sampling.seed == parse.seed_for("rid-1")
    assert inp.stop == ()


@pytest.mark.parametrize("fn", [completion, chat])
def test_a_non_streamed_answer_asks_the_longest_chunk_window(fn: Any) -> None:
    """Read only at its end, a non-streamed answer's tokens travel in the fewest messages;
    a streamed one keeps the orchestrator's window."""
    assert fn().inp.chunk_window_ms == MAX_CHUNK_WINDOW_MS
    assert fn(stream=True).inp.chunk_window_ms == 0


def test_completion_parameters() -> None:
    call = completion(
        max_tokens=7,
        temperature=0,
        top_p=0.5,
        seed=42,
        stop="\n",
        stream=True,
        stream_options={"include_usage": True},
        user="tenant-a",
        n=1,
        logprobs=None,
        presence_penalty=0,
    )
    inp = call.inp
    assert (inp.max_tokens, inp.sampling.temperature, inp.sampling.top_p) == (7, 0.0, 0.5)
    assert inp.sampling.seed == 42
    assert inp.stop == ("\n",)
    assert call.stream
    assert call.include_usage


@pytest.mark.parametrize(
    ("prompt", "text", "tokens"),
    [
        ("abc", "abc", None),
        (["abc"], "abc", None),
        ([1, 2, 3], None, (1, 2, 3)),
        ([[4, 5]], None, (4, 5)),
    ],
)
def test_completion_prompt_forms(prompt: Any, text: str | None, tokens: Any) -> None:
    inp = completion(prompt=prompt).inp
    assert (inp.text, inp.token_ids) == (text, tokens)


@pytest.mark.parametrize("prompt", [None, 3, [], ["a", "b"], [[1], [2]], [1, "a"], [True], {}])
def test_completion_bad_prompts(prompt: Any) -> None:
    refused(completion, "prompt", prompt=prompt)


def test_chat_messages_and_max_tokens() -> None:
    messages = [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "ok", "name": "bot"},
    ]
    call = chat(messages=messages, max_tokens=9, stop=["x", "y"])
    assert call.chat
    assert call.inp.chat == (("system", "be brief"), ("user", "ab"), ("assistant", "ok"))
    assert call.inp.max_tokens == 9
    assert call.inp.stop == ("x", "y")
    assert chat().inp.max_tokens == 100
    assert chat(max_tokens=9, max_completion_tokens=3).inp.max_tokens == 3
    assert call.params["prompt"] == "messages"


def test_a_refused_length_names_the_parameter_the_client_sent() -> None:
    """A chat call's length may come as ``max_completion_tokens`` (OpenAI's name today) or
    ``max_tokens``: an error about it names the one the client used."""
    too_long = errors.InvalidRequestError("max_tokens", "must be in [1, 2048], got 0")
    for given in ("max_completion_tokens", "max_tokens"):
        call = chat(**{given: 0})
        assert api_error_for(too_long, call.params).param == given
    assert api_error_for(too_long, completion().params).param == "max_tokens"


def test_a_context_overflow_with_the_default_length_says_it_is_the_default() -> None:
    """QA vLLM #3: a long chat prompt with no ``max_tokens`` was refused citing
    "max_tokens 100" (the gateway's default) as if the client had sent it."""
    exc = ContextExceededError(1631, 100, 1700)
    error = api_error_for(chat().explained(exc), chat().params)
    assert (error.status, error.param) == (400, "messages")
    assert "this gateway's default max_tokens 100 for a chat call that sends none" in (
        error.message
    )
    assert "69 of the model's context of 1700" in error.message
    assert "send max_completion_tokens (or max_tokens) of at most 69" in error.message
    message = completion().explained(ContextExceededError(1690, 16, 1700)).args[0]
    assert "default max_tokens 16 for a completions call" in message
    assert "send max_tokens of at most 10" in message
    full = chat().explained(ContextExceededError(1700, 100, 1700))
    assert "leave no room for output in the model's context of 1700" in str(full)
    assert "max_tokens" not in str(full)
    # The client's own max_tokens, or another error: the orchestrator's words.
    assert chat(max_tokens=100).explained(exc) is exc
    assert chat(max_completion_tokens=100).explained(exc) is exc
    assert completion(max_tokens=100).explained(exc) is exc
    other = errors.InvalidRequestError("prompt", "empty")
    assert chat().explained(other) is other


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([], "messages"),
        ("hi", "messages"),
        (["hi"], "messages[0]"),
        ([{"role": "tool", "content": "x"}], "messages[0].role"),
        ([{"content": "x"}], "messages[0].role"),
        ([{"role": ["user"], "content": "x"}], "messages[0].role"),  # unhashable: not a 500
        ([{"role": {}, "content": "x"}], "messages[0].role"),
        ([{"role": "user", "content": None}], "messages[0].content"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content"),
        ([{"role": "assistant", "content": "", "tool_calls": [{}]}], "messages[0].tool_calls"),
    ],
)
def test_chat_bad_messages(messages: Any, param: str) -> None:
    refused(chat, param, messages=messages)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"n": 2}, "n"),
        ({"n": True}, "n"),
        ({"best_of": 3}, "best_of"),
        ({"suffix": "x"}, "suffix"),
        ({"logprobs": False}, "logprobs"),  # completions take an int: False is not 0 here
        ({"logprobs": 1.5}, "logprobs"),
        ({"echo": 1}, "echo"),
        ({"top_logprobs": 2}, "top_logprobs"),  # chat's: completions count in logprobs
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"top_k": 1.5}, "top_k"),
        ({"min_p": "x"}, "min_p"),
        ({"repetition_penalty": True}, "repetition_penalty"),
        ({"min_tokens": 2.0}, "min_tokens"),
        (
            {"stream": True, "stream_options": {"continuous_usage_stats": 1}},
            "stream_options.continuous_usage_stats",
        ),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"frequency_penalty": 1}, "frequency_penalty"),
        ({"logit_bias": {"1": 5}}, "logit_bias"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"model": ""}, "model"),
        ({"model": 3}, "model"),
        ({"max_tokens": "5"}, "max_tokens"),
        ({"max_tokens": 5.0}, "max_tokens"),
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"temperature": 10**400}, "temperature"),  # past a float's range: not a 500
        ({"top_p": -(10**400)}, "top_p"),
        ({"min_p": 10**400}, "min_p"),
        ({"repetition_penalty": 10**400}, "repetition_penalty"),
        ({"seed": 1.5}, "seed"),
        ({"stop": 3}, "stop"),
        ({"stop": ["a", 1]}, "stop"),
        ({"stream": "yes"}, "stream"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"stream": True, "stream_options": []}, "stream_options"),
        ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options"),
        # vLLM's extensions pdorch does not honour (QA vLLM #2: were 200, unconstrained).
        ({"guided_choice": ["yes", "no"]}, "guided_choice"),
        ({"guided_json": {"type": "object"}}, "guided_json"),
        ({"guided_regex": "[0-9]+"}, "guided_regex"),
        ({"guided_grammar": "root ::= 'a'"}, "guided_grammar"),
        ({"structured_outputs": {"choice": ["a", "b"]}}, "structured_outputs"),
        ({"include_stop_str_in_output": True}, "include_stop_str_in_output"),
        ({"use_beam_search": True}, "use_beam_search"),
        ({"length_penalty": 0.5}, "length_penalty"),
        ({"stop_token_ids": [28]}, "stop_token_ids"),
        ({"bad_words": ["no"]}, "bad_words"),
        ({"truncate_prompt_tokens": 10}, "truncate_prompt_tokens"),
        ({"allowed_token_ids": [1, 2]}, "allowed_token_ids"),
        ({"prompt_logprobs": 1}, "prompt_logprobs"),
        ({"skip_special_tokens": False}, "skip_special_tokens"),
        ({"spaces_between_special_tokens": False}, "spaces_between_special_tokens"),
        ({"add_special_tokens": True}, "add_special_tokens"),
        ({"return_tokens_as_token_ids": True}, "return_tokens_as_token_ids"),
        ({"priority": 1}, "priority"),
        ({"cache_salt": "s"}, "cache_salt"),
        ({"kv_transfer_params": {"do_remote_decode": True}}, "kv_transfer_params"),
        ({"vllm_xargs": {"a": 1}}, "vllm_xargs"),
    ],
)
def test_refused_parameters(body: dict[str, Any], param: str) -> None:
    refused(completion, param, **body)


def test_vllm_extensions_at_their_neutral_values_are_accepted() -> None:
    neutral: dict[str, Any] = {
        "use_beam_search": False,
        "length_penalty": 1.0,
        "stop_token_ids": [],
        "bad_words": [],
        "include_stop_str_in_output": False,
        "skip_special_tokens": True,
        "spaces_between_special_tokens": True,
        "guided_json": None,
        "prompt_logprobs": None,
        "priority": 0,
    }
    completion(**neutral)
    chat(**neutral, add_generation_prompt=True, chat_template_kwargs={})
    refused(chat, "add_generation_prompt", add_generation_prompt=False)
    refused(chat, "chat_template_kwargs", chat_template_kwargs={"enable_thinking": False})
    refused(chat, "continue_final_message", continue_final_message=True)


def test_chat_logprobs_false_is_neutral() -> None:
    call = chat(logprobs=False, tool_choice="none", tools=[])
    assert call.chat
    assert call.inp.sampling.logprobs is None


def test_chat_logprobs_and_top_logprobs_are_honoured() -> None:
    """Issue 17 defect 13: were refused (400)."""
    assert chat(logprobs=True).inp.sampling.logprobs == 0
    assert chat(logprobs=True, top_logprobs=3).inp.sampling.logprobs == 3
    refused(chat, "top_logprobs", top_logprobs=2)  # without logprobs: true
    refused(chat, "echo", echo=True)  # completions only
    assert chat(logprobs=True, top_logprobs=3).params["logprobs"] == "top_logprobs"


def test_completion_logprobs_and_echo_are_honoured() -> None:
    """Issue 17 defect 13: lm-eval's local-completions sends echo + logprobs."""
    call = completion(logprobs=1, echo=True, max_tokens=1)
    assert call.echo
    assert call.inp.sampling.logprobs == 1
    assert call.inp.sampling.prompt_logprobs == 1
    echo_only = completion(echo=True)
    assert echo_only.inp.sampling.logprobs is None
    assert echo_only.inp.sampling.prompt_logprobs == 0  # the prompt's texts, no alternatives
    assert completion(logprobs=2).inp.sampling.prompt_logprobs is None


def test_sampling_extensions_are_honoured_not_ignored() -> None:
    """Issue 17 defect 12: ignore_eos, min_tokens, top_k, min_p, repetition_penalty and
    continuous_usage_stats were accepted and dropped."""
    for fn in (completion, chat):
        p = fn(
            ignore_eos=True, min_tokens=4, top_k=40, min_p=0.05, repetition_penalty=1.3
        ).inp.sampling
        assert (p.ignore_eos, p.min_tokens, p.top_k, p.min_p, p.repetition_penalty) == (
            True,
            4,
            40,
            0.05,
            1.3,
        )
        assert fn(top_k=-1).inp.sampling.top_k == 0  # vLLM's "no limit"
        call = fn(stream=True, stream_options={"continuous_usage_stats": True})
        assert call.continuous_usage
        assert not call.include_usage


def test_request_id_from_headers() -> None:
    assert parse.request_id({"idempotency-key": "k", "x-request-id": "r"}) == "k"
    assert parse.request_id({"x-request-id": " r "}) == "r"
    fresh = {parse.request_id({}) for _ in range(3)}
    assert len(fresh) == 3
    assert all(len(r) == 32 for r in fresh)


def test_seed_depends_on_request_id_only() -> None:
    assert parse.seed_for("a") == parse.seed_for("a") != parse.seed_for("b")
    assert all(0 <= parse.seed_for(str(i)) < 2**63 for i in range(100))


# --------------------------------------------------------------------------- render


def record(prompt_tokens: int) -> RequestRecord:
    return RequestRecord("r", State.DONE, 1, "h", prompt_tokens, 16, 0.0)


def tally_of(*chunks: OutChunk) -> render.Tally:
    tally = render.Tally("r")
    for c in chunks:
        tally.add(c)
    return tally


def test_tally_counts_and_maps_finish() -> None:
    tally = tally_of(
        OutChunk("r", 0, [1, 2], "ab"),
        OutChunk("r", 2, [3], ""),  # an incomplete UTF-8 sequence: a token, no text yet
        OutChunk("r", 3, [4], "c"),
        OutChunk("r", 4, [], "", "eos", record=record(5)),
    )
    assert (tally.text, tally.completion_tokens, tally.prompt_tokens) == ("abc", 4, 5)
    assert tally.finish == "stop"
    assert tally.usage() == {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}


@pytest.mark.parametrize(
    ("ours", "theirs"), [("stop", "stop"), ("eos", "stop"), ("length", "length")]
)
def test_finish_reasons(ours: str, theirs: str) -> None:
    assert tally_of(OutChunk("r", 0, [], "", ours)).finish == theirs


@pytest.mark.parametrize(("reason", "status"), [("cancelled", 409), ("error", 500), ("odd", 500)])
def test_bad_endings_raise(reason: str, status: int) -> None:
    with pytest.raises(ApiError) as info:
        tally_of(OutChunk("r", 0, [1], "a"), OutChunk("r", 1, [], "", reason))
    assert info.value.status == status


def test_whole_completion_and_chat() -> None:
    tally = tally_of(
        OutChunk("r", 0, [1], "hi"), OutChunk("r", 1, [], "", "length", record=record(3))
    )
    text = render.Renderer(False, "m", "r", 7).whole(tally)
    assert text == {
        "id": "cmpl-r",
        "object": "text_completion",
        "created": 7,
        "model": "m",
        "choices": [{"index": 0, "text": "hi", "logprobs": None, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
    }
    message = render.Renderer(True, "m", "r", 7).whole(tally)
    assert message["id"] == "chatcmpl-r"
    assert message["object"] == "chat.completion"
    assert message["choices"][0]["message"] == {
        "role": "assistant",
        "content": "hi",
        "refusal": None,
    }


def events(raw: bytes) -> list[Any]:
    assert raw.endswith(b"\n\n")
    out = []
    for block in raw.decode().split("\n\n")[:-1]:
        assert block.startswith("data: ")
        data = block.removeprefix("data: ")
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_stream_events_chat() -> None:
    r = render.Renderer(True, "m", "r", 7)
    tally = tally_of(
        OutChunk("r", 0, [1], "hi"), OutChunk("r", 1, [], "", "stop", record=record(2))
    )
    opening = r.opening(tally)
    assert opening is not None
    delta = r.delta("hi", OutChunk("r", 0, [1], "hi"), tally)
    assert delta is not None
    stream = events(opening + delta + r.closing(tally, include_usage=True))
    assert [e["choices"][0]["delta"] for e in stream[:3]] == [
        {"role": "assistant", "content": ""},
        {"content": "hi"},
        {},
    ]
    assert [e["choices"][0]["finish_reason"] for e in stream[:3]] == [None, None, "stop"]
    assert all(
        e["object"] == "chat.completion.chunk" and e["id"] == "chatcmpl-r" for e in stream[:4]
    )
    assert stream[3]["choices"] == []
    assert stream[3]["usage"]["total_tokens"] == 3
    assert stream[4] == "[DONE]"


def test_stream_events_text() -> None:
    r = render.Renderer(False, "m", "r", 7)
    tally = tally_of(OutChunk("r", 0, [], "", "eos"))
    assert r.opening(tally) is None
    delta = r.delta("x", OutChunk("r", 0, [5], "x"), tally)
    assert delta is not None
    assert r.delta("", OutChunk("r", 1, [6], ""), tally) is None  # nothing to send
    stream = events(delta + r.closing(tally, include_usage=False))
    assert [e["choices"][0]["text"] for e in stream[:2]] == ["x", ""]
    assert stream[1]["choices"][0]["finish_reason"] == "stop"
    assert stream[2] == "[DONE]"
    error = events(render.error_event(ApiError(503, "gone", kind="server_error")))
    assert error == [
        {"error": {"message": "gone", "type": "server_error", "param": None, "code": None}}
    ]


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("exc", "status", "code"),
    [
        (errors.InvalidRequestError("max_tokens", "too many"), 400, "invalid_value"),
        (errors.ConflictError("same id"), 409, "request_id_conflict"),
        (errors.NotFoundError("no such request"), 404, "request_not_found"),
        (errors.OverloadedError("busy", retry_after_s=2.5), 429, "overloaded"),
        (errors.UnavailableError("no workers"), 503, "unavailable"),
        (errors.DeadlineExceededError("late"), 504, "deadline_exceeded"),
        (errors.RequestEndedError("ended"), 409, "request_ended"),
        (errors.InvalidTransitionError("no"), 409, "conflict"),
        (errors.StaleEpochError("old"), 503, "unavailable"),
        (errors.WorkerError("d-0", "boom", retryable=True), 503, "worker_error"),
        (errors.RequestFailedError("failed before"), 500, "request_failed"),
        (errors.LeaseLostError("taken"), 500, "internal_error"),
        (errors.ConfigError("x", "bad"), 500, "internal_error"),
    ],
)
def test_error_table(exc: errors.PdorchError, status: int, code: str) -> None:
    error = api_error_for(exc)
    assert (error.status, error.code) == (status, code)
    assert error.body() == {
        "error": {"message": str(exc), "type": error.kind, "param": error.param, "code": code}
    }
    assert error.kind == ("invalid_request_error" if status < 429 else error.kind)


def test_error_details() -> None:
    invalid = api_error_for(errors.InvalidRequestError("prompt", "empty"), {"prompt": "messages"})
    assert invalid.param == "messages"
    assert api_error_for(errors.InvalidRequestError("top_p", "bad")).param == "top_p"
    assert api_error_for(errors.OverloadedError("busy", retry_after_s=2.1)).headers() == {
        "Retry-After": "3"
    }
    assert api_error_for(errors.OverloadedError("busy", retry_after_s=0)).headers() == {
        "Retry-After": "1"
    }
    assert ApiError(401, "who").headers() == {"WWW-Authenticate": "Bearer"}
    assert api_error_for(errors.UnavailableError("x")).headers() == {}
    store_away = api_error_for(errors.StoreUnavailableError("request store unreachable"))
    assert (store_away.status, store_away.headers()) == (503, {"Retry-After": "1"})


# ------------------------------------------------------------- log probabilities, usage


def _lp(token: int, text: str, logprob: float | None, *top: tuple[int, str, float]) -> Any:
    return TokenLogprob(token, logprob, tuple(TopLogprob(i, lp, t) for i, t, lp in top), text)


PROMPT_LPS = (_lp(7, "Hello", None), _lp(8, " world", -1.5, (9, " there", -0.5)))
OUT_LP = _lp(3, "!", -0.25, (3, "!", -0.25))


def test_completion_echo_with_logprobs_renders_prompt_then_output() -> None:
    """What lm-eval's local-completions reads: the prompt's tokens and log probabilities
    (the first None), then the generated token's; top_logprobs a dict per token."""
    tally = tally_of(
        OutChunk("r", 0, [3], "!", logprobs=(OUT_LP,), prompt_logprobs=PROMPT_LPS),
        OutChunk("r", 1, [], "", "length", record=record(2)),
    )
    whole = render.Renderer(False, "m", "r", 7, logprobs=True, echo="Hello world").whole(tally)
    choice = whole["choices"][0]
    assert choice["text"] == "Hello world!"
    assert choice["logprobs"] == {
        "tokens": ["Hello", " world", "!"],
        "token_logprobs": [None, -1.5, -0.25],
        "top_logprobs": [None, {" there": -0.5, " world": -1.5}, {"!": -0.25}],
        "text_offset": [0, 5, 11],
    }
    # A token-id prompt has no text at the gateway: the echo is the tokens' texts.
    tally.offset = 0
    ids = render.Renderer(False, "m", "r", 7, logprobs=True, echo="").whole(tally)
    assert ids["choices"][0]["text"] == "Hello world!"
    # echo without logprobs: the text only.
    plain = render.Renderer(False, "m", "r", 7, echo="Hello world").whole(tally)
    assert plain["choices"][0]["logprobs"] is None
    assert plain["choices"][0]["text"] == "Hello world!"


def test_chat_logprobs_render_openai_content_entries() -> None:
    tally = tally_of(
        OutChunk("r", 0, [3], "!", logprobs=(OUT_LP,)),
        OutChunk("r", 1, [], "", "stop", record=record(2)),
    )
    whole = render.Renderer(True, "m", "r", 7, logprobs=True).whole(tally)
    assert whole["choices"][0]["logprobs"] == {
        "content": [
            {
                "token": "!",
                "logprob": -0.25,
                "bytes": [33],
                "top_logprobs": [{"token": "!", "logprob": -0.25, "bytes": [33]}],
            }
        ],
        "refusal": None,
    }
    r = render.Renderer(True, "m", "r", 7, logprobs=True)
    stream_tally = render.Tally("r")
    chunk = OutChunk("r", 0, [3], "", logprobs=(OUT_LP,))  # a token whose text is held back
    stream_tally.add(chunk)
    event = r.delta("", chunk, stream_tally)
    assert event is not None  # its log probability is still sent
    (sent,) = events(event)
    assert sent["choices"][0]["logprobs"]["content"][0]["logprob"] == -0.25


def test_continuous_usage_stats_put_usage_in_every_chunk() -> None:
    """Issue 17 defect 12: stream_options.continuous_usage_stats was ignored."""
    r = render.Renderer(True, "m", "r", 7, continuous_usage=True)
    tally = render.Tally("r", prompt_tokens=4)
    opening = r.opening(tally)
    assert opening is not None
    raw = opening
    for i in range(3):
        chunk = OutChunk("r", i, [i], f"t{i}", prompt_tokens=4)
        text = tally.add(chunk)
        event = r.delta(text, chunk, tally)
        assert event is not None
        raw += event
    tally.add(OutChunk("r", 3, [], "", "length", record=record(4)))
    stream = events(raw + r.closing(tally, include_usage=False))
    usages = [e["usage"] for e in stream[:-1]]
    assert [u["completion_tokens"] for u in usages] == [0, 1, 2, 3, 3]
    assert all(u["prompt_tokens"] == 4 for u in usages)
    assert stream[-1] == "[DONE]"
