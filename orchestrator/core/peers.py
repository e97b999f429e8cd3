"""Who a component is, and whom it takes calls from: the identities of pdorch's certificates.

Pure (no files, no sockets, no TLS library): the names, the file layout of a TLS directory,
and the policy. Certificates are made by `orchestrator.certs` (a throwaway CA) or by whoever
runs the deployment's CA (cert-manager); credentials are loaded by `orchestrator.api.tls`;
the policy is enforced on every gRPC call by `orchestrator.api.peers`.

**An identity is a certificate's subject common name**, ``pdorch-<role>``, optionally followed
by ``.<anything>`` naming the instance (``pdorch-decode.decode-3``): the role is what the
policy looks at, the rest is for logs.

    identity              who                          may call
    pdorch-orchestrator   an orchestrator replica      workers' gRPC (Prefill, Decode, ...)
    pdorch-prefill        a prefill worker             a decode worker's KV port (transport)
    pdorch-decode         a decode worker              nothing
    pdorch-worker         a worker of either role      a decode worker's KV port
    pdorch-client         clients, tests, benches      the client API (and a bearer token)

A worker takes gRPC calls from orchestrator identities only (a client's or another worker's
certificate is refused: ``PERMISSION_DENIED``); the client API, when it asks for client
certificates (mutual TLS), takes client identities only (a worker's is refused), and
otherwise callers prove themselves with a bearer token; a decode worker takes KV only from
prefill (or both-roles) identities. The health service answers any identity the CA signed:
it says only whether a process serves.

**Server names.** Every server certificate also carries DNS names for the *kind* of server
(`WORKER_SERVER_NAME`, `ORCHESTRATOR_SERVER_NAME`) besides ``localhost``/``127.0.0.1``; pdorch's
own clients verify the server against that name, not against the address they dial, so a
worker reached by pod IP or through a proxy is still checked to be a worker.

**The directory** (`TlsFiles`): ``<dir>/ca.pem`` (the CA every peer is checked against),
``<dir>/<identity>.pem`` (certificate) and ``<dir>/<identity>.key`` (its private key, 0600).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import PurePath

from orchestrator.errors import PermissionDeniedError

PREFIX = "pdorch-"


class Role(enum.StrEnum):
    ORCHESTRATOR = "orchestrator"
    PREFILL = "prefill"
    DECODE = "decode"
    WORKER = "worker"
    """A worker serving either role."""
    CLIENT = "client"

    @property
    def identity(self) -> str:
        """The common name of this role's certificate (``pdorch-decode``)."""
        return PREFIX + self.value


class Surface(enum.StrEnum):
    """What a peer calls."""

    CLIENT_API = "the client API"
    WORKER_API = "a worker's API"
    KV = "a decode worker's KV port"


ALLOWED: Mapping[Surface, frozenset[Role]] = {
    Surface.CLIENT_API: frozenset({Role.CLIENT}),
    Surface.WORKER_API: frozenset({Role.ORCHESTRATOR}),
    Surface.KV: frozenset({Role.PREFILL, Role.WORKER}),
}
"""Which roles may call what, where certificates are asked for (mutual TLS)."""

WORKER_SERVER_NAME = "pdorch-worker"
"""DNS name in every worker certificate: the name orchestrators check a worker against."""
ORCHESTRATOR_SERVER_NAME = "pdorch-orchestrator"
"""DNS name in every orchestrator certificate: the name pdorch's clients check it against."""
LOCAL_NAMES = ("localhost",)
LOCAL_ADDRESSES = ("127.0.0.1",)


def server_names(role: Role) -> tuple[str, ...]:
    """The DNS names (besides the local ones) a certificate of ``role`` carries."""
    if role in (Role.PREFILL, Role.DECODE, Role.WORKER):
        return tuple(dict.fromkeys((role.identity, WORKER_SERVER_NAME)))
    return (role.identity,)


def role_of(common_name: str | None) -> Role | None:
    """The role an identity names (``pdorch-decode.decode-3`` → decode); None for a name
    that is not a pdorch identity."""
    if not common_name or not common_name.startswith(PREFIX):
        return None
    head = common_name[len(PREFIX) :].partition(".")[0]
    try:
        return Role(head)
    except ValueError:
        return None


def check_peer(surface: Surface, common_name: str | None) -> Role:
    """The role of a peer with certificate ``common_name`` calling ``surface``;
    `PermissionDeniedError` (naming the identity and what it may not do) otherwise."""
    role = role_of(common_name)
    if role is None or role not in ALLOWED[surface]:
        who = repr(common_name) if common_name else "a peer without a pdorch identity"
        allowed = ", ".join(sorted(r.identity for r in ALLOWED[surface]))
        raise PermissionDeniedError(
            f"certificate {who} may not call {surface} (allowed: {allowed})"
        )
    return role


def worker_role(serving: str) -> Role:
    """The identity a worker serving ``serving`` (prefill or decode) presents."""
    return Role.PREFILL if serving == "prefill" else Role.DECODE


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """Where one identity's credentials lie in a TLS directory."""

    directory: PurePath
    identity: str

    @property
    def ca(self) -> PurePath:
        return self.directory / CA_FILE

    @property
    def cert(self) -> PurePath:
        return self.directory / f"{self.identity}.pem"

    @property
    def key(self) -> PurePath:
        return self.directory / f"{self.identity}.key"


CA_FILE = "ca.pem"
