"""A server interceptor for every pdorch gRPC server (the orchestrator's client API and the
workers' API), so that both answer undecodable requests alike.

`RefuseUndecodable`: gRPC deserializes a request before any servicer code runs, and a
message protobuf refuses (a string field that is not UTF-8, a truncated field) makes
grpc.aio log a traceback and answer ``UNKNOWN``. That is the client's mistake, not ours:
the interceptor wraps each method's deserializer so a `DecodeError` becomes a marker, and
the method answers ``INVALID_ARGUMENT`` with protobuf's reason (it names the message type
and the fault, never the client's bytes) after one INFO log line. A bidirectional method
(the workers' ``DecodeMany``) reads its requests in a task of its own, where an abort would
not end the call: it is handed the `Undecodable` marker among its requests and refuses the
call itself (`refuse`).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf.message import DecodeError

log = logging.getLogger(__name__)

Context = grpc.aio.ServicerContext[Any, Any]


@dataclass(frozen=True, slots=True)
class Undecodable:
    """What a request protobuf could not parse becomes: the reason why."""

    reason: str


def _safe(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserialize is None:
        return None

    def parse(raw: bytes) -> Any:
        try:
            return deserialize(raw)
        except DecodeError as exc:
            return Undecodable(str(exc))

    return parse


async def refuse(method: str, request: Undecodable, context: Context) -> None:
    log.info("%s: refused an undecodable request from %s: %s", method, context.peer(), request)
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"undecodable request: {request.reason}")


if TYPE_CHECKING:  # the stubs make it generic; at runtime it is not subscriptable
    _Interceptor = grpc.aio.ServerInterceptor[Any, Any]
else:
    _Interceptor = grpc.aio.ServerInterceptor


class RefuseUndecodable(_Interceptor):
    """Undecodable requests answer ``INVALID_ARGUMENT`` (unary and server-streaming methods,
    the only kinds the service has)."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Any:
        # The stubs type handlers for the sync server; grpc.aio's hold coroutine functions.
        handler: Any = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = str(handler_call_details.method)
        parse = _safe(handler.request_deserializer)
        serialize = handler.response_serializer
        if handler.stream_stream is not None:  # the method reads the markers itself
            return grpc.stream_stream_rpc_method_handler(
                handler.stream_stream, request_deserializer=parse, response_serializer=serialize
            )
        if handler.request_streaming:
            return handler
        if handler.unary_unary is not None:
            unary: Any = handler.unary_unary

            async def unary_unary(request: Any, context: Context) -> Any:
                if isinstance(request, Undecodable):
                    await refuse(method, request, context)
                return await unary(request, context)

            return grpc.unary_unary_rpc_method_handler(
                unary_unary, request_deserializer=parse, response_serializer=serialize
            )
        if handler.unary_stream is not None:
            stream: Any = handler.unary_stream

            async def unary_stream(request: Any, context: Context) -> AsyncIterator[Any]:
                if isinstance(request, Undecodable):
                    await refuse(method, request, context)
                async for response in stream(request, context):
                    yield response

            return grpc.unary_stream_rpc_method_handler(
                unary_stream, request_deserializer=parse, response_serializer=serialize
            )
        return handler
