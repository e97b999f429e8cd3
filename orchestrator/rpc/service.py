"""The client-facing gRPC service: protobuf in, `control.Orchestrator` calls, protobuf out.

What a client sends is held to one set of rules, `orchestrator.core.idents`: tenants here,
request ids where `control` admits or looks up a request (the same check serves the HTTP
gateway). Requests protobuf cannot decode are answered by the `RefuseUndecodable`
interceptor, which `server` installs; with a tokens file, `rpc.auth.Authenticate` in front
of it, and the tenant comes from the credential (`_tenant`): GetRequest and Cancel of
another tenant's request answer NOT_FOUND, as an unknown id does. The call's deadline
travels with the input: a request whose deadline passes before it is created is refused
(DEADLINE_EXCEEDED) and nothing runs for it. Client strings in logs go through `shown`; a
request sent without an id is named on arrival (`many.named`), so every log line about it
carries the id it runs under.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc

from orchestrator import errors
from orchestrator.api import convert, orchestrator_pb2, orchestrator_pb2_grpc
from orchestrator.api.many import StreamAborted, served
from orchestrator.api.peers import RequirePeer
from orchestrator.api.protocol import ACCEPTED_KEY
from orchestrator.api.undecodable import RefuseUndecodable
from orchestrator.control.orchestrator import GenerateInput, Orchestrator, OutChunk
from orchestrator.core.idents import check_tenant, shown
from orchestrator.core.peers import Surface
from orchestrator.core.records import RequestRecord
from orchestrator.rpc.auth import Authenticate, Authenticator, caller
from orchestrator.rpc.many import GenerateMany, ManyCalls, named
from orchestrator.rpc.status import status_for

log = logging.getLogger(__name__)
Context = grpc.aio.ServicerContext[Any, Any]


TENANT_KEY = "x-pdorch-tenant"
GENERATE_MANY = "/pdorch.v1.Orchestrator/GenerateMany"
RETRY_AFTER_KEY = "retry-after"
"""Trailing metadata of a refusal worth trying again (RESOURCE_EXHAUSTED: load;
UNAVAILABLE: the request store away, e.g. a Redis primary failing over): seconds before a
retry can succeed. Without it an error is not one a client should retry as it is."""


def server(
    orchestrator: Orchestrator,
    options: Sequence[tuple[str, Any]] = (),
    tokens: Authenticator | None = None,
    *,
    client_certs: bool = False,
    calls: ManyCalls | None = None,
) -> grpc.aio.Server:
    """A gRPC server serving the client API over ``orchestrator`` (requests protobuf cannot
    decode answer INVALID_ARGUMENT); with ``tokens``, every call but health checks needs a
    bearer token (`rpc.auth`); with ``client_certs`` (the caller serves a mutual-TLS port),
    the caller's certificate must be a client identity (`api.peers`: a worker's is
    refused); ``calls``: where its ``GenerateMany`` calls are kept, for the caller to drain
    them as it stops. The caller adds ports and other services."""
    interceptors: list[Any] = [RequirePeer(Surface.CLIENT_API)] if client_certs else []
    if tokens is not None:
        interceptors.append(Authenticate(tokens))
    interceptors.append(RefuseUndecodable())
    out = grpc.aio.server(options=options, interceptors=interceptors)
    service = OrchestratorService(orchestrator, calls)
    orchestrator_pb2_grpc.add_OrchestratorServicer_to_server(service, out)
    return out


def _claimed(context: Context) -> str | None:
    """The tenant the call metadata names (None: none)."""
    for key, value in context.invocation_metadata() or ():
        if key == TENANT_KEY:
            try:
                return value.decode() if isinstance(value, bytes) else str(value)
            except UnicodeDecodeError:
                raise errors.InvalidRequestError(TENANT_KEY, "not valid UTF-8") from None
    return None


def _tenant(context: Context) -> str:
    """The call's tenant. Authenticated: the token's, or the one ``x-pdorch-tenant`` picks
    among those the token allows (`Caller.tenant_for`; any other: PERMISSION_DENIED, logged
    with the peer). Open API: the header's word ("default" without one)."""
    claimed = _claimed(context)
    who = caller()
    if who is None:
        return "default" if claimed is None else check_tenant(claimed, TENANT_KEY)
    try:
        return who.tenant_for(claimed, TENANT_KEY)
    except errors.PermissionDeniedError as exc:
        log.warning("refused a call from %s (%s): %s", context.peer(), who.name, exc)
        raise


def _tenants() -> frozenset[str] | None:
    """The tenants whose requests the caller may see and cancel (None: the API is open)."""
    who = caller()
    return None if who is None else who.tenants


def _deadline(context: Context) -> float | None:
    """The call's deadline (`time.monotonic` seconds), if it has one."""
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


def _input(
    req: orchestrator_pb2.GenerateRequest, tenant: str = "default", deadline: float | None = None
) -> GenerateInput:
    which = req.WhichOneof("prompt")
    return GenerateInput(
        request_id=req.request_id,
        text=req.text if which == "text" else None,
        chat=tuple((m.role, m.content) for m in req.chat.messages) if which == "chat" else None,
        token_ids=tuple(req.tokens.ids) if which == "tokens" else None,
        max_tokens=req.max_tokens,
        sampling=convert.sampling_from_pb(req.sampling),
        stop=tuple(req.stop),
        resume_from=req.resume_from_index,
        tenant=tenant,
        chunk_window_ms=req.chunk_window_ms,
        deadline=deadline,
    )


