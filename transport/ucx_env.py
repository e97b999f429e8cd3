"""The ``UCX_*`` environment as it was before ``import ucxx`` changed it.

``import ucxx`` sets process-wide UCX defaults when they are unset — ``UCX_RNDV_THRESH=8192``
among them (/work/shared/notes/ucx.md) — and every process this one starts inherits them. For
our own transport that is intended. For another UCX program started as a reference (NIXL in
`pdorch bench transport`) it is not: with a rendezvous threshold of 8 KiB, NIXL's one-sided
reads fall back to software emulation over ``tcp/lo`` (16 MiB READ: 11 ms instead of 2.3 ms
here), so the reference measured a handicapped NIXL. `for_child` gives such a process the
environment without ucxx's defaults.
"""

from __future__ import annotations

import os

_BEFORE: dict[str, str] | None = None
"""``UCX_*`` as before the first ``import ucxx`` in this process (None: not imported yet)."""


def snapshot() -> None:
    """Remember ``UCX_*`` now (called right before ucxx is imported; the first call counts)."""
    global _BEFORE  # noqa: PLW0603 - one process-wide fact, set once
    if _BEFORE is None:
        _BEFORE = {k: v for k, v in os.environ.items() if k.startswith("UCX_")}


def for_child() -> dict[str, str]:
    """This process's environment, its ``UCX_*`` as they were before ucxx's import."""
    env = dict(os.environ)
    if _BEFORE is None:
        return env
    for key in [k for k in env if k.startswith("UCX_")]:
        del env[key]
    env.update(_BEFORE)
    return env
