"""`pdorch chaos run` edge inputs found by QA."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.cli import main


def test_a_scenario_file_that_is_not_utf8_is_one_line_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    scenario = tmp_path / "mine.yaml"
    scenario.write_bytes(b"\xff\xfename: mine\n")
    assert main(["chaos", "run", str(scenario)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pdorch chaos: {scenario}: ")
    assert "Traceback" not in err
