"""Who may call a gRPC server, by the identity in the peer's TLS certificate: `RequirePeer`.

The TLS handshake has already verified the peer's certificate against the CA (and, for a
worker, required one); this interceptor reads its subject common name from the call's auth
context and applies `orchestrator.core.peers.check_peer` for the server's `Surface`
before the method runs — and before its request is parsed. A refused call answers
``PERMISSION_DENIED`` and logs one WARNING line naming the peer's address and identity.

It is installed on mutual-TLS ports only (a worker's; the client API's with ``--client-cert
required``), where a caller without a certificate the CA signed never gets this far; one
without a pdorch identity would be refused all the same. The health service is served to
any identity the CA signed (probes).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc

from orchestrator import errors
from orchestrator.core.peers import Surface, check_peer

log = logging.getLogger(__name__)

Context = grpc.aio.ServicerContext[Any, Any]

OPEN_PREFIXES = ("/grpc.health.v1.Health/",)
COMMON_NAME_KEY = "x509_common_name"

if TYPE_CHECKING:  # the stubs make it generic; at runtime it is not subscriptable
    _Interceptor = grpc.aio.ServerInterceptor[Any, Any]
else:
    _Interceptor = grpc.aio.ServerInterceptor


def peer_identity(context: Context) -> str | None:
    """The common name of the peer's certificate; None when it presented none (or the
    connection is not TLS)."""
    names = (context.auth_context() or {}).get(COMMON_NAME_KEY) or ()
    for name in names:
        return name.decode("utf-8", "replace") if isinstance(name, bytes) else str(name)
    return None


class RequirePeer(_Interceptor):
    """Calls from identities ``surface`` does not allow answer ``PERMISSION_DENIED``."""

    def __init__(self, surface: Surface) -> None:
        self.surface = surface

    async def _check(self, method: str, context: Context) -> None:
        identity = peer_identity(context)
        try:
            check_peer(self.surface, identity)
        except errors.PermissionDeniedError as exc:
            log.warning(
                "%s: refused a call from %s (certificate %s): %s",
                method,
                context.peer(),
                repr(identity) if identity else "none",
                exc,
            )
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
            raise  # abort raises; this keeps the type checker (and a fake context) honest

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Any:
        handler: Any = await continuation(handler_call_details)
        method = str(handler_call_details.method)
        if handler is None or method.startswith(OPEN_PREFIXES):
            return handler
        if handler.request_streaming:  # pdorch serves none; refuse rather than skip
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
