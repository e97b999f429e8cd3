"""pdorch's own clients of the client API: a channel that sends the caller's bearer token.

`channel` opens a grpc.aio channel whose every call carries ``authorization: Bearer
<token>`` (a client interceptor adds it), so `pdorch generate`, `pdorch bench load` and the
local cluster's helpers authenticate without each call site knowing. No token: no
credential, as against an orchestrator without a tokens file. With TLS credentials
(`api.tls.Tls`, the client identity's) the channel is TLS and the orchestrator is checked to
be one (`core.peers.ORCHESTRATOR_SERVER_NAME`). Where the token comes from
(``$PDORCH_TOKEN``, ``$PDORCH_TOKEN_FILE``) is the CLI's business.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import grpc

from orchestrator.api.tls import Tls, secure_channel
from orchestrator.core.peers import ORCHESTRATOR_SERVER_NAME
from orchestrator.rpc.auth import AUTHORIZATION_KEY

if TYPE_CHECKING:  # the stubs make them generic; at runtime they are not subscriptable
    _UnaryUnary = grpc.aio.UnaryUnaryClientInterceptor[Any, Any]
    _UnaryStream = grpc.aio.UnaryStreamClientInterceptor[Any, Any]
    _StreamStream = grpc.aio.StreamStreamClientInterceptor[Any, Any]
else:
    _UnaryUnary = grpc.aio.UnaryUnaryClientInterceptor
    _UnaryStream = grpc.aio.UnaryStreamClientInterceptor
    _StreamStream = grpc.aio.StreamStreamClientInterceptor


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    """Call metadata authenticating as ``token``."""
    return ((AUTHORIZATION_KEY, f"Bearer {token}"),)


def _with_token(details: Any, token: str) -> Any:
    metadata = [(k, v) for k, v in (details.metadata or ()) if k != AUTHORIZATION_KEY]
    return details._replace(metadata=grpc.aio.Metadata(*metadata, *bearer(token)))


class _BearerUnary(_UnaryUnary):
    def __init__(self, token: str) -> None:
        self.token = token

    async def intercept_unary_unary(
        self, continuation: Callable[..., Any], client_call_details: Any, request: Any
    ) -> Any:
        return await continuation(_with_token(client_call_details, self.token), request)


class _BearerStream(_UnaryStream):
    """A class of its own: grpc.aio files an interceptor under one kind only."""

    def __init__(self, token: str) -> None:
        self.token = token

    async def intercept_unary_stream(
        self, continuation: Callable[..., Any], client_call_details: Any, request: Any
    ) -> Any:
        return await continuation(_with_token(client_call_details, self.token), request)


class _BearerStreamStream(_StreamStream):
    """``GenerateMany``'s: the token goes with the call, once for all its requests."""

    def __init__(self, token: str) -> None:
        self.token = token

    async def intercept_stream_stream(
        self, continuation: Callable[..., Any], client_call_details: Any, request_iterator: Any
    ) -> Any:
        return await continuation(_with_token(client_call_details, self.token), request_iterator)


def channel(
    target: str,
    token: str | None = None,
    options: Sequence[tuple[str, Any]] = (),
    tls: Tls | None = None,
) -> grpc.aio.Channel:
    """A grpc.aio channel to ``target`` whose calls carry ``token`` (if any): over TLS with
    ``tls`` (the server checked to be an orchestrator, ``tls``' certificate presented),
    else plaintext."""
    interceptors: Any = (
        [_BearerUnary(token), _BearerStream(token), _BearerStreamStream(token)] if token else None
    )  # the stubs' type is private
    if tls is not None:
        return secure_channel(target, tls, ORCHESTRATOR_SERVER_NAME, options, interceptors)
    return grpc.aio.insecure_channel(target, options=list(options), interceptors=interceptors)
