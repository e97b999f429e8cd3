"""The gateway's ASGI application (Starlette): routes, auth, and relaying generations.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /v1/models/{model}`` and ``GET /health`` (open, for probes). Every error is answered
in the OpenAI shape through `orchestrator.gateway.errors`. A call may name a model by an
alias (`GatewaySettings.model_aliases`, `served_name`): it is served, and answered, as the
model the alias stands for; ``/v1/models`` lists the served names only.

Auth: with a tokens file (`control.tokens`), every ``/v1`` call needs ``Authorization:
Bearer <token>`` (401 without a listed one) and the tenant comes from the token; a tenant
the call names (``x-pdorch-tenant``, else ``user``) must be one the token allows (403).
Else the optional shared ``api_key``; else the routes are open.

A streamed call reads the request's first chunk *before* it answers, so everything that can
go wrong at admission (validation, backpressure, no workers, a failed prefill) still gets its
own status code; after the headers are out, a failure ends the stream with an error event
and no ``[DONE]``. A body is refused (400) before anything reads it when it is not JSON,
nests too deeply or holds a lone surrogate (`parse.check_json`); a client that disconnects
mid-body costs one INFO line. Client strings in errors and logs go through `idents.shown`.
A client that goes away mid-stream just stops being sent to: its request
keeps running for the orchestrator's detach grace (a retry with the same ``Idempotency-Key``
follows it), then is cancelled.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Collection,
    Mapping,
)
from dataclasses import replace
from typing import Any, Protocol

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from orchestrator import errors
from orchestrator.control.orchestrator import GenerateInput, OutChunk
from orchestrator.core.auth import Caller
from orchestrator.core.idents import shown
from orchestrator.gateway import parse, render
from orchestrator.gateway.errors import SERVER, ApiError, api_error_for
from orchestrator.gateway.settings import GatewaySettings

log = logging.getLogger(__name__)

REQUEST_ID_HEADER = "x-request-id"
"""The response header carrying pdorch's request id (the official client reads it)."""


class Authenticator(Protocol):
    def authenticate(self, authorization: str | None) -> Caller:
        """The caller an ``Authorization`` value proves, else `UnauthenticatedError`."""
        ...


class Backend(Protocol):
    """What the gateway needs from the orchestrator."""

    def generate(self, inp: GenerateInput) -> AsyncIterator[OutChunk]:
        """`control.Orchestrator.generate`: chunks, the last one with a finish reason."""
        ...

    async def models(self) -> list[str]:
        """The names of the models the registered workers serve (empty: no workers)."""
        ...


Handler = Callable[[Request], Awaitable[Response]]


