"""What makes a directory a model directory: the files transformers' ``save_pretrained``
leaves, which both engines (the reference one, vLLM) load from.

Checked before anything starts (`orchestrator.cli.common.model_name`), so that a folder
missing its weights or tokenizer is named in one line, not found by a worker process's
traceback minutes later.
"""

from __future__ import annotations

from pathlib import Path

WEIGHTS = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
"""Any one of these holds (or indexes) the weights."""
TOKENIZERS = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")
"""Any one of these holds a tokenizer (a fast one's file, SentencePiece's, a BPE vocabulary
with its merges.txt, WordPiece's)."""


def gaps(path: Path) -> list[str]:
    """What ``path`` lacks to be a model directory (empty: it is one)."""
    out = []
    if not (path / "config.json").is_file():
        out.append("config.json")
    if not any((path / name).is_file() for name in WEIGHTS):
        out.append("weights (" + " or ".join(WEIGHTS[::2]) + ")")
    if not any((path / name).is_file() for name in TOKENIZERS):
        out.append("a tokenizer (" + " or ".join(TOKENIZERS) + ")")
    return out
