"""The roofline model (`orchestrator.core.perfmodel`) against hand-computed cases.

TOY is a made-up two-layer model; SLOW is a made-up GPU with round figures (1 GB/s,
0.1 TFLOPS) so the times come out in readable seconds. With ``Efficiency(1, 1, 1)`` the
roofline is the bare ``max(flops / peak, bytes / bandwidth)``.

TOY: hidden 1024, 8 heads of 128 (q_dim 1024), 2 KV heads (kv_dim 256), intermediate 4096,
vocab 1000, fp16.
    layer_params = 2*1024*1024 + 2*1024*256 + 3*1024*4096
                 = 2,097,152 + 524,288 + 12,582,912 = 15,204,352
    streamed     = 2 * 15,204,352 + 1000 * 1024 = 31,432,704 params = 62,865,408 bytes
    KV per token = 2 (K, V) * 2 layers * 256 * 2 bytes = 2,048 bytes
"""

from __future__ import annotations

import pytest

from orchestrator.core import perfmodel as pm
from orchestrator.core.hardware import DEFAULT_GPUS, GpuProfile
from orchestrator.core.perfmodel import Efficiency, ModelConfig
from orchestrator.errors import ConfigError

TOY = ModelConfig(
    "toy", layers=2, hidden=1024, heads=8, kv_heads=2, intermediate=4096, vocab=1000, dtype="fp16"
)
SLOW = GpuProfile(
    "slow",
    memory_gib=1000,
    memory_bandwidth_gbs=1,
    fp16_tflops=0.1,
    bf16_tflops=0.1,
    fp8_tflops=None,
    price_per_hour=3.6,
)
BARE = Efficiency(compute=1.0, memory=1.0, tp=1.0)


def test_toy_shapes() -> None:
    assert (TOY.d_head, TOY.q_dim, TOY.kv_dim) == (128, 1024, 256)
    assert TOY.layer_params == 15_204_352
    assert TOY.streamed_weight_bytes == 62_865_408
    # stored: layers + embedding table + untied LM head = 30,408,704 + 2 * 1,024,000
    assert TOY.params == 32_456_704
    assert pm.kv_bytes_per_token(TOY) == 2_048
    assert pm.kv_bytes_per_token(TOY, "fp8") == 1_024


@pytest.mark.parametrize(
    ("name", "params", "kv_per_token"),
    [
        # HF counts 134,515,008 = ours + 30 * 2 * 576 + 576 norm weights (ignored here).
        ("smollm2-135m", 134_479_872, 2 * 30 * 3 * 64 * 2),  # 23,040
        # 8,030,261,248 on HF = ours + 32 * 2 * 4096 + 4096 norm weights.
        ("llama-3-8b", 8_029_995_008, 2 * 32 * 8 * 128 * 2),  # 131,072
        # 70,553,706,496 on HF = ours + 80 * 2 * 8192 + 8192 norm weights.
        ("llama-3-70b", 70_552_387_584, 2 * 80 * 8 * 128 * 2),  # 327,680
    ],
)
def test_presets_match_their_published_sizes(name: str, params: int, kv_per_token: int) -> None:
    model = pm.get_model(name)
    assert model.params == params
    assert pm.kv_bytes_per_token(model) == kv_per_token
    assert model.weight_bytes == 2 * params  # bf16


def test_prefill_flops_and_bytes_by_hand() -> None:
    # 1000-token prompt:
    #   2 * 2 layers * 15,204,352 * 1000  = 60,817,408,000  (matmuls)
    # + 2 * 2 layers * 1024 * 1000**2     =  4,096,000,000  (causal attention)
    # + 2 * 1024 * 1000                   =      2,048,000  (last position's logits)
    assert pm.prefill_flops(TOY, 1000) == 64_915_456_000
    assert pm.prefill_flops(TOY, 1000, batch=3) == 3 * 64_915_456_000
    # weights once + the prompt's KV written: 62,865,408 + 1000 * 2,048
    assert pm.prefill_bytes(TOY, 1000) == 64_913_408
    # compute-bound: 64.915456e9 / 0.1e12 = 0.64915456 s > 64.913408e6 / 1e9 = 0.0649 s
    assert pm.prefill_seconds(TOY, SLOW, 1000, efficiency=BARE) == pytest.approx(0.64915456)


