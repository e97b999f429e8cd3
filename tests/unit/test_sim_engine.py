"""The simulated engine: deterministic tokens, perfmodel timings, scaled KV, the GPU clock."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from orchestrator.core import perfmodel as pm
from orchestrator.core.hardware import DEFAULT_GPUS
from orchestrator.core.prefix import PrefixIndex, block_keys
from orchestrator.core.sampling import SamplingParams
from orchestrator.errors import ConfigError
from orchestrator.workers.fleet import member_settings
from orchestrator.workers.server import WorkerSettings
from orchestrator.workers.sim_engine import (
    SIM_BLOCK,
    SimEngine,
    SimPrefixCache,
    SimRunner,
    SimSpec,
)
from transport.wire import DType, has_nonfinite

LLAMA = pm.get_model("llama-3-8b")
GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def engine() -> SimEngine:
    return SimEngine(SimSpec.parse("llama-3-8b@H100"))


# ------------------------------------------------------------------------------- spec


def test_parse_presets_and_tensor_parallel() -> None:
    spec = SimSpec.parse("llama-3-8b@h100")
    assert (spec.model, spec.gpu, spec.tp) == (LLAMA, DEFAULT_GPUS["H100"], 1)
    big = SimSpec.parse("llama-3-70b@H100x4")
    assert (big.model.name, big.tp, big.name) == ("llama-3-70b", 4, "llama-3-70b@H100x4")


@pytest.mark.parametrize(
    "text",
    [
        "llama-3-8b",  # no GPU
        "@H100",
        "llama-3-8b@",
        "llama-9@H100",  # unknown model
        "llama-3-8b@Z80",  # unknown GPU
        "llama-3-70b@H100",  # 140 GB of weights on one 80 GB GPU
        "llama-3-8b@L4x2",  # no NVLink: the planner allows no TP on an L4
        "llama-3-8b@T4",  # no bf16
    ],
)
def test_parse_refuses(text: str) -> None:
    with pytest.raises(ConfigError):
        SimSpec.parse(text)


def test_kv_is_scaled_and_capacity_follows() -> None:
    spec = SimSpec.parse("llama-3-8b@L4")
    engine = SimEngine(spec)
    real = pm.kv_bytes_per_token(LLAMA)  # 128 KiB
    assert real == 131072
    assert engine.info.kv_bytes_per_token() == spec.sim_kv_bytes_per_token == 512
    assert spec.kv_scale == 256
    usable = DEFAULT_GPUS["L4"].memory_bytes * 0.9 - LLAMA.weight_bytes
    assert spec.kv_capacity_bytes == int(int(usable) / 256)
    # Placement sees as many tokens of room as on the real GPU.
    tokens = spec.kv_capacity_bytes // engine.info.kv_bytes_per_token()
    assert abs(tokens - usable // real) <= 1


# ----------------------------------------------------------------------------- tokens


def test_tokenize_is_deterministic_and_in_vocabulary(engine: SimEngine) -> None:
    ids = engine.tokenize("the quick brown fox jumps over the lazy dog")
    assert len(ids) == 9
    assert ids[0] == ids[6]  # "the" twice
    assert ids == engine.tokenize("the  quick brown fox\njumps over the lazy dog")
    assert all(0 <= i < engine.info.vocab_size - 1 for i in ids)
    chat = engine.chat_tokens([("user", "hi there")])
    assert len(chat) == 4  # "<user>", "hi", "there", "<assistant>"
    assert engine.detokenize([5, 7]) == " t5 t7"


def _generate(engine: SimEngine, prompt: list[int], n: int, sampling: SamplingParams) -> list[int]:
    """Disaggregated-style: prefill, hand the KV over, decode one step at a time."""
    result = engine.prefill(prompt, sampling)
    state = engine.start_decode(result.kv, prompt, result.first_token, 1, sampling)
    out = [result.first_token]
    while len(out) < n:
        out += engine.decode_step([state])
    return out


def test_split_aggregated_and_failover_agree(engine: SimEngine) -> None:
    prompt = engine.tokenize("tell me about caches " * 8)
    for sampling in (GREEDY, SamplingParams(temperature=0.8, seed=7)):
        whole = _generate(engine, prompt, 12, sampling)
        assert len(set(whole)) > 6  # not a constant
        # A failover after 5 tokens re-prefills prompt + those 5 and continues at index 5.
        resumed = engine.prefill(prompt + whole[:5], sampling, first_index=5)
        assert resumed.first_token == whole[5]
        state = engine.start_decode(resumed.kv, prompt + whole[:5], whole[5], 6, sampling)
        rest = [engine.decode_step([state])[0] for _ in range(6)]
        assert whole[:6] + rest == whole
        assert state.token_ids == prompt + whole


def test_batched_steps_equal_single_steps(engine: SimEngine) -> None:
    prompts = [engine.tokenize(f"prompt {i} about things") for i in range(3)]
    alone = [_generate(engine, p, 6, GREEDY) for p in prompts]
    states = []
    for p in prompts:
        r = engine.prefill(p, GREEDY)
        states.append(engine.start_decode(r.kv, p, r.first_token, 1, GREEDY))
    batched = [[s.token_ids[-1]] for s in states]
    for _ in range(5):
        for out, token in zip(batched, engine.decode_step(states), strict=True):
            out.append(token)
    assert batched == alone


def test_seed_changes_sampled_tokens_only(engine: SimEngine) -> None:
    prompt = engine.tokenize("a prompt of some words")
    a = _generate(engine, prompt, 8, SamplingParams(temperature=1.0, seed=1))
    b = _generate(engine, prompt, 8, SamplingParams(temperature=1.0, seed=2))
    assert a != b
    assert _generate(engine, prompt, 8, SamplingParams(seed=1)) == _generate(
        engine, prompt, 8, SamplingParams(seed=2)
    )  # greedy ignores the seed


def test_never_produces_eos(engine: SimEngine) -> None:
    eos = set(engine.info.eos_token_ids)
    prompt = engine.tokenize("x")
    assert not eos & set(_generate(engine, prompt, 200, SamplingParams(temperature=1.0, seed=3)))


# --------------------------------------------------------------------------------- KV


def test_kv_shapes_dtype_and_token_stamp(engine: SimEngine) -> None:
    prompt = engine.tokenize("one two three four five")
    kv = engine.prefill(prompt, GREEDY).kv
    assert len(kv) == LLAMA.layers == engine.info.n_layers
    for k, v in kv:
        assert k.shape == v.shape == (1, 5, 4)
        assert k.dtype == v.dtype == np.uint16  # bf16 bits, as the wire carries them
    ids = kv[0][0][0, :, :2].astype(np.int64)
    assert [int(lo | hi << 14) for lo, hi in ids] == list(prompt)
    total = sum(k.nbytes + v.nbytes for k, v in kv)
    assert total == 5 * engine.info.kv_bytes_per_token()


def test_kv_of_any_token_is_finite_bf16(engine: SimEngine) -> None:
    """Receivers refuse NaN/inf KV: ids whose low 16 bits are NaN or inf as bf16 included."""
    prompt = [0x7F80, 0x7FFF, 0xFF80, 0xFFFF, 0x17F80, engine.info.vocab_size - 2]
    kv = engine.prefill(prompt, GREEDY).kv
    for k, v in kv:
        assert not has_nonfinite(k.view(np.uint8), DType.BFLOAT16)
        assert not has_nonfinite(v.view(np.uint8), DType.BFLOAT16)
    engine.start_decode(kv, prompt, 7, 1, GREEDY)  # the stamp reads back
    with pytest.raises(ValueError, match="other tokens"):
        engine.start_decode(kv, [*prompt[:-1], 1], 7, 1, GREEDY)


def test_start_decode_refuses_kv_of_other_tokens(engine: SimEngine) -> None:
    prompt = engine.tokenize("one two three")
    other = engine.tokenize("four five six")
    r = engine.prefill(other, GREEDY)
    with pytest.raises(ValueError, match="other tokens"):
        engine.start_decode(r.kv, prompt, r.first_token, 1, GREEDY)
    with pytest.raises(ValueError, match="layers"):
        engine.start_decode(r.kv[:-1], other, r.first_token, 1, GREEDY)
    with pytest.raises(ValueError, match="expected bf16"):
        engine.start_decode([(k[:, :2], v[:, :2]) for k, v in r.kv], other, 1, 1, GREEDY)


def test_foreign_state_is_refused(engine: SimEngine) -> None:
    other = SimEngine(engine.spec)
    p = engine.tokenize("a b")
    r = engine.prefill(p, GREEDY)
    state = engine.start_decode(r.kv, p, r.first_token, 1, GREEDY)
    with pytest.raises(ValueError, match="not started by this engine"):
        other.decode_step([state])
    with pytest.raises(ValueError, match="twice"):
        engine.decode_step([state, state])


# ------------------------------------------------------------------------------- time


def test_busy_seconds_come_from_the_perfmodel(engine: SimEngine) -> None:
    h100 = DEFAULT_GPUS["H100"]
    prompt = list(range(300))
    assert engine.busy_seconds(engine.prefill, (prompt, GREEDY)) == pm.prefill_seconds(
        LLAMA, h100, 300
    )
    states = []
    for n in (100, 200):
        r = engine.prefill(list(range(n)), GREEDY)
        states.append(engine.start_decode(r.kv, list(range(n)), r.first_token, 1, GREEDY))
    # Context of each: n + 1 (the sampled token); mean 151.
    assert engine.busy_seconds(engine.decode_step, (states,)) == pm.decode_step_seconds(
        LLAMA, h100, 2, 151
    )
    assert engine.busy_seconds(engine.decode_step, ([],)) == 0.0
    assert engine.busy_seconds(engine.tokenize, ("hello",)) == 0.0


def test_runner_is_a_fifo_gpu_clock() -> None:
    spec = SimSpec.parse("llama-3-8b@L4")
    engine = SimEngine(spec)
    prompt = list(range(128))
    t = spec.prefill_s(128)  # about 63 ms

    async def main() -> tuple[list[float], float, float, float]:
        runner, other = SimRunner(engine), SimRunner(engine)
        loop = asyncio.get_running_loop()
        start = loop.time()
        done: list[float] = []

        async def prefill(r: SimRunner) -> None:
            await r.call(engine.prefill, prompt, GREEDY, 0, None)
            done.append(loop.time() - start)

        async def tokenize() -> float:
            await asyncio.sleep(0)  # after both prefills have queued on the GPU
            await runner.call(engine.tokenize, "no GPU time")
            return loop.time() - start

        *_, quick = await asyncio.gather(
            prefill(runner), prefill(runner), prefill(other), tokenize()
        )
        # Each runner's clock: when its GPU is free again, from the start.
        return sorted(done), quick, runner._free_at - start, other._free_at - start

    done, quick, busy, other_busy = asyncio.run(main())
    assert busy == pytest.approx(2 * t, abs=0.01)  # two prefills queued on one GPU
    assert other_busy == pytest.approx(t, abs=0.01)  # the other GPU ran its own at once
    slack = 0.005  # the loop's clock resolution
    assert done[2] >= 2 * t - slack  # nobody returns before its simulated end
    assert quick < t  # tokenizing does not wait for the GPU


def test_member_settings() -> None:
    base = WorkerSettings(role="decode", port=7000, kv_port=0)
    assert member_settings(base, 3, 10).worker_id == "decode-3"
    assert member_settings(base, 3, 10).port == 7003
    assert member_settings(base, 3, 10).kv_port == 0
    assert member_settings(WorkerSettings(worker_id="d"), 0, 1).worker_id == "d"


# ------------------------------------------------------------------ prefix cache


def test_prefix_cache_charges_only_uncached_tokens() -> None:
    spec = SimSpec.parse("llama-3-8b@H100")
    eng = SimEngine(spec, prefix_cache=True)
    greedy = SamplingParams()
    turn1 = list(range(1, 161))  # 10 blocks of 16
    assert eng.prefill(turn1, greedy).cached_tokens == 0
    assert eng.busy_seconds(eng.prefill, [turn1]) == spec.prefill_s(160)
    turn2 = [*turn1, *range(500, 540)]
    assert eng.prefill(turn2, greedy).cached_tokens == 160  # what the worker reports
    assert eng.busy_seconds(eng.prefill, [turn2]) == spec.prefill_s(40)
    assert eng.prefill(turn1, greedy).cached_tokens == 159  # the last token is computed
    assert eng.busy_seconds(eng.prefill, [turn1]) == spec.prefill_s(1)


def test_prefix_cache_is_reported_and_bounded() -> None:
    cache = SimPrefixCache(4)
    cache.use(list(range(64)))  # 4 blocks
    assert cache.use(list(range(64))) == 64
    cache.use(list(range(1000, 1032)))  # 2 more: the 2 least recent go
    assert len(cache) == 4
    assert cache.use(list(range(64))) == 0  # block 0 was evicted: no run from the start
    eng = SimEngine(SimSpec.parse("llama-3-8b@H100"), prefix_cache=True)
    eng.prefill(list(range(48)), SamplingParams())
    size, payload = eng.prefix_report()
    index = PrefixIndex()
    index.sync({"w": (size, payload)})
    assert size == SIM_BLOCK
    assert index.match({size: block_keys(list(range(48)), size)})["w"].blocks == 3


def test_no_prefix_cache_by_default(engine: SimEngine) -> None:
    assert engine.prefix_report() == (0, "")
    prompt = list(range(1, 40))
    engine.prefill(prompt, SamplingParams())
    assert engine.prefill(prompt, SamplingParams()).cached_tokens == 0
    assert engine.busy_seconds(engine.prefill, [prompt]) == engine.spec.prefill_s(39)
