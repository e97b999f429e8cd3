"""Which event loop a server command runs on (`cli.event_loop`): the orchestrator on uvloop
when installed and not told otherwise, a worker on asyncio's; asyncio's when told, or — with
one warning — when uvloop is missing."""

from __future__ import annotations

import asyncio
import logging
import sys

import pytest

from orchestrator.cli import event_loop
from orchestrator.cli.app import build_parser
from orchestrator.cli.common import CommandError


@pytest.fixture
def no_uvloop(monkeypatch: pytest.MonkeyPatch) -> None:
    """uvloop as a missing package: ``import uvloop`` raises ImportError."""
    monkeypatch.setitem(sys.modules, "uvloop", None)


async def _loop_class() -> str:
    return event_loop.running()


def test_run_uses_the_named_loop() -> None:
    assert event_loop.run(_loop_class(), event_loop.UVLOOP) == "uvloop.Loop"
    default = asyncio.new_event_loop()
    try:
        expected = f"{type(default).__module__}.{type(default).__qualname__}"
    finally:
        default.close()
    assert event_loop.run(_loop_class(), event_loop.ASYNCIO) == expected
    assert "uvloop" not in expected


def test_the_preferred_loop_is_chosen_when_installed_and_not_told_otherwise(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING):
        assert event_loop.choose(None, event_loop.UVLOOP) == event_loop.UVLOOP
        assert event_loop.choose(None, event_loop.ASYNCIO) == event_loop.ASYNCIO
        assert event_loop.choose("asyncio", event_loop.UVLOOP) == event_loop.ASYNCIO
        assert event_loop.choose("uvloop", event_loop.ASYNCIO) == event_loop.UVLOOP
    assert caplog.records == []


@pytest.mark.usefixtures("no_uvloop")
def test_without_uvloop_the_default_falls_back_with_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING):
        assert event_loop.choose(None, event_loop.UVLOOP) == event_loop.ASYNCIO
    assert [r.getMessage() for r in caplog.records] == [event_loop.FALLBACK_WARNING]
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # chosen, or asyncio preferred: no warning
        assert event_loop.choose("asyncio", event_loop.UVLOOP) == event_loop.ASYNCIO
        assert event_loop.choose(None, event_loop.ASYNCIO) == event_loop.ASYNCIO
    assert caplog.records == []


@pytest.mark.usefixtures("no_uvloop")
def test_without_uvloop_asking_for_it_is_an_error() -> None:
    with pytest.raises(CommandError, match="--loop uvloop: uvloop is not installed"):
        event_loop.choose("uvloop", event_loop.ASYNCIO)


@pytest.mark.parametrize(
    ("argv", "preferred"),
    [
        (["orchestrator"], event_loop.ORCHESTRATOR_LOOP),
        (["worker", "--role", "decode", "--sim", "llama-3-8b@L4"], event_loop.WORKER_LOOP),
    ],
)
def test_server_commands_take_loop(argv: list[str], preferred: str) -> None:
    parser = build_parser(env={})
    args = parser.parse_args(argv)
    assert (args.loop, args.preferred_loop) == (None, preferred)  # `choose` decides
    assert parser.parse_args([*argv, "--loop", "asyncio"]).loop == "asyncio"
    with pytest.raises(SystemExit):
        parser.parse_args([*argv, "--loop", "trio"])


def test_the_orchestrator_prefers_uvloop_and_workers_asyncio() -> None:
    """The measured choice (README: Control plane at scale)."""
    assert event_loop.ORCHESTRATOR_LOOP == event_loop.UVLOOP
    assert event_loop.WORKER_LOOP == event_loop.ASYNCIO
