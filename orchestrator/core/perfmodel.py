"""Roofline performance model of a decoder-only transformer (Llama-style) on a GPU kind. Pure.

A forward pass takes as long as the slower of its compute and its memory traffic::

    seconds = max(flops / (tp * peak_flops * eff.compute * f_tp),
                  bytes / (tp * bandwidth  * eff.memory  * f_tp))

with ``f_tp = eff.tp`` for a tensor-parallel group (tp > 1) and 1 otherwise. Counting, for a
model with L layers, hidden size h, q_dim = heads * head_dim, kv_dim = kv_heads * head_dim,
intermediate size i and vocabulary V (``layer_params = 2*h*q_dim + 2*h*kv_dim + 3*h*i``,
SwiGLU MLP; norms and biases ignored):

* **prefill** of ``batch`` prompts of p tokens::

      flops = batch * (2 * L * layer_params * p      # every matmul, every prompt token
                       + 2 * L * q_dim * p**2        # causal attention: sum of 4*q_dim*j, j<=p
                       + 2 * h * V)                  # logits of the last position only
      bytes = streamed_weights + batch * p * kv_bytes_per_token      # weights read, KV written

* **one decode step** of ``batch`` sequences with c tokens of context each::

      flops = batch * (2 * L * layer_params + 4 * L * q_dim * c + 2 * h * V)
      bytes = streamed_weights + batch * c * kv_bytes_per_token      # weights and KV read

``streamed_weights`` is what a forward pass reads: every layer plus the LM head (the embedding
table is only gathered from). Activations, kernel launch overheads and tensor-parallel
communication are not counted (the efficiency factors stand in for them), so these times are
optimistic lower bounds of a well-tuned engine, fit for comparing layouts, not for promising
latencies.

This is also the timing source for simulated workers: ``prefill_seconds``,
``decode_step_seconds``, ``kv_bytes_per_token`` and ``transfer_seconds`` are the API.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from orchestrator.core.hardware import DTYPES, GpuProfile
from orchestrator.errors import ConfigError

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp8": 1}


@dataclass(frozen=True, slots=True)
class Efficiency:
    """Fractions of the datasheet peaks a real engine reaches. Assumptions, not measurements."""

    compute: float = 0.5
    """Of peak tensor FLOP/s in compute-bound phases (prefill): serving engines commonly
    report 40-60 % model FLOPs utilisation for large prefills."""
    memory: float = 0.8
    """Of peak memory bandwidth in memory-bound phases (decode): well-tuned decode kernels
    commonly reach 70-85 % of peak bandwidth."""
    tp: float = 0.9
    """Per-GPU efficiency left in a tensor-parallel group (tp > 1) after its all-reduces."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not 0 < value <= 1:
                raise ConfigError(f"efficiency.{f.name}", f"must be in (0, 1], got {value!r}")


