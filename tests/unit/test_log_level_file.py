"""A log level that follows a file (`orchestrator.cli.log_file`): what the operator's pods
use so that a changed ``logLevel`` needs no restart."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.cli.log_file import LevelFile, follow
from orchestrator.core.environment import LOG_LEVEL_FILE_ENV


@pytest.fixture(autouse=True)
def root_level() -> Iterator[None]:
    root = logging.getLogger()
    before = root.level
    root.setLevel(logging.WARNING)
    yield
    root.setLevel(before)


def _write(path: Path, text: str) -> None:
    """As the kubelet does: a new file swapped in (a new inode)."""
    new = path.with_suffix(".new")
    new.write_text(text, encoding="utf-8")
    os.replace(new, path)


def test_the_files_level_applies_and_a_change_follows(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "log-level"
    _write(path, "debug\n")
    level = LevelFile(path)
    level.check()
    assert logging.getLogger().level == logging.DEBUG
    _write(path, "ERROR")
    with caplog.at_level(logging.WARNING, logger="orchestrator.cli.log_file"):
        level.check()
    assert logging.getLogger().level == logging.ERROR
    assert f"log level now ERROR (from {path})" in caplog.text


def test_a_bad_or_missing_file_leaves_the_level_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "log-level"
    _write(path, "INFO")
    level = LevelFile(path)
    level.check()
    _write(path, "LOUD")
    with caplog.at_level(logging.WARNING, logger="orchestrator.cli.log_file"):
        level.check()
        level.check()  # unchanged since: no second warning
    assert logging.getLogger().level == logging.INFO
    assert caplog.text.count("'LOUD' is not one of") == 1
    caplog.clear()
    path.unlink()
    with caplog.at_level(logging.WARNING, logger="orchestrator.cli.log_file"):
        level.check()
        level.check()
    assert logging.getLogger().level == logging.INFO
    assert caplog.text.count("level left at INFO") == 1


def test_follow_applies_the_level_at_once_and_then_watches(tmp_path: Path) -> None:
    assert follow({}) is None  # not set: nothing to follow
    path = tmp_path / "log-level"
    _write(path, "DEBUG")
    stop = follow({LOG_LEVEL_FILE_ENV: str(path)}, poll_s=0.02)
    assert stop is not None
    try:
        assert logging.getLogger().level == logging.DEBUG  # before any poll
        _write(path, "ERROR")
        deadline = time.monotonic() + 5
        while logging.getLogger().level != logging.ERROR and time.monotonic() < deadline:
            time.sleep(0.02)
        assert logging.getLogger().level == logging.ERROR
    finally:
        stop.set()
