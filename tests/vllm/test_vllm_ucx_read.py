"""The vLLM connector over ``ucx-read`` (issue 16 item 1): the prefill registers vLLM's KV
cache once and gathers nothing — the decode engine reads each layer's blocks one-sided
straight out of the prefill's cache — and the split request yields the aggregated run's
tokens. A push whose wire dtype differs from the cache's (``kv_dtype``) still gathers.

Two real engines in their own processes (`tests/integration/vllm_pd_proc.py`), selected
below the CLI (the worker command's ``--transport`` gains ``ucx-read`` separately).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest

from transport.backends import UCX_READ
from transport.ucx import ucx_available

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.ucx,
    pytest.mark.timeout(900),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
    pytest.mark.skipif(not ucx_available(), reason="no ucxx"),
]

SCRIPT = Path(__file__).parents[1] / "integration" / "vllm_pd_proc.py"
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a land far away, there lived a " * 12,  # > one 128-token block
    "List the planets of the solar system and one fact about each. " * 30,  # 4+ blocks
]


class Engine:
    """One ``vllm_pd_proc.py`` process on ``backend``."""

    def __init__(self, role: str, model: Path, backend: str, log_path: Path) -> None:
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
        argv = [sys.executable, str(SCRIPT), role, "--model", str(model), "--backend", backend,
                "--timeout-s", "30"]  # fmt: skip
        self.log_path = log_path
        self._log = log_path.open("w")
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
            env=env,
        )  # fmt: skip
        self.hello: dict[str, Any] = {}

    def read(self) -> dict[str, Any]:
        out: IO[str] | None = self.proc.stdout
        assert out is not None
        for line in out:
            if line.startswith("@@"):
                reply: dict[str, Any] = json.loads(line[2:])
                return reply
        raise AssertionError(f"engine process exited with {self.proc.wait()}")

    def call(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.proc.stdin.close()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log.close()


@pytest.fixture(scope="module")
def model() -> Path:
    from orchestrator.workers.model_files import ensure_smollm2  # noqa: PLC0415 - transformers

    return ensure_smollm2()


@pytest.fixture(scope="module")
def engines(
    model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Engine, Engine]]:
    logs = tmp_path_factory.mktemp("vllm-ucx-read")
    prefill = Engine("prefill", model, UCX_READ, logs / "prefill.log")
    decode = Engine("decode", model, UCX_READ, logs / "decode.log")
    try:
        prefill.hello, decode.hello = prefill.read(), decode.read()
        yield prefill, decode
    finally:
        prefill.close()
        decode.close()


@pytest.fixture(scope="module")
def tokenize(model: Path) -> Any:
    from tokenizers import Tokenizer  # noqa: PLC0415 - only where the test runs

    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    return lambda text: tok.encode(text).ids


def _pd(
    engines: tuple[Engine, Engine], ids: list[int], rid: str, n: int, kv_dtype: str = ""
) -> tuple[dict[str, Any], dict[str, Any]]:
    prefill, decode = engines
    target = decode.hello["kv_address"]
    pre = prefill.call(
        op="prefill", ids=ids, request_id=rid, epoch=1, target=target, kv_dtype=kv_dtype
    )
    assert pre["ok"], pre
    dec = decode.call(
        op="decode", ids=[*ids, pre["tokens"][0]], request_id=rid, epoch=1, max_tokens=n - 1
    )
    assert dec["ok"], dec
    return pre, dec


def test_pd_over_ucx_read_reads_blocks_in_place_and_equals_aggregated(
    engines: tuple[Engine, Engine], tokenize: Any
) -> None:
    prefill, _ = engines
    for i, text in enumerate(PROMPTS):
        ids = tokenize(text)
        ref = prefill.call(op="generate", ids=ids, max_tokens=16)
        pre, dec = _pd(engines, ids, f"in-place-{i}", 16)
        transfer = pre["transfer"]
        assert transfer["ok"], transfer
        assert transfer["in_place"], transfer  # no gather: read out of vLLM's cache
        assert transfer["kv_bytes"] == -(-len(ids) // 128) * 128 * 46080  # whole blocks
        assert [pre["tokens"][0], *dec["tokens"]] == ref["tokens"], (text, pre, dec, ref)


def test_a_push_encoding_its_dtype_gathers_and_lands(
    engines: tuple[Engine, Engine], tokenize: Any
) -> None:
    ids = tokenize(PROMPTS[1])
    pre, dec = _pd(engines, ids, "encoded", 4, kv_dtype="float16")
    transfer = pre["transfer"]
    assert transfer["ok"], transfer
    assert not transfer["in_place"], transfer  # fp32 cache, fp16 wire: a copy anyway
    assert transfer["kv_bytes"] == -(-len(ids) // 128) * 128 * 46080 // 2
    assert dec["finish_reason"] != "error", dec
    assert len(dec["tokens"]) == 3
