"""`pdorch plan` edge inputs found by QA: a free GPU kind, a config file that is not UTF-8."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator.cli import main


def test_a_gpu_kind_priced_at_zero_is_planned_not_a_traceback(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # --price H100=0 is accepted (>= 0); colocated H100 and H100 -> H100 then both cost 0
    assert main(["plan", "--gpus=H100,A100", "--price", "H100=0"]) == 0
    out = capsys.readouterr().out
    assert "recommended: colocated H100" in out
    assert "the same cost as the best disaggregated layout" in out


def test_a_config_file_that_is_not_utf8_is_one_line_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "plan.toml"
    config.write_bytes(b"\xff\xfe[traffic]\nrate = 5\n")
    assert main(["plan", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pdorch plan: ")
    assert "not UTF-8" in err
    assert "Traceback" not in err


def test_a_gpu_kind_named_twice_is_planned_once(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--json", "--gpus=H100,A100,h100", "--prefill-gpus=H100,H100"]
    assert main(argv) == 0
    names = [layout["name"] for layout in json.loads(capsys.readouterr().out)["layouts"]]
    assert sorted(names) == ["H100 -> A100", "H100 -> H100", "colocated A100", "colocated H100"]