def test_decode_step_by_hand() -> None:
    # per sequence at 1050 tokens of context:
    #   2 * 2 * 15,204,352 + 4 * 2 * 1024 * 1050 + 2 * 1024 * 1000
    # = 60,817,408 + 8,601,600 + 2,048,000 = 71,467,008 FLOPs
    assert pm.decode_step_flops(TOY, 17, 1050) == 17 * 71_467_008
    # weights + every sequence's KV read: 62,865,408 + 17 * 1050 * 2048 = 99,422,208 bytes
    assert pm.decode_step_bytes(TOY, 17, 1050) == 99_422_208
    # memory-bound: 99,422,208 B / 1 GB/s = 0.099422208 s (compute: 1.215e9 / 1e11 = 0.012 s)
    assert pm.decode_step_seconds(TOY, SLOW, 17, 1050, efficiency=BARE) == pytest.approx(
        0.099422208
    )


def test_efficiency_factors_and_tensor_parallelism_scale_the_peaks() -> None:
    eff = Efficiency(compute=0.5, memory=0.8, tp=0.9)
    # memory time 99,422,208 / (1e9 * 0.8) = 0.12427776 s
    assert pm.decode_step_seconds(TOY, SLOW, 17, 1050, efficiency=eff) == pytest.approx(0.12427776)
    # tp=4 at 0.9 each: 0.12427776 / (4 * 0.9) = 0.0345216 s
    assert pm.decode_step_seconds(TOY, SLOW, 17, 1050, tp=4, efficiency=eff) == pytest.approx(
        0.0345216
    )
    # prefill compute time 64.915456e9 / (0.1e12 * 0.5) = 1.29830912 s
    assert pm.prefill_seconds(TOY, SLOW, 1000, efficiency=eff) == pytest.approx(1.29830912)


def test_llama_3_8b_decode_on_h100_is_weight_bandwidth_bound() -> None:
    model, h100 = pm.get_model("llama-3-8b"), DEFAULT_GPUS["H100"]
    # streamed: (32 * 218,103,808 + 128,256 * 4096) * 2 bytes = 15,009,316,864
    assert model.streamed_weight_bytes == 15_009_316_864
    # batch 1, 1 token of context: (15,009,316,864 + 131,072) / (3350e9 * 0.8) = 5.6006 ms
    step = pm.decode_step_seconds(model, h100, 1, 1)
    assert step == pytest.approx((15_009_316_864 + 131_072) / (3350e9 * 0.8))
    assert step == pytest.approx(0.0056006, rel=1e-4)


def test_a_dtype_the_gpu_lacks_is_an_error() -> None:
    with pytest.raises(ConfigError, match="T4 has no bf16 support"):
        pm.prefill_seconds(pm.get_model("llama-3-8b"), DEFAULT_GPUS["T4"], 128)


def test_transfer_seconds() -> None:
    # 1 GB = 8 Gbit over 8 Gb/s = 1 s; 2,048,000 bytes over 100 Gb/s = 0.16384 ms
    assert pm.transfer_seconds(1e9, 8) == pytest.approx(1.0)
    assert pm.transfer_seconds(2_048_000, 100) == pytest.approx(0.00016384)
    with pytest.raises(ConfigError, match="link_gbps"):
        pm.transfer_seconds(1, 0)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"layers": 0}, r"model\.layers: must be an integer >= 1"),
        ({"heads": 7}, r"model\.heads: 7 does not divide hidden 1024"),
        ({"kv_heads": 3}, r"model\.kv_heads: 3 does not divide heads 8"),
        ({"dtype": "int8"}, r"model\.dtype: 'int8' is not one of bf16, fp16, fp8"),
        ({"hidden": 1024.0}, r"model\.hidden: must be an integer"),
        ({"tied_embeddings": "yes"}, r"model\.tied_embeddings: must be true or false"),
    ],
)
def test_bad_model_configs(changes: dict[str, object], message: str) -> None:
    fields: dict[str, object] = {
        "name": "m",
        "layers": 2,
        "hidden": 1024,
        "heads": 8,
        "kv_heads": 2,
        "intermediate": 4096,
        "vocab": 1000,
    }
    with pytest.raises(ConfigError, match=message):
        ModelConfig(**(fields | changes))  # type: ignore[arg-type]


def test_unknown_preset_and_bad_efficiency() -> None:
    with pytest.raises(ConfigError, match=r"model\.preset: unknown preset 'gpt-5'"):
        pm.get_model("gpt-5")
    with pytest.raises(ConfigError, match=r"efficiency\.memory: must be in \(0, 1\]"):
        Efficiency(memory=1.5)
    with pytest.raises(ConfigError, match="prompt_tokens: must be >= 1"):
        pm.prefill_flops(TOY, 0)
