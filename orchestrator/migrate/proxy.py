"""The migration proxy: an OpenAI-compatible HTTP front over two upstreams.

Routes: ``POST /v1/chat/completions`` and ``POST /v1/completions`` (routed, relayed, measured),
``GET /v1/models`` (the existing service's answer), ``GET /health`` (the proxy's own state).

**Relaying.** The client's body and headers go to the chosen upstream as they came (hop-by-hop
headers dropped; pdorch gets ``--pdorch-api-key`` when one is set). A streamed request also
asks for ``stream_options.include_usage`` so token counts and pdorch's cost come back; the
usage-only chunk is dropped again when the client did not ask for it. The upstream's status
and body are passed back unchanged — an error stays an error with its status; a refused or
broken connection is a 502 and a timeout a 504, in the OpenAI error shape. A stream that
breaks mid-way ends with an error event and no ``[DONE]``. The response carries
``x-pdorch-migrate-path: existing|pdorch``.

**Shadow.** A sampled request is also sent to pdorch from a background task (at most
``shadow_concurrency`` at once; beyond that it is skipped and counted); the client's answer
never waits for it. When both are done the two
outputs are compared.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from orchestrator.core.idents import shown
from orchestrator.gateway.errors import SERVER, ApiError
from orchestrator.migrate import agreement, policy, sse
from orchestrator.migrate.control import Control
from orchestrator.migrate.policy import Sample

log = logging.getLogger(__name__)

PATH_HEADER = "x-pdorch-migrate-path"
KEY_HEADERS = ("idempotency-key", "x-request-id")
_HOP = {
    "host", "content-length", "connection", "keep-alive", "transfer-encoding", "te",
    "trailer", "upgrade", "proxy-authorization", "proxy-connection", "accept-encoding",
}  # fmt: skip
_DROP_BACK = {"content-length", "content-encoding", "transfer-encoding", "connection", "date",
              "server", "keep-alive"}  # fmt: skip


@dataclass(slots=True)
class Call:
    """One upstream call of one client request."""

    rid: str
    path: str
    """"existing" or "pdorch"."""
    role: str
    stream: bool
    ts: float
    started: float
    """Monotonic time the client's request arrived."""

    def sample(self, status: int, reading: sse.Reading, error: str = "") -> Sample:
        error = error or reading.error or (f"HTTP {status}" if status >= 400 else "")
        ttft, tpot = reading.timings(self.started) if self.stream else (None, None)
        return Sample(
            ts=self.ts,
            request_id=self.rid,
            path=self.path,
            role=self.role,
            stream=self.stream,
            status=status,
            failed=policy.counts_as_failure(status, error),
            error=error[:300],
            ttft_ms=ttft,
            tpot_ms=tpot,
            total_ms=(time.monotonic() - self.started) * 1000,
            prompt_tokens=reading.prompt_tokens,
            completion_tokens=reading.completion_tokens or 0,
            cost_usd=reading.cost_usd,
            text=reading.text[: policy.TEXT_KEPT],
        )


def _api_error(status: int, message: str, code: str) -> JSONResponse:
    return JSONResponse(ApiError(status, message, kind=SERVER, code=code).body(), status)


def _transport_error(exc: httpx.HTTPError) -> tuple[int, str]:
    """(HTTP status for the client, message) for a failed upstream call."""
    if isinstance(exc, httpx.TimeoutException):
        return 504, f"upstream timed out: {type(exc).__name__}"
    return 502, f"upstream unreachable: {type(exc).__name__}: {exc}"


