"""Bearer-token authentication of the client gRPC API: the `Authenticate` interceptor.

Every call to the client API must carry call metadata ``authorization: Bearer <token>``
naming a token the tokens file lists (`orchestrator.control.tokens`); any other call is
answered ``UNAUTHENTICATED`` before the method runs (before its request is even parsed:
the interceptor wraps outside `RefuseUndecodable`), and the refusal is logged at WARNING
with the peer's address and the method — never the token. The health service stays open
for probes (it says only whether the replica serves).

The authenticated `Caller` reaches the method through a context variable (`caller`): each
gRPC call runs in a task of its own, so the value set for a call is that call's alone.
Without a tokens file no interceptor is installed and `caller` is None: the API is open
(the CLI says so, loudly, at start).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Protocol

import grpc

from orchestrator import errors
from orchestrator.core.auth import Caller

log = logging.getLogger(__name__)

Context = grpc.aio.ServicerContext[Any, Any]

AUTHORIZATION_KEY = "authorization"
OPEN_PREFIXES = ("/grpc.health.v1.Health/",)
"""Methods served without a credential: readiness probes."""

_CALLER: ContextVar[Caller | None] = ContextVar("pdorch_caller", default=None)


def caller() -> Caller | None:
    """The authenticated caller of the call being served (None: the API is open)."""
    return _CALLER.get()


class Authenticator(Protocol):
    def authenticate(self, authorization: str | None) -> Caller:
        """The caller an ``Authorization`` value proves, else `UnauthenticatedError`."""
        ...


if TYPE_CHECKING:  # the stubs make it generic; at runtime it is not subscriptable
    _Interceptor = grpc.aio.ServerInterceptor[Any, Any]
else:
    _Interceptor = grpc.aio.ServerInterceptor


def _authorization(context: Context) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == AUTHORIZATION_KEY:
            return value if isinstance(value, str) else None
    return None


class Authenticate(_Interceptor):
    """Calls without a valid bearer token answer ``UNAUTHENTICATED``."""

    def __init__(self, tokens: Authenticator) -> None:
        self.tokens = tokens

    async def _check(self, method: str, context: Context) -> Caller:
        try:
            found = self.tokens.authenticate(_authorization(context))
        except errors.UnauthenticatedError as exc:
            log.warning("%s: refused a call from %s: %s", method, context.peer(), exc)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))
            raise  # abort raises; this keeps the type checker (and a fake context) honest
        _CALLER.set(found)
        return found

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Any:
        handler: Any = await continuation(handler_call_details)
        method = str(handler_call_details.method)
        if handler is None or method.startswith(OPEN_PREFIXES):
            return handler
        if handler.request_streaming:  # the client API has none; refuse rather than skip
            return grpc.unary_unary_rpc_method_handler(self._refuse_streaming)
        parse = handler.request_deserializer
        serialize = handler.response_serializer
        if handler.unary_unary is not None:
            unary: Any = handler.unary_unary

            async def unary_unary(request: Any, context: Context) -> Any:
                await self._check(method, context)
                return await unary(request, context)

            return grpc.unary_unary_rpc_method_handler(
                unary_unary, request_deserializer=parse, response_serializer=serialize
            )
        stream: Any = handler.unary_stream

        async def unary_stream(request: Any, context: Context) -> AsyncIterator[Any]:
            await self._check(method, context)
            async for response in stream(request, context):
                yield response

        return grpc.unary_stream_rpc_method_handler(
            unary_stream, request_deserializer=parse, response_serializer=serialize
        )

    @staticmethod
    async def _refuse_streaming(request: Any, context: Context) -> None:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "client-streaming calls are not served")
