"""TLS credentials of one identity, read from a TLS directory, for gRPC servers and channels.

The directory's layout and the identities are `orchestrator.core.peers`'; `Tls.load` reads
``ca.pem`` and the identity's ``.pem``/``.key`` once, at start (a missing or unreadable file
is a `ConfigError` naming it: the process does not start half-secured). From them:

- `server_credentials`: the process's certificate and, for mutual TLS (a worker always; the
  client API with ``--client-cert required``), the CA that the client's certificate must be
  signed by (one from another CA, or none, fails the handshake). gRPC's Python servers have
  no "verify if presented": without mutual TLS no client certificate is asked for;
- `channel` options: the CA that the *server* is verified against, this identity's
  certificate presented as the client's, and the server name to check (`peers`' server
  names: a worker is checked to be a worker whatever address it is dialled at).

The gateway (HTTP) takes the same files as paths (`ssl_files`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from orchestrator.core.peers import Role, TlsFiles
from orchestrator.errors import ConfigError

TLS_FLAG = "--tls-dir"


@dataclass(frozen=True, slots=True)
class Tls:
    files: TlsFiles
    ca: bytes = field(repr=False)
    cert: bytes = field(repr=False)
    key: bytes = field(repr=False)

    @property
    def identity(self) -> str:
        return self.files.identity

    @classmethod
    def load(cls, directory: str | os.PathLike[str], identity: str) -> Tls:
        """``identity``'s credentials from ``directory``; `ConfigError` naming a missing
        or unreadable file."""
        files = TlsFiles(Path(directory), identity)
        return cls(files, _read(files.ca), _read(files.cert), _read(files.key))

    def server_credentials(self, *, require_client_cert: bool) -> grpc.ServerCredentials:
        """Serve as this identity; with ``require_client_cert``, mutual TLS (the client's
        certificate required, and verified against the CA), else none asked for."""
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)],
            root_certificates=self.ca if require_client_cert else None,
            require_client_auth=require_client_cert,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Verify servers against the CA; present this identity's certificate."""
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )

    def ssl_files(self) -> tuple[str, str, str]:
        """(certificate, key, CA) paths, for servers that take files (uvicorn)."""
        return str(self.files.cert), str(self.files.key), str(self.files.ca)


def load_worker(directory: str | os.PathLike[str], serving: str) -> Tls:
    """A worker's credentials: its role's identity (``pdorch-prefill``/``pdorch-decode``),
    else the both-roles one (``pdorch-worker``)."""
    own = Role.PREFILL if serving == "prefill" else Role.DECODE
    if Path(TlsFiles(Path(directory), own.identity).cert).exists():
        return Tls.load(directory, own.identity)
    return Tls.load(directory, Role.WORKER.identity)


def secure_channel(
    target: str,
    tls: Tls,
    server_name: str,
    options: Sequence[tuple[str, Any]] = (),
    interceptors: Any = None,
) -> grpc.aio.Channel:
    """A grpc.aio channel to ``target`` over mutual TLS, the server checked to carry
    ``server_name``."""
    opts = [*options, ("grpc.ssl_target_name_override", server_name)]
    return grpc.aio.secure_channel(
        target, tls.channel_credentials(), options=opts, interceptors=interceptors
    )


def _read(path: os.PathLike[str]) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(TLS_FLAG, f"{path}: {exc.strerror}") from None
    if not data.strip():
        raise ConfigError(TLS_FLAG, f"{path}: empty")
    return data
