"""A local model directory as ``--model DIR`` (`orchestrator.cli.common.model_name`,
`orchestrator.workers.model_files.load_engine`)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from orchestrator.cli.common import model_name


def test_model_names_and_directories_are_accepted(tmp_path: Path) -> None:
    assert model_name("tiny") == "tiny"
    (tmp_path / "config.json").write_text("{}")
    assert model_name(str(tmp_path)) == str(tmp_path.resolve())
    with pytest.raises(argparse.ArgumentTypeError, match="nor a model directory"):
        model_name(str(tmp_path / "missing"))


@pytest.mark.slow  # torch and transformers: ~13 s on a busy machine
def test_a_saved_model_directory_loads_as_the_same_model(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from orchestrator.workers.model_files import load_engine, tiny_engine  # noqa: PLC0415

    tiny = tiny_engine()
    saved = tmp_path / "my-model"
    tiny.model.save_pretrained(saved)
    tiny.tokenizer.save_pretrained(saved)
    engine = load_engine(str(saved))
    assert engine.info.name == "my-model"
    assert engine.info.fingerprint == tiny.info.fingerprint  # same weights, same shapes
    assert engine.tokenize("hello") == tiny.tokenize("hello")
