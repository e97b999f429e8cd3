"""The tokens file, read at start and re-read when it changes: revoking a token is an edit.

Both fronts (gRPC, HTTP) authenticate through one `TokenFile`. Each call stats the file
(microseconds) and re-reads it when its modification time, size or inode changed — so an
edit, or a Kubernetes Secret's symlink swap, takes effect on the next call, without a
restart or a signal; `reload` (the CLI's SIGHUP handler) forces a re-read. A file that no
longer parses (a half-written edit, a typo) leaves the last good table in force and is
logged once per change, at ERROR: failing open would admit everyone, failing closed on a
typo would take the service down. At start, a missing or malformed file is a `ConfigError`:
the orchestrator does not start on a table it cannot read.

The format and the rules are `orchestrator.core.auth`'s.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from orchestrator import errors
from orchestrator.core.auth import Caller, TokenTable, authenticate, parse_tokens

log = logging.getLogger(__name__)

_Stamp = tuple[int, int, int]


class TokenFile:
    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._stamp: _Stamp | None = None
        self._failed: _Stamp | None = None
        self._table = self._read(self._current_stamp(strict=True))
        log.info("tokens file %s: %d token(s)", self.path, len(self._table))

    def table(self) -> TokenTable:
        """The table in force, re-read first if the file changed."""
        stamp = self._current_stamp(strict=False)
        if stamp is not None and stamp not in (self._stamp, self._failed):
            self._reload(stamp)
        return self._table

    def reload(self) -> None:
        """Re-read the file now (SIGHUP)."""
        stamp = self._current_stamp(strict=False)
        if stamp is not None:
            self._reload(stamp)

    def authenticate(self, authorization: str | None) -> Caller:
        """The caller an ``Authorization`` value proves (`core.auth.authenticate`)."""
        return authenticate(self.table(), authorization)

    def _current_stamp(self, *, strict: bool) -> _Stamp | None:
        try:
            st = self.path.stat()
        except OSError as exc:
            if strict:
                raise errors.ConfigError("--tokens-file", f"{self.path}: {exc.strerror}") from None
            if self._failed != (0, 0, 0):
                self._failed = (0, 0, 0)
                log.error(  # noqa: TRY400 - the reason is the whole story; no traceback
                    "tokens file %s unreadable (%s); keeping the last table", self.path, exc
                )
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def _read(self, stamp: _Stamp | None) -> TokenTable:
        try:
            text = self.path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise errors.ConfigError("--tokens-file", f"{self.path}: {exc}") from None
        table = parse_tokens(text, str(self.path))
        self._stamp = stamp
        return table

    def _reload(self, stamp: _Stamp) -> None:
        try:
            table = self._read(stamp)
        except errors.ConfigError as exc:
            self._failed = stamp
            log.error("tokens file not reloaded, keeping the last table: %s", exc)  # noqa: TRY400
            return
        self._failed = None
        self._table = table
        log.warning("tokens file %s reloaded: %d token(s)", self.path, len(table))
