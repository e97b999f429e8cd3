"""pdorch's KV connector in real vLLM engines: a prefill process pushes, a decode process loads.

Two engines (one per process, as in production: each pdorch worker hosts one), started once for
the module (each start is 15-20 s on an idle 2-core machine, minutes on a busy one), driven by
``vllm_pd_proc.py`` over pipes. Runs in the vLLM venv (skipped elsewhere).

The engines move KV over ``ucx-read`` (issue 16 item 1): the prefill registers vLLM's KV
cache once and gathers nothing — the decode reads each layer's blocks one-sided straight out
of the prefill's cache; a push whose wire dtype differs from the cache's still gathers. The
connector's gather path over TCP runs under the worker command in `tests/vllm`
(``test_vllm_pd``, ``test_vllm_failover``: ``--transport tcp``). Without UCXX the module
runs on TCP and skips the in-place checks.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest

from transport.backend_names import TCP, UCX_READ
from transport.ucx import ucx_available

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(900),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
]

BACKEND = UCX_READ if ucx_available() else TCP

DECODE_TIMEOUT_S = 5.0
KV_BYTES_PER_TOKEN = 46080
"""SmolLM2-135M's fp32 KV: 30 layers x K and V x 3 heads x 64 x 4 bytes (whole blocks move)."""
PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "Once upon a time, in a land far away, there lived a " * 12,  # > one 128-token block
    "List the planets of the solar system and one fact about each. " * 30,  # 4+ blocks
]


class Engine:
    """One ``vllm_pd_proc.py`` process."""

    def __init__(self, role: str, model: Path, log_path: Path) -> None:
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
        script = Path(__file__).with_name("vllm_pd_proc.py")
        argv = [sys.executable, str(script), role, "--model", str(model), "--backend", BACKEND,
                "--timeout-s", str(DECODE_TIMEOUT_S)]  # fmt: skip
        self._log = log_path.open("w")
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=env,
        )
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
    logs = tmp_path_factory.mktemp("vllm-logs")
    prefill = Engine("prefill", model, logs / "prefill.log")
    decode = Engine("decode", model, logs / "decode.log")
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
    prefill: Engine, decode: Engine, ids: list[int], rid: str, epoch: int, n: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    target = decode.hello["kv_address"]
    pre = prefill.call(op="prefill", ids=ids, request_id=rid, epoch=epoch, target=target)
    assert pre["ok"], pre
    first = pre["tokens"][0]
    dec = decode.call(op="decode", ids=[*ids, first], request_id=rid, epoch=epoch, max_tokens=n - 1)
    return pre, dec


def test_pd_greedy_output_equals_aggregated(engines: tuple[Engine, Engine], tokenize: Any) -> None:
    prefill, decode = engines
    for i, text in enumerate(PROMPTS):
        ids = tokenize(text)
        ref = prefill.call(op="generate", ids=ids, max_tokens=16)
        pre, dec = _pd(prefill, decode, ids, f"eq-{i}", 1, 16)
        transfer = pre["transfer"]
        assert transfer["ok"], transfer
        assert transfer["kv_bytes"] == -(-len(ids) // 128) * 128 * KV_BYTES_PER_TOKEN
        assert transfer["in_place"] is (BACKEND == UCX_READ), transfer  # read out of vLLM's cache
        assert dec["finish_reason"] == ref["finish_reason"], (dec, ref)
        assert [pre["tokens"][0], *dec["tokens"]] == ref["tokens"], (text, pre, dec, ref)


def test_kv_that_never_arrives_fails_the_load_within_its_timeout(
    engines: tuple[Engine, Engine], tokenize: Any
) -> None:
    _, decode = engines
    ids = tokenize("Nobody pushes the KV of this prompt.")
    started = time.monotonic()
    dec = decode.call(op="decode", ids=ids, request_id="never-pushed", epoch=1, max_tokens=4)
    took = time.monotonic() - started
    assert dec["ok"], dec
    assert dec["finish_reason"] == "error", dec
    assert dec["tokens"] == [], dec
    assert DECODE_TIMEOUT_S * 0.9 <= took <= DECODE_TIMEOUT_S + 15, took
    # The failed request's blocks went back to the pool: the engine still serves a P/D request.
    prefill, _ = engines
    pre, ok = _pd(prefill, decode, ids, "after-failure", 1, 4)
    assert pre["transfer"]["ok"], pre
    assert ok["finish_reason"] in {"length", "stop"}, ok


def test_stale_epoch_is_refused_on_push_and_on_load(
    engines: tuple[Engine, Engine], tokenize: Any
) -> None:
    prefill, decode = engines
    ids = tokenize("Epochs fence zombies.")
    pre, dec = _pd(prefill, decode, ids, "fenced", 3, 4)
    assert pre["transfer"]["ok"], pre
    assert dec["finish_reason"] in {"length", "stop"}, dec
    # A zombie prefill of an older epoch: the receiver refuses it before any byte lands.
    target = decode.hello["kv_address"]
    zombie = prefill.call(op="prefill", ids=ids, request_id="fenced", epoch=2, target=target)
    transfer = zombie["transfer"]
    assert not transfer["ok"], transfer
    assert "epoch" in transfer["error"], transfer
    assert not transfer["retryable"]
    # A decode of the older epoch loads nothing and fails at once (no wait for a timeout).
    started = time.monotonic()
    stale = decode.call(
        op="decode", ids=[*ids, pre["tokens"][0]], request_id="fenced", epoch=2, max_tokens=4
    )
    assert stale["finish_reason"] == "error", stale
    assert stale["tokens"] == [], stale
    assert time.monotonic() - started < DECODE_TIMEOUT_S


def test_release_frees_a_pushed_kv_nobody_loads(
    engines: tuple[Engine, Engine], tokenize: Any
) -> None:
    prefill, decode = engines
    ids = tokenize("This KV is released, never decoded.")
    target = decode.hello["kv_address"]
    pre = prefill.call(op="prefill", ids=ids, request_id="released", epoch=1, target=target)
    assert pre["transfer"]["ok"], pre
    deadline = time.monotonic() + 10
    while decode.call(op="held")["held_bytes"] < pre["transfer"]["kv_bytes"]:
        assert time.monotonic() < deadline, "held bytes never showed the pushed KV"
        time.sleep(0.2)  # held_bytes is polled by DecodeKvControl
    assert not decode.call(op="release", request_id="released", epoch=0)["released"]
    assert decode.call(op="release", request_id="released", epoch=1)["released"]
    while decode.call(op="held")["held_bytes"] != 0:
        assert time.monotonic() < deadline, "released KV still held"
        time.sleep(0.2)


def test_a_push_encoding_its_dtype_gathers_and_lands(
    engines: tuple[Engine, Engine], tokenize: Any
) -> None:
    """fp32 cache, fp16 on the wire: a copy anyway, so the push gathers (on any backend)."""
    prefill, decode = engines
    ids = tokenize(PROMPTS[2])
    target = decode.hello["kv_address"]
    pre = prefill.call(
        op="prefill", ids=ids, request_id="encoded", epoch=1, target=target, kv_dtype="float16"
    )
    transfer = pre["transfer"]
    assert transfer["ok"], transfer
    assert not transfer["in_place"], transfer
    assert transfer["kv_bytes"] == -(-len(ids) // 128) * 128 * KV_BYTES_PER_TOKEN // 2
    dec = decode.call(
        op="decode", ids=[*ids, pre["tokens"][0]], request_id="encoded", epoch=1, max_tokens=3
    )
    assert dec["finish_reason"] != "error", dec
    assert len(dec["tokens"]) == 3
