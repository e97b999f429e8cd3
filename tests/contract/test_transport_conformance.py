"""The transport conformance suite (`transport.testing`), run against every backend."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from transport import testing
from transport.backends import UCX_READ
from transport.ucx import ucx_available

_UCX = [pytest.mark.ucx, pytest.mark.skipif(not ucx_available(), reason="ucxx not installed")]
BACKENDS = [  # (backend, event loop): the TCP backend on both loops workers may run on
    pytest.param("ucx", "asyncio", marks=_UCX),  # tag messages (v1, the default)
    pytest.param(UCX_READ, "asyncio", marks=_UCX),  # one-sided reads (v2, opt-in)
    ("tcp", "asyncio"),
    ("tcp", "uvloop"),
]

Check = Callable[[str], Coroutine[Any, Any, None]]


@pytest.mark.parametrize(("backend", "event_loop_kind"), BACKENDS, indirect=["event_loop_kind"])
@pytest.mark.parametrize("check", testing.CHECKS, ids=lambda c: c.__name__.removeprefix("check_"))
def test_conformance(check: Check, backend: str, event_loop_kind: str) -> None:
    asyncio.run(check(backend))
