"""Hostile and careless clients of the HTTP gateway (issue 17): uvicorn on loopback serving the
real app over the real control plane (`Orchestrator` with `MemoryStore` and the fake worker
fleet of `tests.unit.control_fakes`), in the test's process. Raw HTTP (httpx, a socket) so a
test can send what no well-behaved client library would."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest

from orchestrator.control.orchestrator import Orchestrator
from orchestrator.gateway import server as http_server
from orchestrator.gateway.app import Gateway
from orchestrator.gateway.backend import OrchestratorBackend
from orchestrator.gateway.parse import MAX_JSON_DEPTH
from orchestrator.gateway.server import HttpServer
from orchestrator.gateway.settings import GatewaySettings
from orchestrator.store.memory import MemoryStore
from tests.unit.control_fakes import FakeFleet, FakeWorker
from tests.unit.test_control_plane import FAST

MODEL = "fake"  # what the fake workers serve
Scenario = Callable[[httpx.AsyncClient, MemoryStore, HttpServer], Awaitable[None]]


def serve(scenario: Scenario, settings: GatewaySettings | None = None) -> None:
    async def main() -> None:
        store = MemoryStore()
        workers = [FakeWorker("p0", "prefill"), FakeWorker("d0", "decode")]
        for w in workers:
            await store.heartbeat(w.info, 1e6)
        orch = Orchestrator(store, FakeFleet(*workers).as_clients(), FAST, "r0")
        server = HttpServer(
            Gateway(OrchestratorBackend(orch), settings or GatewaySettings()).app,
            "127.0.0.1",
            0,
            1.0,
        )
        await server.start()
        try:
            async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
                await asyncio.wait_for(scenario(client, store, server), 20)
        finally:
            await server.stop()
            await orch.stop()

    asyncio.run(main())


def raw_json(text: str) -> dict[str, Any]:
    """Request arguments sending ``text`` as the body, byte for byte."""
    return {"content": text.encode(), "headers": {"content-type": "application/json"}}


def error(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    out: dict[str, Any] = resp.json()["error"]
    return out


# ------------------------------------------------------------- 5: bodies that were 500s


def test_a_lone_surrogate_is_a_400_naming_where() -> None:
    """JSON may escape a lone surrogate ("\\ud800"); Python decodes it into a str that no
    encoder accepts, and the prompt's tokenize request failed with UnicodeEncodeError: 500."""

    async def scenario(client: httpx.AsyncClient, store: MemoryStore, _s: HttpServer) -> None:
        cases = {
            "/v1/completions": (
                f'{{"model": "{MODEL}", "prompt": "hi \\ud800 there"}}',
                "prompt",
            ),
            "/v1/chat/completions": (
                f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "a\\udfff"}}]}}',
                "messages[0].content",
            ),
        }
        for path, (body, param) in cases.items():
            err = error(await client.post(path, **raw_json(body)), 400)
            assert err["param"] == param
            assert "surrogate" in err["message"]
        # anywhere in the body: a key, the model, the user
        for body in (
            f'{{"model": "{MODEL}", "prompt": "x", "\\ud800": 1}}',
            '{"model": "\\ud800", "prompt": "x"}',
            f'{{"model": "{MODEL}", "prompt": "x", "user": "\\udc00"}}',
        ):
            assert (await client.post("/v1/completions", **raw_json(body))).status_code == 400
        assert await store.active() == []

    serve(scenario)


def test_deep_nesting_is_a_400() -> None:
    """100,000 nested arrays made json.loads raise RecursionError: 500."""

    async def scenario(client: httpx.AsyncClient, _store: MemoryStore, _s: HttpServer) -> None:
        for depth in (100_000, MAX_JSON_DEPTH + 1):
            body = f'{{"model": "{MODEL}", "prompt": {"[" * depth}{"]" * depth}}}'
            err = error(await client.post("/v1/completions", **raw_json(body)), 400)
            assert "nests deeper" in err["message"]
        ok = await client.post("/v1/completions", json={"model": MODEL, "prompt": [[1, 2]]})
        assert ok.status_code == 200, ok.text

    serve(scenario)


# --------------------------------------------------------- 3 and 9: the ids' alphabet


def test_idempotency_keys_follow_the_id_rule() -> None:
    """Control characters were accepted and echoed raw in x-request-id; a 65-emoji key passed
    as 260 Latin-1 characters (refused only by length, in characters)."""

    async def scenario(client: httpx.AsyncClient, store: MemoryStore, _s: HttpServer) -> None:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        for key in (b"a\x01b", b"a\x7fb", b"\xf0\x9f\x99\x82" * 65, b"\xff\xfe"):
            resp = await client.post("/v1/completions", json=body, headers={"idempotency-key": key})
            err = error(resp, 400)
            assert err["param"] == "idempotency-key"
            assert "x-request-id" not in resp.headers
        resp = await client.post("/v1/completions", json=body, headers={"x-request-id": b"a\tb"})
        assert error(resp, 400)["param"] == "x-request-id"
        assert await store.active() == []

    serve(scenario)


