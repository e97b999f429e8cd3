"""Redis URLs: the password folded in from a file, and taken out of anything shown.

A Redis URL may carry an ACL user and its password (``redis://USER:PASSWORD@HOST:PORT/DB``),
TLS (``rediss://``, with redis-py's query options such as ``?ssl_ca_certs=/path/ca.pem``,
``ssl_certfile``, ``ssl_keyfile``). The password should never travel in a process's
arguments (``ps`` shows them to every user of the host): the CLI takes it from
``$PDORCH_REDIS_URL`` or from ``--redis-password-file`` and folds it in with `with_password`.

Everything that *shows* a URL — log lines, error messages, `pdorch status`, the state file
`pdorch up` writes — shows `redacted` (the password replaced by ``***``) or stores
`without_password`. Pure string handling; no Redis here.
"""

from __future__ import annotations

from urllib.parse import quote, urlsplit, urlunsplit

MASK = "***"


def _split_netloc(netloc: str) -> tuple[str | None, str | None, str]:
    """(user, password, host[:port]) of a netloc, the first two still percent-encoded."""
    userinfo, at, hostport = netloc.rpartition("@")
    if not at:
        return None, None, netloc
    user, colon, password = userinfo.partition(":")
    return user, (password if colon else None), hostport


def has_password(url: str) -> bool:
    try:
        parts = urlsplit(url)
    except ValueError:
        return False
    return bool(_split_netloc(parts.netloc)[1])


def redacted(url: str) -> str:
    """``url`` with its password (if any) replaced by ``***``: safe to log and print. Text
    that does not parse as a URL is replaced whole if it might hold a password."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable Redis URL>" if "@" in url else url
    user, password, hostport = _split_netloc(parts.netloc)
    if not password:
        return url
    return urlunsplit(parts._replace(netloc=f"{user}:{MASK}@{hostport}"))


def without_password(url: str) -> str:
    """``url`` with no password (the user kept): for files other processes read."""
    parts = urlsplit(url)
    user, password, hostport = _split_netloc(parts.netloc)
    if password is None:
        return url
    netloc = f"{user}@{hostport}" if user else hostport
    return urlunsplit(parts._replace(netloc=netloc))


def with_password(url: str, password: str) -> str:
    """``url`` carrying ``password`` (percent-encoded), replacing any it had; the user
    kept (none: Redis's ``default`` user, as ``AUTH password`` means)."""
    parts = urlsplit(url)
    user, _old, hostport = _split_netloc(parts.netloc)
    secret = quote(password, safe="")
    netloc = f"{user or ''}:{secret}@{hostport}"
    return urlunsplit(parts._replace(netloc=netloc))
