"""The gateway served by uvicorn on loopback (in the test's process, over a scripted backend,
no cluster), used through the official `openai` client: statuses, streams, errors, shutdown."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import openai
import pytest

from orchestrator import errors
from orchestrator.control.orchestrator import OutChunk
from orchestrator.gateway.app import Gateway
from orchestrator.gateway.server import HttpServer
from orchestrator.gateway.settings import GatewaySettings
from tests.unit.gateway_fakes import FakeBackend, chunks

KEY = "test-key"
Scenario = Callable[[openai.AsyncOpenAI, HttpServer], Awaitable[None]]


def serve(backend: FakeBackend, scenario: Scenario, api_key: str = KEY) -> None:
    async def main() -> None:
        app = Gateway(backend, GatewaySettings(api_key=KEY)).app
        server = HttpServer(app, "127.0.0.1", 0, drain_grace_s=1.0)
        await server.start()
        client = openai.AsyncOpenAI(
            base_url=f"{server.url}/v1", api_key=api_key, max_retries=0, timeout=10
        )
        try:
            await asyncio.wait_for(scenario(client, server), 20)
        finally:
            await client.close()
            await server.stop()
            await server.stop()  # idempotent

    asyncio.run(main())


def test_completion_and_chat_whole_and_streamed() -> None:
    async def scenario(client: openai.AsyncOpenAI, server: HttpServer) -> None:
        text = await client.completions.create(model="tiny", prompt="hi", max_tokens=3)
        assert text.choices[0].text == "Hello, world"
        assert text.choices[0].finish_reason == "stop"
        assert text.usage is not None
        assert text.usage.total_tokens == 6
        chat = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        assert chat.choices[0].message.content == "Hello, world"
        stream = await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            stream_options={"include_usage": True},
        )
        parts, usage = [], None
        async for chunk in stream:
            parts += [c.delta.content or "" for c in chunk.choices]
            usage = chunk.usage or usage
        assert "".join(parts) == "Hello, world"
        assert usage is not None
        assert usage.completion_tokens == 3
        texts = [
            c.choices[0].text
            async for c in await client.completions.create(model="tiny", prompt="x", stream=True)
        ]
        assert "".join(texts) == "Hello, world"
        models = await client.models.list()
        assert [m.id for m in models.data] == ["tiny"]

    serve(FakeBackend(), scenario)


def test_errors_as_the_client_raises_them() -> None:
    async def scenario(client: openai.AsyncOpenAI, server: HttpServer) -> None:
        with pytest.raises(openai.NotFoundError) as missing:
            await client.completions.create(model="gpt-5", prompt="hi")
        assert missing.value.code == "model_not_found"
        with pytest.raises(openai.BadRequestError) as bad:
            await client.completions.create(model="tiny", prompt="hi", n=2)
        assert bad.value.param == "n"

    serve(FakeBackend(), scenario)

    async def unauthorized(client: openai.AsyncOpenAI, server: HttpServer) -> None:
        with pytest.raises(openai.AuthenticationError):
            await client.completions.create(model="tiny", prompt="hi")

    serve(FakeBackend(), unauthorized, api_key="wrong")

    async def overloaded(client: openai.AsyncOpenAI, server: HttpServer) -> None:
        with pytest.raises(openai.RateLimitError) as limited:
            await client.completions.create(model="tiny", prompt="hi")
        assert limited.value.response.headers["retry-after"] == "3"

    serve(FakeBackend([errors.OverloadedError("full", retry_after_s=3)]), overloaded)

    async def unavailable(client: openai.AsyncOpenAI, server: HttpServer) -> None:
        with pytest.raises(openai.InternalServerError) as down:
            await client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], stream=True
            )
        assert down.value.status_code == 503

    serve(FakeBackend([errors.UnavailableError("no workers")]), unavailable)


def test_failure_mid_stream_raises_in_the_client() -> None:
    script: list[Any] = [OutChunk("r", 0, [1], "Hel"), errors.UnavailableError("shutting down")]

    async def scenario(client: openai.AsyncOpenAI, server: HttpServer) -> None:
        stream = await client.completions.create(model="tiny", prompt="hi", stream=True)
        seen: list[str] = []

        async def read() -> None:
            async for chunk in stream:
                seen.append(chunk.choices[0].text)

        with pytest.raises(openai.APIError, match="shutting down"):
            await read()
        assert seen == ["Hel"]

    serve(FakeBackend(script), scenario)


def test_client_gone_mid_stream_closes_the_request() -> None:
    backend = FakeBackend(chunks([f"w{i} " for i in range(200)]), delay_s=0.02)

    async def scenario(client: openai.AsyncOpenAI, server: HttpServer) -> None:
        stream = await client.completions.create(model="tiny", prompt="hi", stream=True)
        async for _ in stream:
            break
        await stream.close()
        await asyncio.wait_for(backend.closed.wait(), 5)
        assert backend.sent < 200

    serve(backend, scenario)


def test_stop_cuts_open_streams_after_the_grace() -> None:
    backend = FakeBackend(chunks([f"w{i} " for i in range(10_000)]), delay_s=0.01)

    async def scenario(client: openai.AsyncOpenAI, server: HttpServer) -> None:
        stream = await client.completions.create(model="tiny", prompt="hi", stream=True)
        async for _ in stream:
            break
        loop = asyncio.get_running_loop()
        started = loop.time()
        await server.stop()  # drain_grace_s=1: the stream is cut, the request closed
        assert loop.time() - started < 4
        await asyncio.wait_for(backend.closed.wait(), 5)
        with pytest.raises(openai.APIConnectionError):
            await client.models.list()
        await stream.close()

    serve(backend, scenario)


def test_port_in_use_fails_at_start() -> None:
    async def main() -> None:
        app = Gateway(FakeBackend(), GatewaySettings()).app
        first = HttpServer(app, "127.0.0.1", 0, drain_grace_s=1.0)
        await first.start()
        try:
            second = HttpServer(app, "127.0.0.1", first.port, drain_grace_s=1.0)
            with pytest.raises(OSError, match="in use"):
                await second.start()
        finally:
            await first.stop()

    asyncio.run(main())
