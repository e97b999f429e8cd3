"""Strings a client chooses: what a request id or a tenant may be, and how a client's string
is shown back. Pure; the one place both fronts (gRPC and HTTP) take these rules from.

**Request ids** name a request everywhere: the store, logs, the KV header a prefill worker
sends (`transport.wire`), the gateway's ``x-request-id`` header. So an id is UTF-8 text of
1 to `MAX_REQUEST_ID_BYTES` *bytes* — the KV header's own bound, so every id admitted at
the door also fits the header — made of printable characters only: no whitespace, no
control or format characters, no lone surrogates. The same bytes make the same id on both
fronts (the gateway decodes its headers as UTF-8, as gRPC does its strings).

**Tenants** are printable text of 1 to `MAX_TENANT_BYTES` bytes; inner spaces are allowed
(the body's ``user`` may be a name), surrounding whitespace is not part of it.

**Echo.** A client's string that ends up in an error message or a log line goes through
`shown`: quoted, non-printables escaped, cut to `ECHO_CHARS` characters with the size of
what was cut. A megabyte id then costs a line, not a megabyte (nor a gRPC status too large
for the client's metadata limit).
"""

from __future__ import annotations

import reprlib

from orchestrator.errors import InvalidRequestError
from transport.wire import MAX_ID_BYTES

MAX_REQUEST_ID_BYTES = MAX_ID_BYTES
"""Longest request id, in UTF-8 bytes: what the KV header carries (`transport.wire`)."""
MAX_TENANT_BYTES = 64
"""Longest tenant name, in UTF-8 bytes."""
ECHO_CHARS = 64
"""How much of a client's string an error message or a log line repeats."""

_ECHO = reprlib.Repr()
_ECHO.maxlevel = 2
_ECHO.maxtuple = _ECHO.maxlist = _ECHO.maxdict = _ECHO.maxset = _ECHO.maxfrozenset = 4
_ECHO.maxstring = _ECHO.maxlong = _ECHO.maxother = ECHO_CHARS
_ID_RULE = f"1-{MAX_REQUEST_ID_BYTES} bytes of UTF-8, printable, no whitespace"
_TENANT_RULE = f"1-{MAX_TENANT_BYTES} bytes of UTF-8, printable"


def shown(value: object) -> str:
    """``value`` as an error message or a log line may repeat it: its ``repr`` (quoted,
    control characters and lone surrogates escaped), long strings and containers cut in
    the middle (`reprlib`), never more than about `ECHO_CHARS` characters."""
    try:
        return _ECHO.repr(value)
    except ValueError:  # an int past Python's digit limit for str()
        return f"<{type(value).__name__}>"


def id_problem(rid: str) -> str | None:
    """Why ``rid`` is not a valid request id (None: it is)."""
    return _problem(rid, MAX_REQUEST_ID_BYTES, spaces=False)


def check_request_id(rid: str, field: str = "request_id") -> None:
    """Raise InvalidRequestError (naming ``field``) unless ``rid`` is a valid request id."""
    problem = id_problem(rid)
    if problem is not None:
        raise InvalidRequestError(field, f"{problem}: a request id is {_ID_RULE}")


def check_tenant(name: str, field: str) -> str:
    """The tenant ``name`` names, stripped; InvalidRequestError (naming ``field``) if invalid."""
    text = name.strip()
    problem = _problem(text, MAX_TENANT_BYTES, spaces=True)
    if problem is not None:
        raise InvalidRequestError(field, f"{problem}: a tenant is {_TENANT_RULE}")
    return text


def _problem(text: str, max_bytes: int, *, spaces: bool) -> str | None:
    if not text:
        return "empty"
    if len(text) > max_bytes:  # a UTF-8 character is at least one byte
        return f"{len(text)} characters, over {max_bytes} bytes"
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:
        return f"not valid Unicode (a lone surrogate at character {exc.start})"
    if size > max_bytes:
        return f"{size} bytes of UTF-8, over {max_bytes}"
    for i, ch in enumerate(text):
        if not ch.isprintable() or (not spaces and ch.isspace()):
            return f"character {i} ({ch!r}) is not allowed"
    return None
