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
from typing import Any

import grpc

from orchestrator import errors
from orchestrator.api.guard import CallGuard
from orchestrator.core.peers import Surface, check_peer

log = logging.getLogger(__name__)

Context = grpc.aio.ServicerContext[Any, Any]

COMMON_NAME_KEY = "x509_common_name"


def peer_identity(context: Context) -> str | None:
    """The common name of the peer's certificate; None when it presented none (or the
    connection is not TLS)."""
    names = (context.auth_context() or {}).get(COMMON_NAME_KEY) or ()
    for name in names:
        return name.decode("utf-8", "replace") if isinstance(name, bytes) else str(name)
    return None


class RequirePeer(CallGuard):
    """Calls from identities ``surface`` does not allow answer ``PERMISSION_DENIED``."""

    def __init__(self, surface: Surface) -> None:
        self.surface = surface

    async def check(self, method: str, context: Context) -> None:
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
