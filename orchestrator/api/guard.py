"""`CallGuard`: the shape of an interceptor that checks every call before its method runs.

A subclass says what to check (`CallGuard.check`: refuse with ``context.abort``, or
return); this wraps each method so the check runs first — before the request is even
parsed into the method's code (a bidirectional method's before its first message is read),
and in the call's own task (so a context variable a check sets is that call's alone). The
health service (`OPEN_PREFIXES`) is never checked: readiness probes. Client-streaming
methods with one answer, which pdorch serves none of, are refused (``UNIMPLEMENTED``)
rather than let through unchecked.

Used by `orchestrator.api.peers.RequirePeer` (the TLS identity) and
`orchestrator.rpc.auth.Authenticate` (the bearer token).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc

Context = grpc.aio.ServicerContext[Any, Any]

OPEN_PREFIXES = ("/grpc.health.v1.Health/",)
"""Methods served without a check: readiness probes (they say only whether it serves)."""

if TYPE_CHECKING:  # the stubs make it generic; at runtime it is not subscriptable
    _Interceptor = grpc.aio.ServerInterceptor[Any, Any]
else:
    _Interceptor = grpc.aio.ServerInterceptor


class CallGuard(_Interceptor):
    """Runs `check` before every method but the health service's."""

    async def check(self, method: str, context: Context) -> object:
        """Refuse the call (``await context.abort(...)``, which raises) or return."""
        raise NotImplementedError

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Any:
        handler: Any = await continuation(handler_call_details)
        method = str(handler_call_details.method)
        if handler is None or method.startswith(OPEN_PREFIXES):
            return handler
        parse = handler.request_deserializer
        serialize = handler.response_serializer
        if handler.unary_stream is not None or handler.stream_stream is not None:
            bidi = handler.stream_stream is not None
            inner: Any = handler.stream_stream if bidi else handler.unary_stream

            async def streaming(request: Any, context: Context) -> AsyncIterator[Any]:
                # ``request``: the one request, or (bidirectional) their iterator, unread yet
                await self.check(method, context)
                async for response in inner(request, context):
                    yield response

            make = (
                grpc.stream_stream_rpc_method_handler
                if bidi
                else grpc.unary_stream_rpc_method_handler
            )
            return make(streaming, request_deserializer=parse, response_serializer=serialize)
        if handler.request_streaming:  # pdorch serves none; refuse rather than skip
            return grpc.unary_unary_rpc_method_handler(self._refuse_streaming)
        unary: Any = handler.unary_unary

        async def unary_unary(request: Any, context: Context) -> Any:
            await self.check(method, context)
            return await unary(request, context)

        return grpc.unary_unary_rpc_method_handler(
            unary_unary, request_deserializer=parse, response_serializer=serialize
        )

    @staticmethod
    async def _refuse_streaming(request: Any, context: Context) -> None:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "client-streaming calls are not served")