def test_a_utf8_key_is_the_same_id_as_over_grpc() -> None:
    """The key's bytes were read as Latin-1: "ключ-1" became "ÐºÐ»ÑŽÑ‡-1", another id than
    the same bytes name over gRPC."""

    async def scenario(client: httpx.AsyncClient, store: MemoryStore, _s: HttpServer) -> None:
        key = "ключ-1"
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        resp = await client.post(
            "/v1/completions", json=body, headers={"idempotency-key": key.encode()}
        )
        assert resp.status_code == 200, resp.text
        assert resp.headers.raw  # the echo is the key's own bytes
        assert dict(resp.headers.raw)[b"x-request-id"] == key.encode()
        assert resp.json()["id"] == f"cmpl-{key}"
        assert await store.get(key) is not None
        team = "команда"
        resp = await client.post(
            "/v1/completions",
            json=body | {"max_tokens": 1},
            headers={"x-pdorch-tenant": team.encode(), "idempotency-key": b"k2"},
        )
        assert resp.status_code == 200, resp.text
        record = await store.get("k2")
        assert record is not None
        assert record.tenant == team

    serve(scenario)


# ------------------------------------------------------------------ 8: bounded echoes


def test_errors_do_not_echo_a_megabyte() -> None:
    async def scenario(client: httpx.AsyncClient, _store: MemoryStore, _s: HttpServer) -> None:
        huge = "m" * 1_000_000
        for body in (
            {"model": huge, "prompt": "x"},
            {"model": MODEL, "messages": [{"role": huge, "content": "x"}]},
            {"model": MODEL, "prompt": "x", "user": huge},
        ):
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            resp = await client.post(path, json=body)
            assert 400 <= resp.status_code < 500
            assert len(resp.content) < 1000
        resp = await client.get("/v1/" + "p" * 10_000)
        assert resp.status_code == 404
        assert len(resp.content) < 1000

    serve(scenario)


# ------------------------------------------------------ 10: careless clients, clear words


def test_a_client_dropping_mid_body_is_one_info_line(caplog: pytest.LogCaptureFixture) -> None:
    """It was logged as ERROR with a traceback (and answered 500, to no one)."""

    async def scenario(client: httpx.AsyncClient, _store: MemoryStore, s: HttpServer) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", s.port)
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: 1000\r\n\r\n" + b'{"model": "fake", "pro'
        )
        await writer.drain()
        await asyncio.sleep(0.1)  # the handler is reading the body
        writer.close()
        await writer.wait_closed()
        async with asyncio.timeout(5):
            while not any("disconnected" in r.getMessage() for r in caplog.records):  # noqa: ASYNC110
                await asyncio.sleep(0.02)  # the log is no event: poll it, with a deadline
        del reader

    with caplog.at_level(logging.INFO):
        serve(scenario)
    gone = [r for r in caplog.records if "disconnected" in r.getMessage()]
    assert len(gone) == 1
    assert gone[0].levelno == logging.INFO
    assert gone[0].exc_info is None
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.mark.parametrize(
    ("prompt", "named"),
    [([1, 1.5], "prompt[1] is 1.5"), ([True, 1], "prompt[0] is True"), ([1, "a"], "prompt[1]")],
)
def test_a_bad_token_id_is_named(prompt: list[Any], named: str) -> None:
    """[1, 1.5] and [true, 1] were answered "batched prompts are not supported"."""

    async def scenario(client: httpx.AsyncClient, _store: MemoryStore, _s: HttpServer) -> None:
        resp = await client.post("/v1/completions", json={"model": MODEL, "prompt": prompt})
        err = error(resp, 400)
        assert named in err["message"]
        assert "batch" not in err["message"].split(":")[0]
        assert err["param"] == "prompt"
        assert json.dumps(prompt)  # sent as JSON numbers and booleans

    serve(scenario)


HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"


def test_a_head_sent_a_byte_at_a_time_is_cut_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """Slowloris: the head trickles in, each byte before the last one's deadline. The
    connection is closed at the head's deadline (counted from the connection's start)."""
    monkeypatch.setattr(http_server, "HEAD_TIMEOUT_S", 1.0)

    async def scenario(client: httpx.AsyncClient, store: MemoryStore, s: HttpServer) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", s.port)
        started = asyncio.get_running_loop().time()
        closed = False
        for i in range(40):  # 8 s of trickle at most
            writer.write(b"X-Slow-%d: y\r\n" % i if i else HEAD)
            await writer.drain()
            try:
                if await asyncio.wait_for(reader.read(1), 0.2) == b"":
                    closed = True
                    break
            except TimeoutError:
                continue
        took = asyncio.get_running_loop().time() - started
        writer.close()
        assert closed, "the trickling head was never cut off"
        assert took < 3.0, took
        ok = await client.get("/health")  # the server serves on
        assert ok.status_code == 200

    serve(scenario)


def test_a_body_that_never_ends_is_a_408() -> None:
    async def scenario(client: httpx.AsyncClient, store: MemoryStore, s: HttpServer) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", s.port)
        writer.write(HEAD + b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        status, _, rest = answer.partition(b"\r\n")
        assert status.startswith(b"HTTP/1.1 408"), answer[:200]
        assert b"did not arrive within 1s" in rest

    serve(scenario, GatewaySettings(body_timeout_s=1.0))


def test_past_the_connection_cap_a_request_is_a_503(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http_server, "MAX_CONNECTIONS", 3)

    async def scenario(client: httpx.AsyncClient, store: MemoryStore, s: HttpServer) -> None:
        idle = [await asyncio.open_connection("127.0.0.1", s.port) for _ in range(3)]
        await asyncio.sleep(0.1)
        try:
            resp = await client.get("/health")
            assert resp.status_code == 503
        finally:
            for _, writer in idle:
                writer.close()
        await asyncio.sleep(0.2)
        assert (await client.get("/health")).status_code == 200  # room again

    serve(scenario)