DEFAULT_EFFICIENCY = Efficiency()


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The shape of a Llama-style decoder (GQA attention, SwiGLU MLP)."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    dtype: str = "bf16"
    """Weights and activations: bf16, fp16 or fp8."""
    kv_dtype: str | None = None
    """KV cache; None: same as ``dtype``."""
    tied_embeddings: bool = False
    """LM head shares the embedding table (stored once)."""
    head_dim: int | None = None
    """None: hidden // heads."""

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "kv_heads", "intermediate", "vocab"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"model.{name}", f"must be an integer >= 1, got {value!r}")
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError("model.name", f"must be a non-empty string, got {self.name!r}")
        if not isinstance(self.tied_embeddings, bool):
            raise ConfigError(
                "model.tied_embeddings", f"must be true or false, got {self.tied_embeddings!r}"
            )
        if self.head_dim is not None and (
            isinstance(self.head_dim, bool) or not isinstance(self.head_dim, int)
        ):
            raise ConfigError("model.head_dim", f"must be an integer, got {self.head_dim!r}")
        if self.head_dim is None and self.hidden % self.heads:
            raise ConfigError("model.heads", f"{self.heads} does not divide hidden {self.hidden}")
        if self.heads % self.kv_heads:
            raise ConfigError(
                "model.kv_heads", f"{self.kv_heads} does not divide heads {self.heads}"
            )
        for name in ("dtype", "kv_dtype"):
            value = getattr(self, name)
            if value is not None and value not in DTYPES:
                raise ConfigError(f"model.{name}", f"{value!r} is not one of {', '.join(DTYPES)}")

    @property
    def d_head(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden // self.heads

    @property
    def q_dim(self) -> int:
        return self.heads * self.d_head

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.d_head

    @property
    def layer_params(self) -> int:
        """q, k, v, o projections and the three MLP matrices of one layer."""
        h = self.hidden
        return 2 * h * self.q_dim + 2 * h * self.kv_dim + 3 * h * self.intermediate

    @property
    def params(self) -> int:
        """Stored parameters: layers, embedding table, LM head unless tied."""
        embeddings = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return self.layers * self.layer_params + embeddings

    @property
    def streamed_params(self) -> int:
        """Parameters a forward pass reads in full: the layers and the LM head."""
        return self.layers * self.layer_params + self.vocab * self.hidden

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def weight_bytes(self) -> int:
        """Device memory the weights take."""
        return self.params * self.dtype_bytes

    @property
    def streamed_weight_bytes(self) -> int:
        return self.streamed_params * self.dtype_bytes


MODEL_PRESETS: dict[str, ModelConfig] = {
    m.name: m
    for m in (
        # HuggingFaceTB/SmolLM2-135M config.json (the model `make demo` serves).
        ModelConfig(
            "smollm2-135m",
            layers=30,
            hidden=576,
            heads=9,
            kv_heads=3,
            intermediate=1536,
            vocab=49152,
            tied_embeddings=True,
        ),
        # meta-llama/Meta-Llama-3-8B and -70B config.json.
        ModelConfig(
            "llama-3-8b",
            layers=32,
            hidden=4096,
            heads=32,
            kv_heads=8,
            intermediate=14336,
            vocab=128256,
        ),
        ModelConfig(
            "llama-3-70b",
            layers=80,
            hidden=8192,
            heads=64,
            kv_heads=8,
            intermediate=28672,
            vocab=128256,
        ),
    )
}


def get_model(name: str) -> ModelConfig:
    for key, model in MODEL_PRESETS.items():
        if key == name.strip().lower():
            return model
    raise ConfigError(
        "model.preset", f"unknown preset {name!r} (known: {', '.join(MODEL_PRESETS)})"
    )


# ------------------------------------------------------------------------ FLOPs and bytes


def kv_bytes_per_token(model: ModelConfig, dtype: str | None = None) -> int:
    """K and V of every layer for one token: ``2 * layers * kv_dim * bytes(dtype)``.

    ``dtype`` defaults to the model's KV dtype (its ``kv_dtype``, else its ``dtype``).
    """
    dtype = dtype or model.kv_dtype or model.dtype
    if dtype not in DTYPE_BYTES:
        raise ConfigError("dtype", f"{dtype!r} is not one of {', '.join(DTYPES)}")
    return 2 * model.layers * model.kv_dim * DTYPE_BYTES[dtype]


def _check_counts(**counts: int) -> None:
    for name, value in counts.items():
        if value < 1:
            raise ConfigError(name, f"must be >= 1, got {value!r}")


def prefill_flops(model: ModelConfig, prompt_tokens: int, batch: int = 1) -> float:
    _check_counts(prompt_tokens=prompt_tokens, batch=batch)
    p = prompt_tokens
    per_seq = (
        2 * model.layers * model.layer_params * p
        + 2 * model.layers * model.q_dim * p * p
        + 2 * model.hidden * model.vocab
    )
    return float(batch * per_seq)


def prefill_bytes(model: ModelConfig, prompt_tokens: int, batch: int = 1) -> float:
    _check_counts(prompt_tokens=prompt_tokens, batch=batch)
    return float(model.streamed_weight_bytes + batch * prompt_tokens * kv_bytes_per_token(model))


def decode_step_flops(model: ModelConfig, batch: int, context_tokens: int) -> float:
    _check_counts(batch=batch, context_tokens=context_tokens)
    per_seq = (
        2 * model.layers * model.layer_params
        + 4 * model.layers * model.q_dim * context_tokens
        + 2 * model.hidden * model.vocab
    )
    return float(batch * per_seq)


def decode_step_bytes(model: ModelConfig, batch: int, context_tokens: int) -> float:
    _check_counts(batch=batch, context_tokens=context_tokens)
    return float(model.streamed_weight_bytes + batch * context_tokens * kv_bytes_per_token(model))


# ------------------------------------------------------------------------------ roofline


def roofline_seconds(
    flops: float,
    nbytes: float,
    gpu: GpuProfile,
    dtype: str,
    *,
    tp: int = 1,
    efficiency: Efficiency = DEFAULT_EFFICIENCY,
) -> float:
    """``max(compute time, memory time)`` on a group of ``tp`` GPUs of one kind."""
    peak = gpu.peak_tflops(dtype)
    if peak is None:
        raise ConfigError("dtype", f"{gpu.name} has no {dtype} support")
    if tp < 1:
        raise ConfigError("tp", f"must be >= 1, got {tp!r}")
    group = tp * (efficiency.tp if tp > 1 else 1.0)
    compute_s = flops / (group * peak * 1e12 * efficiency.compute)
    memory_s = nbytes / (group * gpu.memory_bandwidth_gbs * 1e9 * efficiency.memory)
    return max(compute_s, memory_s)


def prefill_seconds(
    model: ModelConfig,
    gpu: GpuProfile,
    prompt_tokens: int,
    batch: int = 1,
    *,
    tp: int = 1,
    efficiency: Efficiency = DEFAULT_EFFICIENCY,
) -> float:
    """Time to prefill ``batch`` prompts of ``prompt_tokens`` tokens together."""
    return roofline_seconds(
        prefill_flops(model, prompt_tokens, batch),
        prefill_bytes(model, prompt_tokens, batch),
        gpu,
        model.dtype,
        tp=tp,
        efficiency=efficiency,
    )


def decode_step_seconds(
    model: ModelConfig,
    gpu: GpuProfile,
    batch: int,
    context_tokens: int,
    *,
    tp: int = 1,
    efficiency: Efficiency = DEFAULT_EFFICIENCY,
) -> float:
    """Time of one decode step (one token for each of ``batch`` sequences)."""
    return roofline_seconds(
        decode_step_flops(model, batch, context_tokens),
        decode_step_bytes(model, batch, context_tokens),
        gpu,
        model.dtype,
        tp=tp,
        efficiency=efficiency,
    )


def transfer_seconds(nbytes: float, link_gbps: float) -> float:
    """Time to move ``nbytes`` over a link of ``link_gbps`` gigabits per second."""
    if not (link_gbps > 0 and math.isfinite(link_gbps)):
        raise ConfigError("link_gbps", f"must be a positive number, got {link_gbps!r}")
    return nbytes * 8 / (link_gbps * 1e9)
