"""The gateway's ASGI app over a scripted backend, through httpx's ASGI transport."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import httpx
import pytest

from orchestrator import errors
from orchestrator.control.orchestrator import OutChunk
from orchestrator.gateway.app import Gateway
from orchestrator.gateway.settings import GatewaySettings
from tests.unit.gateway_fakes import FakeBackend, Item, chunks

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
TEXT = {"model": "tiny", "prompt": "hi", "max_tokens": 5, "temperature": 0}


def call(
    backend: FakeBackend,
    method: str,
    path: str,
    body: Any = None,
    *,
    headers: dict[str, str] | None = None,
    content: bytes | None = None,
    settings: GatewaySettings | None = None,
) -> httpx.Response:
    app = Gateway(backend, settings or GatewaySettings()).app

    async def main() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            return await asyncio.wait_for(
                client.request(method, path, json=body, content=content, headers=headers), 10
            )

    return asyncio.run(main())


def post(backend: FakeBackend, path: str, body: Any, **kw: Any) -> httpx.Response:
    return call(backend, "POST", path, body, **kw)


def events(resp: httpx.Response) -> list[Any]:
    assert resp.headers["content-type"].startswith("text/event-stream")
    out = []
    for block in resp.text.split("\n\n"):
        if block:
            data = block.removeprefix("data: ")
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def error_of(resp: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if code is not None:
        assert error["code"] == code
    return dict(error)


# --------------------------------------------------------------------------- success


def test_completion() -> None:
    backend = FakeBackend()
    resp = post(backend, "/v1/completions", TEXT, headers={"Idempotency-Key": "key-1"})
    assert resp.status_code == 200
    assert resp.headers["x-request-id"] == "key-1"
    body = resp.json()
    assert body["id"] == "cmpl-key-1"
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"] == "Hello, world"
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    (inp,) = backend.inputs
    assert (inp.request_id, inp.text, inp.max_tokens) == ("key-1", "hi", 5)
    assert inp.sampling.temperature == 0
    assert backend.closed.is_set()


def test_tenant_from_header_then_user_then_default() -> None:
    backend = FakeBackend(chunks(["a"], finish="length"))
    post(backend, "/v1/chat/completions", CHAT | {"user": "u-1"},
         headers={"x-pdorch-tenant": "team-a"})  # fmt: skip
    post(backend, "/v1/chat/completions", CHAT | {"user": "u-1"})
    post(backend, "/v1/chat/completions", CHAT)
    assert [i.tenant for i in backend.inputs] == ["team-a", "u-1", "default"]
    resp = post(FakeBackend(), "/v1/chat/completions", CHAT | {"user": 7})
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "user"
    resp = post(FakeBackend(), "/v1/chat/completions", CHAT, headers={"x-pdorch-tenant": " "})
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "x-pdorch-tenant"


def test_chat_gets_a_request_id() -> None:
    backend = FakeBackend(chunks(["a", "b"], finish="length"))
    resp = post(backend, "/v1/chat/completions", CHAT)
    assert resp.status_code == 200
    rid = resp.headers["x-request-id"]
    assert len(rid) == 32
    assert backend.inputs[0].request_id == rid
    assert backend.inputs[0].chat == (("user", "hi"),)
    body = resp.json()
    assert body["id"] == f"chatcmpl-{rid}"
    assert body["choices"][0]["message"]["content"] == "ab"
    assert body["choices"][0]["finish_reason"] == "length"


def test_chat_stream_with_usage() -> None:
    backend = FakeBackend()
    body = CHAT | {"stream": True, "stream_options": {"include_usage": True}}
    resp = post(backend, "/v1/chat/completions", body, headers={"X-Request-Id": "abc"})
    assert resp.status_code == 200
    assert resp.headers["x-request-id"] == "abc"
    stream = events(resp)
    assert stream[-1] == "[DONE]"
    deltas = [e["choices"][0]["delta"] for e in stream[:-2]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert "".join(d.get("content", "") for d in deltas) == "Hello, world"
    assert stream[-3]["choices"][0]["finish_reason"] == "stop"
    assert stream[-2]["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    assert backend.closed.is_set()


def test_text_stream() -> None:
    resp = post(FakeBackend(), "/v1/completions", TEXT | {"stream": True})
    stream = events(resp)
    assert [e["choices"][0]["text"] for e in stream[:-1]] == ["Hello", ",", " world", ""]
    assert stream[-2]["choices"][0]["finish_reason"] == "stop"
    assert stream[-1] == "[DONE]"


def test_models_and_health() -> None:
    backend = FakeBackend(models=("tiny",))
    listed = call(backend, "GET", "/v1/models").json()
    assert listed["object"] == "list"
    assert [m["id"] for m in listed["data"]] == ["tiny"]
    assert call(backend, "GET", "/v1/models/tiny").json()["id"] == "tiny"
    error_of(call(backend, "GET", "/v1/models/gpt-5"), 404, "model_not_found")
    assert call(backend, "GET", "/health").json() == {"status": "ok", "models": ["tiny"]}
    error_of(call(FakeBackend(models=()), "GET", "/health"), 503, "unavailable")
    down = FakeBackend(models=errors.UnavailableError("redis unreachable"))
    error_of(call(down, "GET", "/health"), 503, "unavailable")


# ---------------------------------------------------------------------------- errors


def test_unknown_model_and_no_workers() -> None:
    backend = FakeBackend()
    error = error_of(post(backend, "/v1/completions", TEXT | {"model": "gpt-5"}), 404)
    assert (error["code"], error["param"]) == ("model_not_found", "model")
    error_of(post(FakeBackend(models=()), "/v1/completions", TEXT), 503, "unavailable")
    assert backend.inputs == []


def test_unsupported_and_invalid_bodies() -> None:
    backend = FakeBackend()
    error = error_of(post(backend, "/v1/chat/completions", CHAT | {"n": 2}), 400)
    assert error["param"] == "n"
    error_of(post(backend, "/v1/completions", None, content=b"{nope"), 400)
    error_of(post(backend, "/v1/completions", [1, 2]), 400)
    small = GatewaySettings(max_body_bytes=64)
    big = TEXT | {"prompt": "x" * 100}
    error_of(post(backend, "/v1/completions", big, settings=small), 413)
    assert backend.inputs == []


def test_orchestrator_validation_names_the_call_parameter() -> None:
    backend = FakeBackend([errors.InvalidRequestError("prompt", "tokenizes to nothing")])
    error = error_of(post(backend, "/v1/chat/completions", CHAT), 400, "invalid_value")
    assert error["param"] == "messages"
    assert backend.closed.is_set()


@pytest.mark.parametrize("stream", [False, True])
def test_admission_errors_keep_their_status_when_streaming(stream: bool) -> None:
    backend = FakeBackend([errors.OverloadedError("queue full", retry_after_s=1.5)])
    resp = post(backend, "/v1/completions", TEXT | {"stream": stream})
    error_of(resp, 429, "overloaded")
    assert resp.headers["retry-after"] == "2"
    backend = FakeBackend([errors.UnavailableError("no worker could tokenize")])
    error_of(post(backend, "/v1/chat/completions", CHAT | {"stream": stream}), 503)


def failing_midway() -> list[Item]:
    return [OutChunk("r", 0, [1], "Hel"), errors.WorkerError("decode-0", "gone", retryable=True)]


def test_failure_midway_is_never_a_200() -> None:
    backend = FakeBackend(failing_midway())
    error_of(post(backend, "/v1/completions", TEXT), 503, "worker_error")
    assert backend.closed.is_set()


def test_failure_mid_stream_ends_with_an_error_event_and_no_done() -> None:
    backend = FakeBackend(failing_midway())
    resp = post(backend, "/v1/chat/completions", CHAT | {"stream": True})
    assert resp.status_code == 200  # the headers were out before it failed
    stream = events(resp)
    assert "[DONE]" not in stream
    assert stream[-1]["error"]["code"] == "worker_error"
    assert stream[-2]["choices"][0]["delta"] == {"content": "Hel"}
    assert backend.closed.is_set()


def test_cancelled_request() -> None:
    script: list[Item] = [OutChunk("r", 0, [1], "a"), OutChunk("r", 1, [], "", "cancelled")]
    error_of(post(FakeBackend(script), "/v1/completions", TEXT), 409, "request_cancelled")
    stream = events(post(FakeBackend(script), "/v1/completions", TEXT | {"stream": True}))
    assert stream[-1]["error"]["code"] == "request_cancelled"


def test_unexpected_errors_are_500s_in_the_openai_shape() -> None:
    backend = FakeBackend([RuntimeError("bug")])
    error_of(post(backend, "/v1/completions", TEXT), 500, "internal_error")
    backend = FakeBackend([OutChunk("r", 0, [1], "a"), RuntimeError("bug")])
    stream = events(post(backend, "/v1/completions", TEXT | {"stream": True}))
    assert stream[-1]["error"]["code"] == "internal_error"
    backend = FakeBackend([OutChunk("r", 0, [1], "a")])  # ends without a finish
    error_of(post(backend, "/v1/completions", TEXT), 500, "no_finish")


def test_routing_errors_in_the_openai_shape() -> None:
    error_of(call(FakeBackend(), "GET", "/v1/nothing"), 404, "not_found")
    resp = call(FakeBackend(), "GET", "/v1/completions")
    error_of(resp, 405, "method_not_allowed")
    assert "POST" in resp.headers["allow"]


# ------------------------------------------------------------------------------ auth


def test_api_key() -> None:
    keyed = GatewaySettings(api_key="s3cret")
    backend = FakeBackend()
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret"}):
        resp = post(backend, "/v1/completions", TEXT, headers=headers, settings=keyed)
        error_of(resp, 401, "invalid_api_key")
        assert resp.headers["www-authenticate"] == "Bearer"
        error_of(call(backend, "GET", "/v1/models", headers=headers, settings=keyed), 401)
    assert backend.inputs == []
    good = {"Authorization": "Bearer s3cret"}
    assert post(backend, "/v1/completions", TEXT, headers=good, settings=keyed).status_code == 200
    assert call(backend, "GET", "/health", settings=keyed).status_code == 200


def test_usage_carries_the_cost_when_known() -> None:
    """`pdorch migrate` prices pdorch's answers from ``usage.pdorch_cost_usd``."""
    script = chunks(["a", "b"])
    last = script[-1]
    assert isinstance(last, OutChunk)
    assert last.record is not None
    last.record.cost = {"usd": 0.0025, "tenant": "default"}
    resp = post(FakeBackend(script), "/v1/completions", TEXT)
    assert resp.json()["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "total_tokens": 5,
        "pdorch_cost_usd": 0.0025,
    }


def test_a_server_side_failure_is_one_warning_with_the_request_id(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A 5xx is the service's failure: the orchestrator's log says so, with the client's
    id; a 4xx is the client's business and logs nothing."""
    with caplog.at_level(logging.INFO, logger="orchestrator.gateway.app"):
        headers = {"x-request-id": "req-503"}
        backend = FakeBackend(models=())
        error_of(post(backend, "/v1/completions", TEXT, headers=headers), 503, "unavailable")
        error_of(post(FakeBackend(), "/v1/chat/completions", CHAT | {"n": 2}), 400)
    lines = [r for r in caplog.records if r.name == "orchestrator.gateway.app"]
    assert len(lines) == 1, [r.getMessage() for r in lines]
    assert lines[0].levelno == logging.WARNING
    assert "answered 503 (request 'req-503')" in lines[0].getMessage()
