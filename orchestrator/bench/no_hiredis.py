"""Hide hiredis from the processes a benchmark starts, and ask one whether redis-py uses it.

redis-py parses replies with hiredis (C) when ``import hiredis`` succeeds, in pure Python
otherwise; there is no switch. A directory holding a ``hiredis`` module that fails to
import, first on ``PYTHONPATH``, is that switch for the processes started with it — the
installed package is left alone, so one benchmark run can compare both.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HIDDEN = "hiredis.py"


def without_hiredis(workdir: Path) -> dict[str, str]:
    """The environment that hides hiredis from a Python process: a ``hiredis`` module
    first on its path that fails to import, which redis-py takes as "not installed"."""
    shim = workdir / "no-hiredis"
    shim.mkdir(parents=True, exist_ok=True)
    (shim / HIDDEN).write_text('raise ImportError("hidden by pdorch bench --hiredis off")\n')
    path = os.environ.get("PYTHONPATH", "")
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(shim), path) if p)}


def child_hiredis(env: dict[str, str]) -> bool:
    """Whether redis-py parses with hiredis in a process started with ``env`` (asked of
    one, as the bench's processes are started)."""
    code = "import redis.utils as u; print(u.HIREDIS_AVAILABLE)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return out.stdout.strip() == "True"
