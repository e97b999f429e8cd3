"""Mutual TLS on the KV control link, and which identities may send or receive KV.

The control link (`transport.link`) is one TCP connection per transfer slot between a
prefill worker (sender) and a decode worker (receiver). With `LinkTls`, the receiver's
server context and the sender's client context both require a certificate from the CA
they trust (mutual TLS), and each side then checks the other's *identity* — the subject
common name, ``pdorch-<role>``, optionally followed by ``.<instance>`` for logs
(``pdorch-decode.decode-3``) — before a byte of the protocol moves: a decode worker takes
KV only from prefill identities (``pdorch-prefill``, and ``pdorch-worker`` for a worker in
both roles), and a prefill worker sends KV only to decode identities (``pdorch-decode``,
``pdorch-worker``). Host names are not checked:
pods' addresses change, their identities do not; the CA and the identity are what count.

What TLS covers: the control messages (headers, checksums, transfer tokens, one-sided
memory keys) and, with the TCP backend, the KV bytes themselves (they travel inline on the
link). UCX's data path is not encrypted (UCXX has no TLS): it carries only payloads the
authenticated link announced (`transport.control`: the receiver's one-time token).

Contexts are built by the caller (the CLI, from a directory) and handed in: this package
never reads the environment. `load_dir` builds both from the layout ``pdorch certs`` writes
and the operator mounts: ``<dir>/ca.pem``, ``<dir>/pdorch-<role>.pem``,
``<dir>/pdorch-<role>.key``.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transport import errors

PeerCert = Mapping[str, Any]
"""A verified peer certificate as `ssl.SSLSocket.getpeercert()` returns it."""
IdentityCheck = Callable[[PeerCert], bool]
"""Whether a verified peer certificate names an identity allowed on this side."""

CN_PREFIX = "pdorch-"
"""Subject common names are ``pdorch-<identity>`` (orchestrator, prefill, decode, worker,
client)."""
SENDER_IDENTITIES = frozenset({"pdorch-prefill", "pdorch-worker"})
"""Who may send KV: prefill workers, and workers in both roles."""
RECEIVER_IDENTITIES = frozenset({"pdorch-decode", "pdorch-worker"})
"""Who may receive KV: decode workers, and workers in both roles."""
HANDSHAKE_TIMEOUT_S = 5.0
"""Bound on a TLS handshake when the caller gives none (the link uses its connect timeout)."""


def common_name(cert: PeerCert | None) -> str | None:
    """The subject common name of a verified peer certificate, if it has one."""
    if not cert:
        return None
    for rdn in cert.get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    return None


def describe(cert: PeerCert | None) -> str:
    """How logs name a peer: its common name, or that it showed none."""
    return common_name(cert) or "no certificate"


def allow_names(names: Iterable[str]) -> IdentityCheck:
    """An `IdentityCheck` accepting certificates whose common name is one of ``names``,
    alone or followed by ``.<instance>``."""
    allowed = frozenset(names)

    def check(cert: PeerCert) -> bool:
        name = common_name(cert)
        return name is not None and name.partition(".")[0] in allowed

    return check


@dataclass(frozen=True)
class LinkTls:
    """TLS for one process's KV links. A side without its context speaks plain TCP."""

    server: ssl.SSLContext | None = None
    """Receiver: the server context (its certificate; it must verify clients)."""
    client: ssl.SSLContext | None = None
    """Sender: the client context (its certificate; it must verify the server)."""
    senders: IdentityCheck = field(default=allow_names(SENDER_IDENTITIES))
    """Receiver: the peers it takes KV from."""
    receivers: IdentityCheck = field(default=allow_names(RECEIVER_IDENTITIES))
    """Sender: the peers it sends KV to."""

    def __post_init__(self) -> None:
        for ctx in (self.server, self.client):
            if ctx is not None and ctx.verify_mode is not ssl.CERT_REQUIRED:
                raise ValueError("KV link TLS contexts must require the peer's certificate")


def server_context(ca: Path, cert: Path, key: Path) -> ssl.SSLContext:
    """A receiver's context: its certificate, and client certificates required from ``ca``."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(ca))
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_cert_chain(str(cert), str(key))
    return ctx


def client_context(ca: Path, cert: Path, key: Path) -> ssl.SSLContext:
    """A sender's context: its certificate; the server's verified against ``ca``, its
    identity checked by `LinkTls.receivers` rather than by host name."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(ca))
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.check_hostname = False  # identities, not addresses: see the module docstring
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_cert_chain(str(cert), str(key))
    return ctx


def load_dir(folder: Path | str, identity: str) -> LinkTls:
    """Both contexts for ``identity`` (``prefill``, ``decode``, ``worker``, or the same with
    the ``pdorch-`` prefix) from ``folder``'s ``ca.pem``, ``pdorch-<role>.pem`` and
    ``pdorch-<role>.key``, with the default identity checks. Raises `TlsConfigError` naming
    the file that is missing or bad."""
    root = Path(folder)
    stem = identity if identity.startswith(CN_PREFIX) else CN_PREFIX + identity
    ca, cert, key = root / "ca.pem", root / f"{stem}.pem", root / f"{stem}.key"
    for path in (ca, cert, key):
        if not path.is_file():
            raise errors.TlsConfigError(f"KV link TLS: {path} is missing")
    try:
        return LinkTls(server=server_context(ca, cert, key), client=client_context(ca, cert, key))
    except (OSError, ssl.SSLError) as exc:
        raise errors.TlsConfigError(
            f"KV link TLS: cannot load {identity}'s certificate from {root}: {exc}"
        ) from exc
