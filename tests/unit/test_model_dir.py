"""A local model directory as ``--model DIR`` (`orchestrator.cli.common.model_name`,
`orchestrator.workers.model_files.load_engine`)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from orchestrator.cli.common import model_name


def test_model_names_and_directories_are_accepted(tmp_path: Path) -> None:
    assert model_name("tiny") == "tiny"
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (tmp_path / name).write_text("{}")
    assert model_name(str(tmp_path)) == str(tmp_path.resolve())
    with pytest.raises(argparse.ArgumentTypeError, match="nor a model directory"):
        model_name(str(tmp_path / "missing"))


def test_a_directory_missing_weights_or_a_tokenizer_is_named_before_anything_starts(
    tmp_path: Path,
) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(argparse.ArgumentTypeError) as caught:
        model_name(str(tmp_path))
    assert str(caught.value).endswith(
        "it lacks weights (model.safetensors or pytorch_model.bin); "
        "a tokenizer (tokenizer.json or tokenizer.model or vocab.json or vocab.txt)"
    )
    (tmp_path / "pytorch_model.bin.index.json").write_text("{}")
    (tmp_path / "vocab.json").write_text("{}")  # a BPE tokenizer, as GPT-2's and OPT's
    assert model_name(str(tmp_path)) == str(tmp_path.resolve())


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
