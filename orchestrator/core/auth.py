"""Who a caller is: bearer tokens, the tenants each may act for, and the tenant of a call.

Pure (no files, no sockets): `parse_tokens` turns a tokens file's text into a `TokenTable`,
`TokenTable.lookup` finds the `Caller` a presented token proves, and `Caller.tenant_for`
decides the tenant of a call. The fronts (gRPC metadata ``authorization: Bearer …``, HTTP
``Authorization: Bearer …``) and the file's reloading live above (`orchestrator.control
.tokens`, `orchestrator.rpc.auth`, the gateway).

**The file** (YAML or JSON; JSON is YAML)::

    tokens:
      - sha256: 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08
        tenant: team-a            # the tenant the token's calls are billed to and limited as
        tenants: [team-a-batch]   # optional: further tenants the caller may choose (narrowing)
        name: ci-bot              # optional: how logs name the caller (never the token)

Tokens are stored **hashed** (SHA-256 of the token's UTF-8, hex): the file holds no secret a
reader could replay. A presented token is hashed and compared against *every* entry with
`hmac.compare_digest` — no early exit, no dict probe keyed by the secret's hash — so the time
a lookup takes says nothing about which digest came close.

**The tenant comes from the credential.** A call's claimed tenant (gRPC ``x-pdorch-tenant``,
HTTP ``x-pdorch-tenant`` or the body's ``user``) may only *choose among* the tenants its token
allows (`Caller.tenants`: its ``tenant`` and its ``tenants``); no claim means the token's
``tenant``; a claim outside that set is refused (`PermissionDeniedError`), never silently
replaced, so a client that meant to bill a tenant learns it cannot.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from orchestrator.core.idents import check_tenant, shown
from orchestrator.errors import (
    ConfigError,
    InvalidRequestError,
    PermissionDeniedError,
    UnauthenticatedError,
)

BEARER = "bearer"
"""The ``Authorization`` scheme both fronts accept (case-insensitive, RFC 6750)."""
MAX_TOKEN_BYTES = 4096
"""Longest token accepted: a longer one is refused before it is hashed."""
_HEX64 = re.compile(r"[0-9a-f]{64}")


def token_digest(token: str) -> str:
    """SHA-256 of ``token``'s UTF-8, lowercase hex: what a tokens file stores."""
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


@dataclass(frozen=True, slots=True)
class Caller:
    """An authenticated caller: who (``name``, for logs) and which tenants it may act for."""

    name: str
    tenant: str
    """The tenant a call without a claim is billed to."""
    also: tuple[str, ...] = ()
    """Further tenants the caller may name (``x-pdorch-tenant`` / ``user``)."""

    @property
    def tenants(self) -> frozenset[str]:
        return frozenset((self.tenant, *self.also))

    def tenant_for(self, claimed: str | None, where: str) -> str:
        """The tenant of a call claiming ``claimed`` (None: no claim) in ``where`` (the
        header or field named in the refusal): the claim when this caller may act for it,
        else `PermissionDeniedError`."""
        if claimed is None:
            return self.tenant
        name = check_tenant(claimed, where)
        if name not in self.tenants:
            raise PermissionDeniedError(
                f"{where}: this credential ({self.name}) may not act for tenant {shown(name)}"
            )
        return name


@dataclass(frozen=True, slots=True)
class _Entry:
    digest: bytes
    caller: Caller


@dataclass(frozen=True, slots=True)
class TokenTable:
    """The tokens a deployment accepts (`parse_tokens`)."""

    entries: tuple[_Entry, ...]

    def __len__(self) -> int:
        return len(self.entries)

    def lookup(self, token: str) -> Caller | None:
        """The caller ``token`` proves, or None. Every entry is compared, in constant time."""
        if not token or len(token) > MAX_TOKEN_BYTES:
            return None
        digest = bytes.fromhex(token_digest(token))
        found: Caller | None = None
        for entry in self.entries:
            if hmac.compare_digest(entry.digest, digest) and found is None:
                found = entry.caller
        return found


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization`` value ``Bearer <token>``; None for anything else
    (no value, another scheme, an empty token)."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != BEARER or not token:
        return None
    return token


def authenticate(table: TokenTable, authorization: str | None) -> Caller:
    """The caller an ``Authorization`` value proves, else `UnauthenticatedError` (which
    never repeats the value: it may be someone's real token, mistyped)."""
    token = bearer_token(authorization)
    if token is None:
        raise UnauthenticatedError("no credential: send 'authorization: Bearer <token>'")
    caller = table.lookup(token)
    if caller is None:
        raise UnauthenticatedError("invalid or revoked token")
    return caller


def parse_tokens(text: str, source: str = "tokens file") -> TokenTable:
    """A `TokenTable` from a tokens file's text; `ConfigError` naming the entry and field
    (``tokens[2].sha256``) for anything malformed. A digest listed twice is refused: which
    tenant would it prove?"""
    try:
        data: Any = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(source, f"not YAML/JSON: {exc}") from None
    if not isinstance(data, Mapping) or not isinstance(data.get("tokens"), list):
        raise ConfigError(source, "expected a mapping with a 'tokens' list")
    entries: list[_Entry] = []
    seen: set[bytes] = set()
    for i, raw in enumerate(data["tokens"]):
        where = f"{source}: tokens[{i}]"
        entry = _entry(raw, where)
        if entry.digest in seen:
            raise ConfigError(f"{where}.sha256", "listed twice")
        seen.add(entry.digest)
        entries.append(entry)
    return TokenTable(tuple(entries))


def _entry(raw: object, where: str) -> _Entry:
    if not isinstance(raw, Mapping):
        raise ConfigError(where, "expected a mapping with 'sha256' and 'tenant'")
    unknown = sorted(set(raw) - {"sha256", "tenant", "tenants", "name"})
    if unknown:
        raise ConfigError(where, f"unknown field(s) {unknown}")
    digest = raw.get("sha256")
    if not isinstance(digest, str) or not _HEX64.fullmatch(digest.strip().lower()):
        raise ConfigError(f"{where}.sha256", "expected 64 hex digits (sha256 of the token)")
    digest = digest.strip().lower()
    tenant = _tenant(raw.get("tenant"), f"{where}.tenant")
    also = raw.get("tenants", [])
    if not isinstance(also, Sequence) or isinstance(also, str):
        raise ConfigError(f"{where}.tenants", "expected a list of tenants")
    extra = tuple(_tenant(t, f"{where}.tenants[{j}]") for j, t in enumerate(also))
    name = raw.get("name", f"token {digest[:8]}")
    if not isinstance(name, str) or not name.strip() or not name.isprintable():
        raise ConfigError(f"{where}.name", "expected printable text")
    caller = Caller(name.strip(), tenant, tuple(t for t in _unique(extra) if t != tenant))
    return _Entry(bytes.fromhex(digest), caller)


def _tenant(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(where, "expected a tenant name")
    try:
        return check_tenant(value, where)
    except InvalidRequestError as exc:
        raise ConfigError(where, str(exc)) from None


def _unique(names: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(names))
