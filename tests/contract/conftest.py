"""Fixtures shared by the transport's contract tests."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest


@pytest.fixture(params=["asyncio", "uvloop"])
def event_loop_kind(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run the test once on asyncio's loop and once on uvloop's (the loop `asyncio.run`
    makes, and that of a `transport.testing` peer process it starts). Workers may run on
    either (`pdorch worker --loop`), so the transport must behave the same on both."""
    if request.param == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    try:
        yield request.param
    finally:
        asyncio.set_event_loop_policy(None)
