"""The client-facing gRPC service: protobuf in, `control.Orchestrator` calls, protobuf out."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc

from orchestrator import errors
from orchestrator.api import convert, orchestrator_pb2, orchestrator_pb2_grpc
from orchestrator.control.orchestrator import GenerateInput, Orchestrator, OutChunk
from orchestrator.core.records import RequestRecord
from orchestrator.rpc.status import status_for

log = logging.getLogger(__name__)
Context = grpc.aio.ServicerContext[Any, Any]


TENANT_KEY = "x-pdorch-tenant"
RETRY_AFTER_KEY = "retry-after"
"""Trailing metadata of a RESOURCE_EXHAUSTED refusal: seconds before a retry can succeed."""
_MAX_TENANT = 64


def _tenant(context: Context) -> str:
    """The caller's tenant, from call metadata (bounded; "default" without one)."""
    for key, value in context.invocation_metadata() or ():
        if key == TENANT_KEY:
            text = value.decode(errors="replace") if isinstance(value, bytes) else str(value)
            text = text.strip()
            if not text or len(text) > _MAX_TENANT or not text.isprintable():
                raise errors.InvalidRequestError(
                    TENANT_KEY, f"must be 1-{_MAX_TENANT} printable characters"
                )
            return text
    return "default"


def _input(req: orchestrator_pb2.GenerateRequest, tenant: str = "default") -> GenerateInput:
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
    msg = orchestrator_pb2.GenerateChunk(
        request_id=c.request_id, index=c.index, token_ids=c.token_ids, text=c.text
    )
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
    return msg


class OrchestratorService(orchestrator_pb2_grpc.OrchestratorServicer):
    def __init__(self, orchestrator: Orchestrator) -> None:
        self.o = orchestrator

    async def Generate(
        self, request: orchestrator_pb2.GenerateRequest, context: Context
    ) -> AsyncIterator[orchestrator_pb2.GenerateChunk]:
        try:
            async for chunk in self.o.generate(_input(request, _tenant(context))):
                yield _chunk_pb(chunk)
        except errors.PdorchError as exc:
            log.info("request %s failed: %s", request.request_id or "-", exc)
            if isinstance(exc, errors.OverloadedError):  # when to try again (seconds)
                context.set_trailing_metadata(((RETRY_AFTER_KEY, f"{exc.retry_after_s:.3f}"),))
            await context.abort(status_for(exc), str(exc))

    async def Cancel(
        self, request: orchestrator_pb2.CancelRequest, context: Context
    ) -> orchestrator_pb2.CancelResponse:
        try:
            state = await self.o.cancel(request.request_id)
        except errors.PdorchError as exc:
            await context.abort(status_for(exc), str(exc))
        return orchestrator_pb2.CancelResponse(state=str(state))

    async def GetRequest(
        self, request: orchestrator_pb2.GetRequestRequest, context: Context
    ) -> orchestrator_pb2.RequestInfo:
        try:
            record = await self.o.get(request.request_id)
        except errors.PdorchError as exc:
            await context.abort(status_for(exc), str(exc))
        return info_pb(record)