def info_pb(r: RequestRecord) -> orchestrator_pb2.RequestInfo:
    return orchestrator_pb2.RequestInfo(
        request_id=r.request_id,
        state=str(r.state),
        epoch=r.epoch,
        prefill_worker=r.prefill_worker,
        decode_worker=r.decode_worker,
        timings=convert.timings_to_pb(r.timings),
        prompt_tokens=r.prompt_tokens,
        output_tokens=r.output_tokens,
        finish_reason=convert.finish_to_pb(r.finish_reason),
        error=r.error,
        kv_bytes=r.kv_bytes,
        mode=r.mode,
        cost=convert.cost_to_pb(r.cost),
        placement=r.placement,
    )


def _chunk_pb(c: OutChunk) -> orchestrator_pb2.GenerateChunk:
    msg = orchestrator_pb2.GenerateChunk()
    _fill_chunk(msg, c)
    return msg


def _fill_chunk(msg: orchestrator_pb2.GenerateChunk, c: OutChunk) -> None:
    """Write ``c`` into ``msg`` (an empty chunk: a `GenerateEvent`'s, built in place)."""
    msg.request_id = c.request_id
    msg.index = c.index
    msg.token_ids.extend(c.token_ids)
    msg.text = c.text
    if c.logprobs:
        msg.logprobs.extend(convert.logprob_to_pb(lp) for lp in c.logprobs)
    if c.prompt_logprobs:
        msg.prompt_logprobs.extend(convert.logprob_to_pb(lp) for lp in c.prompt_logprobs)
    if c.finish_reason:
        msg.finish_reason = convert.finish_to_pb(c.finish_reason)
        msg.timings.CopyFrom(convert.timings_to_pb(c.timings))
        if c.record is not None:
            msg.prompt_tokens = c.record.prompt_tokens
            msg.kv_bytes = c.record.kv_bytes
            msg.prefill_worker = c.record.prefill_worker
            msg.decode_worker = c.record.decode_worker
            msg.epoch = c.record.epoch
            msg.cost.CopyFrom(convert.cost_to_pb(c.record.cost))


def _aborted(exc: errors.PdorchError) -> StreamAborted:
    """How ``exc`` ends a request's stream: its status, and when to try again (seconds) if
    it was refused for load or for the store being away."""
    trailing: tuple[tuple[str, str], ...] = ()
    if isinstance(exc, errors.OverloadedError | errors.StoreUnavailableError):
        trailing = ((RETRY_AFTER_KEY, f"{exc.retry_after_s:.3f}"),)
    return StreamAborted(status_for(exc), str(exc), trailing)


class OrchestratorService(orchestrator_pb2_grpc.OrchestratorServicer):
    def __init__(self, orchestrator: Orchestrator, calls: ManyCalls | None = None) -> None:
        self.o = orchestrator
        self.calls = ManyCalls() if calls is None else calls

    async def Generate(
        self, request: orchestrator_pb2.GenerateRequest, context: Context
    ) -> AsyncIterator[orchestrator_pb2.GenerateChunk]:
        rid = named(request)
        try:
            inp = _input(request, _tenant(context), _deadline(context))
            async for chunk in self.o.generate(inp):
                yield _chunk_pb(chunk)
        except errors.PdorchError as exc:
            log.info("request %s failed: %s", shown(rid), exc)
            aborted = _aborted(exc)
            if aborted.trailing:
                context.set_trailing_metadata(aborted.trailing)
            await context.abort(aborted.code, aborted.details)

    async def GenerateMany(
        self, commands: AsyncIterator[Any], context: Context
    ) -> AsyncIterator[orchestrator_pb2.GenerateBatch]:
        try:
            tenant = _tenant(context)
        except errors.PdorchError as exc:
            await context.abort(status_for(exc), str(exc))
        await context.send_initial_metadata(((ACCEPTED_KEY, "1"),))  # the client may write

        def input_of(req: orchestrator_pb2.GenerateRequest, until: float | None) -> GenerateInput:
            return _input(req, tenant, until)

        many = GenerateMany(self.o.generate, input_of, _fill_chunk, _aborted, _deadline(context))
        self.calls.add(many)
        try:
            async for batch in served(GENERATE_MANY, many, commands, context):
                yield batch
        finally:
            self.calls.discard(many)

    async def Cancel(
        self, request: orchestrator_pb2.CancelRequest, context: Context
    ) -> orchestrator_pb2.CancelResponse:
        try:
            state = await self.o.cancel(request.request_id, _tenants())
        except errors.PdorchError as exc:
            await context.abort(status_for(exc), str(exc))
        return orchestrator_pb2.CancelResponse(state=str(state))

    async def GetRequest(
        self, request: orchestrator_pb2.GetRequestRequest, context: Context
    ) -> orchestrator_pb2.RequestInfo:
        try:
            record = await self.o.get(request.request_id, _tenants())
        except errors.PdorchError as exc:
            await context.abort(status_for(exc), str(exc))
        return info_pb(record)