def _error_response(error: ApiError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(
        error.body(), status_code=error.status, headers=error.headers() | (headers or {})
    )


def _log_server_side(request: Request, exc: ApiError) -> None:
    """One line for an answer that is the service's failure, not the client's (5xx: no
    workers, Redis away, a request failed): the operator's log must say so, with the
    request's id when the client gave one (a 4xx is the client's business, not logged)."""
    if exc.status >= 500:
        rid = request.headers.get("idempotency-key") or request.headers.get("x-request-id")
        log.warning(
            "%s %s answered %d%s: %s",
            request.method,
            shown(request.url.path),
            exc.status,
            f" (request {shown(rid)})" if rid else "",
            shown(exc.message),
        )


def _answering_errors(handler: Handler) -> Handler:
    """Answer `ApiError`s and orchestrator errors in the OpenAI shape; anything else is a
    bug, logged, and a 500 in the same shape."""

    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except ApiError as exc:
            _log_server_side(request, exc)
            return _error_response(exc)
        except errors.PdorchError as exc:
            failed = api_error_for(exc)
            _log_server_side(request, failed)
            return _error_response(failed)
        except ClientDisconnect:
            # The client's business: it went away mid-request (its body unread). Nobody
            # reads this answer; nginx would log 499.
            log.info("%s %s: client disconnected", request.method, shown(request.url.path))
            return _error_response(ApiError(400, "client disconnected"))
        except Exception:
            log.exception("%s %s failed", request.method, shown(request.url.path))
            return _error_response(_internal())

    return wrapped


def _internal() -> ApiError:
    return ApiError(500, "internal error", kind=SERVER, code="internal_error")


class _EventStream(StreamingResponse):
    """A server-sent event stream that closes its source however the response ends (done,
    failed, client gone, server shutting down) — so the request is detached at once."""

    def __init__(
        self, events: AsyncIterator[bytes], source: AsyncIterator[OutChunk], rid: str
    ) -> None:
        super().__init__(
            events,
            media_type="text/event-stream",
            headers={
                REQUEST_ID_HEADER: parse.header_value(rid),
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
            },
        )
        self._source = source

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await _close(self._source)


async def _close(source: AsyncIterator[OutChunk]) -> None:
    if isinstance(source, AsyncGenerator):
        await source.aclose()


class Gateway:
    """The routes over one `Backend`; `app` is the ASGI application."""

    def __init__(
        self, backend: Backend, settings: GatewaySettings, tokens: Authenticator | None = None
    ) -> None:
        if tokens is not None and settings.api_key:
            raise ValueError("a tokens file and a shared API key exclude each other")
        self.backend = backend
        self.settings = settings
        self.tokens = tokens
        routes = [
            Route("/v1/completions", _answering_errors(self.completions), methods=["POST"]),
            Route("/v1/chat/completions", _answering_errors(self.chat), methods=["POST"]),
            Route("/v1/models", _answering_errors(self.models), methods=["GET"]),
            Route("/v1/models/{model:path}", _answering_errors(self.model), methods=["GET"]),
            Route("/health", _answering_errors(self.health), methods=["GET"]),
        ]
        self.app = Starlette(routes=routes, exception_handlers={HTTPException: _http_error})

    # ------------------------------------------------------------------------- routes

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def models(self, request: Request) -> Response:
        self._authorize(request)
        names = await self.backend.models()
        return JSONResponse({"object": "list", "data": [_model_card(n) for n in names]})

    async def model(self, request: Request) -> Response:
        """A served model's card; an alias's is its served model's (the name it stands for)."""
        self._authorize(request)
        name = request.path_params["model"]
        served = served_name(name, await self.backend.models(), self.settings.model_aliases)
        if served is None:
            raise _model_not_found(name)
        return JSONResponse(_model_card(served))

    async def health(self, request: Request) -> Response:
        """Ready: the store answers and at least one worker is registered (else 503)."""
        names = await self.backend.models()
        if not names:
            raise api_error_for(errors.UnavailableError("no workers registered"))
        return JSONResponse({"status": "ok", "models": names})

    # ---------------------------------------------------------------------- generation

    async def _generate(self, request: Request, *, chat: bool) -> Response:
        caller = self._authorize(request)
        body = await self._body(request)
        rid = parse.request_id(request.headers)
        reader = parse.parse_chat if chat else parse.parse_completion
        call = reader(body, rid, self.settings)
        tenant = self._tenant(request, caller, body)
        call = replace(call, inp=replace(call.inp, tenant=tenant))
        model = await self._served_model(call.model)
        renderer = render.Renderer(
            chat,
            model,
            rid,
            int(time.time()),
            logprobs=call.logprobs,
            echo=(call.inp.text or "") if call.echo else None,
            continuous_usage=call.continuous_usage,
        )
        tally = render.Tally(rid)
        source = self.backend.generate(call.inp)
        try:
            first = await _next(source, call)
        except BaseException:
            await _close(source)
            raise
        if call.stream:
            events = _events(source, first, renderer, tally, call)
            return _EventStream(events, source, rid)
        try:
            chunk: OutChunk | None = first
            while chunk is not None:
                tally.add(chunk)
                chunk = None if tally.finish else await _next(source, call)
        finally:
            await _close(source)
        return JSONResponse(
            renderer.whole(tally), headers={REQUEST_ID_HEADER: parse.header_value(rid)}
        )

    def _authorize(self, request: Request) -> Caller | None:
        """The caller (with a tokens file), else None once the shared key (if any) matched;
        a refusal is a 401 logged with the peer's address, never the credential."""
        if self.tokens is not None:
            try:
                return self.tokens.authenticate(request.headers.get("authorization"))
            except errors.UnauthenticatedError as exc:
                log.warning(
                    "%s %s: refused a call from %s: %s",
                    request.method,
                    shown(request.url.path),
                    _peer(request),
                    exc,
                )
                raise ApiError(401, f"{exc}", code="invalid_api_key") from None
        key = self.settings.api_key
        if not key:
            return None
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not given:
            raise ApiError(
                401,
                "You didn't provide an API key: send 'Authorization: Bearer <key>'.",
                code="invalid_api_key",
            )
        if not hmac.compare_digest(given.strip().encode(), key.encode()):
            log.warning(
                "%s %s: refused a call from %s: wrong API key",
                request.method,
                shown(request.url.path),
                _peer(request),
            )
            raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key")
        return None

    def _tenant(self, request: Request, caller: Caller | None, body: dict[str, Any]) -> str:
        """The call's tenant: with a tokens file, the token's, or the one ``x-pdorch-tenant``
        (else the body's ``user``) picks among those the token allows — any other is a 403,
        logged with the peer; without one, the header's or ``user``'s word (`parse.tenant`)."""
        named = parse.tenant(request.headers, body)
        if caller is None:
            return named
        claimed = parse.TENANT_HEADER in request.headers or body.get("user") is not None
        where = parse.TENANT_HEADER if parse.TENANT_HEADER in request.headers else "user"
        try:
            return caller.tenant_for(named if claimed else None, where)
        except errors.PermissionDeniedError as exc:
            log.warning(
                "%s %s: refused a call from %s (%s): %s",
                request.method,
                shown(request.url.path),
                _peer(request),
                caller.name,
                exc,
            )
            raise ApiError(403, str(exc), param=where, code="tenant_not_allowed") from None

    async def _body(self, request: Request) -> dict[str, Any]:
        limit = self.settings.max_body_bytes
        too_large = ApiError(413, f"request body larger than {limit} bytes", code="too_large")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_large
        raw = bytearray()
        deadline = self.settings.body_timeout_s
        try:
            async with asyncio.timeout(deadline):
                async for part in request.stream():
                    raw += part
                    if len(raw) > limit:
                        raise too_large
        except TimeoutError:
            raise ApiError(
                408, f"the request body did not arrive within {deadline:g}s", code="timeout"
            ) from None
        try:
            body = json.loads(raw)
        except ValueError:
            raise ApiError(400, "the request body is not valid JSON") from None
        except RecursionError:  # the parser's own stack: nesting in the thousands
            raise ApiError(
                400, f"the request body nests deeper than {parse.MAX_JSON_DEPTH} levels"
            ) from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        parse.check_json(body)
        return body

    async def _served_model(self, name: str) -> str:
        """The served model a call's ``model`` names (`served_name`): what it is answered
        with; 503 without workers, 404 for a name no worker serves."""
        names = await self.backend.models()
        if not names:
            raise errors.UnavailableError("no workers registered")
        served = served_name(name, names, self.settings.model_aliases)
        if served is None:
            raise _model_not_found(name)
        return served


def served_name(name: str, served: Collection[str], aliases: Mapping[str, str]) -> str | None:
    """The served model ``name`` stands for: itself when a worker serves it under that
    name, else the model it is an alias of (`GatewaySettings.model_aliases`) when that is
    served; None when neither. The one place a model name is read: gRPC's Generate names
    no model."""
    if name in served:
        return name
    target = aliases.get(name)
    return target if target is not None and target in served else None


async def _next(source: AsyncIterator[OutChunk], call: parse.Call) -> OutChunk:
    """The next chunk; orchestrator errors become `ApiError`s named in the call's terms."""
    try:
        return await anext(source)
    except StopAsyncIteration:
        raise ApiError(
            500, "the request ended without a finish", kind=SERVER, code="no_finish"
        ) from None
    except errors.PdorchError as exc:
        raise api_error_for(call.explained(exc), call.params) from exc


async def _events(
    source: AsyncIterator[OutChunk],
    first: OutChunk,
    renderer: render.Renderer,
    tally: render.Tally,
    call: parse.Call,
) -> AsyncIterator[bytes]:
    if first.prompt_tokens:
        tally.prompt_tokens = first.prompt_tokens
    opening = renderer.opening(tally)
    if opening is not None:
        yield opening
    chunk = first
    try:
        while True:
            text = tally.add(chunk)
            event = renderer.delta(text, chunk, tally)
            if event is not None:
                yield event
            if tally.finish:
                break
            chunk = await _next(source, call)
    except ApiError as exc:
        log.info("request %s failed mid-stream: %s", tally.request_id, exc)
        yield render.error_event(exc)
        return
    except Exception:
        log.exception("request %s: stream failed", tally.request_id)
        yield render.error_event(_internal())
        return
    yield renderer.closing(tally, call.include_usage)


def _peer(request: Request) -> str:
    client = request.client
    return "unknown" if client is None else f"{client.host}:{client.port}"


def _model_card(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "pdorch"}


def _model_not_found(name: str) -> ApiError:
    return ApiError(
        404,
        f"The model {shown(name)} does not exist: see GET /v1/models",
        param="model",
        code="model_not_found",
    )


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own errors (no such route, wrong method) in the OpenAI shape."""
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    detail = exc.detail if isinstance(exc, HTTPException) else "internal error"
    code = {404: "not_found", 405: "method_not_allowed"}.get(status)
    headers = dict(exc.headers or {}) if isinstance(exc, HTTPException) else {}
    return _error_response(
        ApiError(status, f"{request.method} {shown(request.url.path)}: {detail}", code=code),
        headers,
    )
