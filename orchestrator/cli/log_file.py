"""A log level that follows a file (``$PDORCH_LOG_LEVEL_FILE``), so that changing it needs
no restart.

The Kubernetes operator mounts its ConfigMap's log level as a file in every pod; the
kubelet swaps in a new version when the resource's ``logLevel`` changes, and each process
applies it within `POLL_S` (the kubelet's own sync takes up to a minute or so). The file is
checked by its status (modification time, size, inode: a swapped-in version changes one)
and read only when that changed. While the variable is set the file's level is the
process's — read first at start, over ``--log-level`` and ``$PDORCH_LOG_LEVEL`` — and a
change is logged at WARNING so that it shows whatever the old level was. A file that
cannot be read or holds no level leaves the level as it was, with one warning until the
file changes again.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from pathlib import Path

from orchestrator.cli.common import LOG_LEVELS
from orchestrator.core.environment import LOG_LEVEL_FILE_ENV

log = logging.getLogger(__name__)

POLL_S = 5.0
"""How often the file's status is checked."""

_Stat = tuple[int, int, int] | None


class LevelFile:
    """The level in ``path``, applied to the root logger when the file changed."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._seen: object = object()  # none yet: the first check reads the file
        self.level: str | None = None
        """The level applied from the file (None: none yet)."""

    def _stat(self) -> _Stat:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def check(self) -> None:
        """Apply the file's level if the file changed since the last check."""
        seen = self._stat()
        if seen == self._seen:
            return
        self._seen = seen
        try:
            text = self.path.read_text(encoding="utf-8").strip().upper()
        except (OSError, UnicodeDecodeError) as exc:
            log.warning("log level file %s: %s (level left at %s)", self.path, exc, self._now())
            return
        if text not in LOG_LEVELS:
            log.warning(
                "log level file %s: %r is not one of %s (level left at %s)",
                self.path,
                text[:40],
                ", ".join(LOG_LEVELS),
                self._now(),
            )
            return
        if text != self._now():
            logging.getLogger().setLevel(text)
            log.warning("log level now %s (from %s)", text, self.path)
        self.level = text

    @staticmethod
    def _now() -> str:
        return logging.getLevelName(logging.getLogger().getEffectiveLevel())


def follow(env: Mapping[str, str], *, poll_s: float = POLL_S) -> threading.Event | None:
    """With ``$PDORCH_LOG_LEVEL_FILE`` set: its level now, then a daemon thread
    (``pdorch-log-level``) that checks it every ``poll_s``; the event it returns stops
    that thread. None when the variable is not set."""
    path = env.get(LOG_LEVEL_FILE_ENV, "")
    if not path:
        return None
    level = LevelFile(Path(path))
    level.check()
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(poll_s):
            try:
                level.check()
            except Exception:  # a bug here must not end the thread silently
                log.exception("log level file %s: check failed", path)

    threading.Thread(target=watch, name="pdorch-log-level", daemon=True).start()
    return stop
