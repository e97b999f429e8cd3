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
from contextvars import ContextVar
from typing import Any, Protocol

import grpc

from orchestrator import errors
from orchestrator.api.guard import CallGuard
from orchestrator.core.auth import Caller

log = logging.getLogger(__name__)

Context = grpc.aio.ServicerContext[Any, Any]

AUTHORIZATION_KEY = "authorization"

_CALLER: ContextVar[Caller | None] = ContextVar("pdorch_caller", default=None)


def caller() -> Caller | None:
    """The authenticated caller of the call being served (None: the API is open)."""
    return _CALLER.get()


class Authenticator(Protocol):
    def authenticate(self, authorization: str | None) -> Caller:
        """The caller an ``Authorization`` value proves, else `UnauthenticatedError`."""
        ...


def _authorization(context: Context) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == AUTHORIZATION_KEY:
            return value if isinstance(value, str) else None
    return None


class Authenticate(CallGuard):
    """Calls without a valid bearer token answer ``UNAUTHENTICATED``."""

    def __init__(self, tokens: Authenticator) -> None:
        self.tokens = tokens

    async def check(self, method: str, context: Context) -> Caller:
        try:
            found = self.tokens.authenticate(_authorization(context))
        except errors.UnauthenticatedError as exc:
            log.warning("%s: refused a call from %s: %s", method, context.peer(), exc)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))
            raise  # abort raises; this keeps the type checker (and a fake context) honest
        _CALLER.set(found)
        return found