class Proxy:
    def __init__(self, control: Control) -> None:
        self.control = control
        self.settings = control.settings
        up = self.settings.upstreams
        self.urls = {"existing": up.existing, "pdorch": up.pdorch}
        self.http = httpx.AsyncClient(
            timeout=httpx.Timeout(
                connect=up.connect_timeout_s,
                read=up.read_timeout_s,
                write=up.connect_timeout_s,
                pool=up.connect_timeout_s,
            ),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
            follow_redirects=False,
        )
        self._shadow_slots = asyncio.Semaphore(self.settings.shadow_concurrency)
        self._shadows: set[asyncio.Task[None]] = set()
        routes = [
            Route("/v1/chat/completions", self.generate, methods=["POST"]),
            Route("/v1/completions", self.generate, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
        ]
        self.app = Starlette(routes=routes)

    async def stop(self, grace_s: float = 5.0) -> None:
        """Let shadow calls finish for ``grace_s``, cancel the rest, close the client."""
        if self._shadows:
            _, late = await asyncio.wait(self._shadows, timeout=grace_s)
            for task in late:
                task.cancel()
            if late:
                await asyncio.wait(late)
        await self.http.aclose()

    # -------------------------------------------------------------------------- routes

    async def health(self, request: Request) -> Response:
        c = self.control
        return JSONResponse(
            {
                "status": "ok",
                "name": self.settings.name,
                "mode": c.mode,
                "percent": c.percent,
                "sample": c.sample_share,
                "rollbacks": c.rollbacks,
            }
        )

    async def models(self, request: Request) -> Response:
        try:
            resp = await self.http.get(
                self.urls["existing"] + "/v1/models", headers=self._headers(request, "existing")
            )
        except httpx.HTTPError as exc:
            status, message = _transport_error(exc)
            return _api_error(status, message, "upstream_error")
        return Response(resp.content, resp.status_code, headers=_back_headers(resp.headers))

    async def generate(self, request: Request) -> Response:
        started, ts = time.monotonic(), time.time()
        raw = await self._body(request)
        if isinstance(raw, Response):
            return raw
        try:
            body: Any = json.loads(raw)
        except ValueError:
            body = None
        if not isinstance(body, dict):
            # Not ours to judge: the existing service answers it (with its own 400).
            body = {}
        header_key = next((request.headers[h] for h in KEY_HEADERS if request.headers.get(h)), "")
        key = header_key or policy.body_key(raw)
        rid = header_key or uuid.uuid4().hex[:16]
        stream = body.get("stream") is True
        name, c = self.settings.name, self.control
        to_pdorch = c.mode == "canary" and policy.routes_to_pdorch(name, key, c.percent)
        mirror = c.mode == "shadow" and policy.sampled(name, key, c.sample_share)
        client_usage = _asks_usage(body)
        upstream_body = _with_usage(body) if stream and not client_usage else raw
        call = Call(rid, "pdorch" if to_pdorch else "existing", "answer", stream, ts, started)
        log.debug("request %s -> %s (mode %s)", shown(rid), call.path, c.mode)
        existing_text: asyncio.Future[str | None] | None = None
        if mirror:
            existing_text = asyncio.get_running_loop().create_future()
            self._mirror(request, upstream_body, call, existing_text)
        return await self._answer(request, upstream_body, call, not client_usage, existing_text)

    # ----------------------------------------------------------------------- answering

    async def _answer(
        self,
        request: Request,
        body: bytes,
        call: Call,
        strip_usage: bool,
        existing_text: asyncio.Future[str | None] | None,
    ) -> Response:
        def done(sample: Sample) -> None:
            self.control.observe(sample)
            if existing_text is not None and not existing_text.done():
                existing_text.set_result(None if sample.failed or sample.error else sample.text)

        url = self.urls[call.path] + request.url.path
        upstream = self.http.build_request(
            "POST", url, content=body, headers=self._headers(request, call.path)
        )
        try:
            resp = await self.http.send(upstream, stream=True)
        except httpx.HTTPError as exc:
            status, message = _transport_error(exc)
            log.warning("request %s: %s %s", shown(call.rid), call.path, message)
            done(call.sample(0, sse.Reading(), message))
            return _api_error(status, f"{call.path}: {message}", "upstream_error")
        headers = _back_headers(resp.headers) | {PATH_HEADER: call.path}
        is_sse = resp.headers.get("content-type", "").startswith("text/event-stream")
        if not (call.stream and resp.status_code == 200 and is_sse):
            try:
                content = await resp.aread()
            except httpx.HTTPError as exc:
                status, message = _transport_error(exc)
                done(call.sample(0, sse.Reading(), message))
                return _api_error(status, f"{call.path}: {message}", "upstream_error")
            finally:
                await resp.aclose()
            reading = sse.read_whole(content, sse.Reading(), time.monotonic())
            done(call.sample(resp.status_code, reading))
            return Response(content, resp.status_code, headers=headers)
        return StreamingResponse(
            self._relay(resp, call, strip_usage, done),
            status_code=200,
            headers=headers | {"cache-control": "no-cache", "x-accel-buffering": "no"},
            media_type="text/event-stream",
        )

    async def _relay(
        self,
        resp: httpx.Response,
        call: Call,
        strip_usage: bool,
        done: Callable[[Sample], None],
    ) -> AsyncIterator[bytes]:
        reader = sse.StreamReader(strip_usage)
        finished, error = False, ""
        try:
            async for data in resp.aiter_bytes():
                out = reader.feed(data, time.monotonic())
                if out:
                    yield out
                if reader.reading.done:
                    # [DONE] is the end: clients close the connection on it, and waiting
                    # for the upstream's last bytes would race them.
                    break
            rest = reader.close()
            if rest:
                yield rest
            finished = True
        except httpx.HTTPError as exc:
            _, error = _transport_error(exc)
            log.warning("request %s: %s stream broke: %s", shown(call.rid), call.path, error)
            finished = True
            yield sse_error(f"{call.path}: {error}")
        finally:
            await resp.aclose()
            if finished or reader.reading.done:
                done(call.sample(resp.status_code, reader.reading, error))
            else:  # the client went away: not the upstream's failure
                log.info("request %s: client disconnected from %s", shown(call.rid), call.path)
                sample = call.sample(resp.status_code, reader.reading, "client disconnected")
                sample.failed = False
                done(sample)

    # -------------------------------------------------------------------------- shadow

    def _mirror(
        self, request: Request, body: bytes, answer: Call, existing_text: asyncio.Future[str | None]
    ) -> None:
        if self._shadow_slots.locked():
            self.control.skipped_shadow()
            log.info(
                "request %s: shadow skipped (%d in flight)", shown(answer.rid), len(self._shadows)
            )
            return
        call = Call(answer.rid, "pdorch", "shadow", answer.stream, answer.ts, answer.started)
        task = asyncio.create_task(
            self._shadow(request.url.path, self._headers(request, "pdorch"), body, call,
                         existing_text),
            name=f"pdorch-migrate-shadow-{answer.rid}",
        )  # fmt: skip
        self._shadows.add(task)
        task.add_done_callback(self._shadows.discard)

    async def _shadow(
        self,
        path: str,
        headers: dict[str, str],
        body: bytes,
        call: Call,
        existing_text: asyncio.Future[str | None],
    ) -> None:
        async with self._shadow_slots:
            sample = await self._call_through(path, headers, body, call)
        try:
            # The client's answer may still be streaming: wait for it, not forever.
            async with asyncio.timeout(self.settings.upstreams.read_timeout_s):
                reference = await existing_text
        except TimeoutError:
            reference = None
        if reference is not None and not sample.failed and not sample.error:
            a = agreement.compare(reference, sample.text)
            sample.match = a.exact
            sample.char_similarity = a.char_similarity
            sample.token_similarity = a.token_similarity
        self.control.observe(sample)

    async def _call_through(
        self, path: str, headers: dict[str, str], body: bytes, call: Call
    ) -> Sample:
        """One whole call to ``call.path``, read to its end; its sample."""
        url = self.urls[call.path] + path
        try:
            async with self.http.stream("POST", url, content=body, headers=headers) as resp:
                is_sse = resp.headers.get("content-type", "").startswith("text/event-stream")
                if call.stream and resp.status_code == 200 and is_sse:
                    reader = sse.StreamReader(strip_usage=False)
                    async for data in resp.aiter_bytes():
                        reader.feed(data, time.monotonic())
                    reader.close()
                    return call.sample(resp.status_code, reader.reading)
                content = await resp.aread()
                reading = sse.read_whole(content, sse.Reading(), time.monotonic())
                return call.sample(resp.status_code, reading)
        except httpx.HTTPError as exc:
            _, message = _transport_error(exc)
            log.info("request %s: shadow call failed: %s", shown(call.rid), message)
            return call.sample(0, sse.Reading(), message)

    # -------------------------------------------------------------------------- helpers

    async def _body(self, request: Request) -> bytes | Response:
        limit = self.settings.max_body_bytes
        raw = bytearray()
        async for part in request.stream():
            raw += part
            if len(raw) > limit:
                return JSONResponse(
                    ApiError(413, f"request body larger than {limit} bytes", code="too_large")
                    .body(), 413,
                )  # fmt: skip
        return bytes(raw)

    def _headers(self, request: Request, path: str) -> dict[str, str]:
        out = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        out["accept-encoding"] = "identity"
        key = self.settings.upstreams.pdorch_api_key
        if path == "pdorch" and key:
            out = {k: v for k, v in out.items() if k.lower() != "authorization"}
            out["authorization"] = f"Bearer {key}"
        return out


def _back_headers(headers: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in _DROP_BACK}


def _asks_usage(body: Mapping[str, Any]) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


def _with_usage(body: Mapping[str, Any]) -> bytes:
    options = body.get("stream_options")
    merged = (dict(options) if isinstance(options, dict) else {}) | {"include_usage": True}
    return json.dumps(dict(body) | {"stream_options": merged}).encode()


def sse_error(message: str) -> bytes:
    body = ApiError(502, message, kind=SERVER, code="upstream_error").body()
    return b"data: " + json.dumps(body).encode() + b"\n\n"
