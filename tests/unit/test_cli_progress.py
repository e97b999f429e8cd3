"""Progress lines (`orchestrator.cli.progress`): timed steps on stderr, silent when quiet."""

from __future__ import annotations

import io

import pytest

from orchestrator.cli.progress import Progress


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_step_in_a_log_is_a_start_line_and_a_timed_end_line() -> None:
    out = io.StringIO()
    with Progress(stream=out).step("workers loading"):
        pass
    start, end = out.getvalue().splitlines()
    assert start == "workers loading ..."
    assert end.startswith("workers loading: done in ")
    assert end.endswith(" s")


def test_a_failed_step_says_so_and_the_error_goes_on() -> None:
    out = io.StringIO()
    with pytest.raises(RuntimeError), Progress(stream=out).step("orchestrator"):
        raise RuntimeError("boom")
    assert "orchestrator: FAILED in " in out.getvalue()


def test_quiet_prints_nothing() -> None:
    out = _Tty()
    progress = Progress(quiet=True, stream=out)
    with progress.step("x", lambda: "1/3"):
        progress.say("hello")
    assert out.getvalue() == ""


def test_on_a_terminal_the_line_is_redrawn_in_place() -> None:
    out = _Tty()
    with Progress(stream=out).step("x", lambda: "3/3 registered"):
        pass
    assert out.getvalue().startswith("\r\033[Kx: done in ")
