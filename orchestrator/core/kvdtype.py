"""Which dtype a prompt's KV travels in from a prefill worker to a decode worker. Pure.

The orchestrator decides per prefill→decode pair (`negotiate`) and names the result in its
Prefill call; the prefill worker converts its KV to that dtype before sending, and the
decode worker converts it back to the dtype it computes in on receive (`transport.kvcodec`).
The policy is the orchestrator's ``--kv-dtype``:

``auto`` (default)
    Convert to 16 bits between GPUs: a GPU pool holds KV in 16 bits anyway (bf16 where the
    kind has bf16, fp16 otherwise: T4). So:

    - 16-bit KV travels as is when the decode kind has that dtype (bf16 H100 → L4: native);
      bf16 KV to a kind without bf16 travels as fp16 ("T4 has no bf16").
    - float32 KV (the CPU reference engine standing in for a GPU) is narrowed to fp16,
      whatever the decode kind: half the bytes, and fp16's 10-bit mantissa (vs bf16's 7)
      keeps the tokens — `pdorch bench precision` on SmolLM2-135M measured 100% agreement
      for fp16 and 91.75% for bf16. (Values beyond ±65504 saturate.)
    - When either side is not a GPU (``--gpu-kind cpu``, or a kind the price table does
      not know), nothing is converted: the engines really compute in float32 there.

    ``auto`` never picks fp8: it changes outputs measurably (`pdorch bench precision`).
``native``
    Never convert.
``fp16``
    fp16 whatever the pair (from bf16: more mantissa, but range only to ±65504).
``fp8``
    e4m3 with one float32 scale per KV head (`transport.kvcodec`): a quarter of float32's
    bytes, half of fp16's. Only when the **prefill** kind has fp8 (Hopper, Ada: it quantizes
    with its native e4m3 conversion); the decode side only multiplies codes by scales on
    receive, which any GPU does, so the decode kind needs no fp8 (H100 → T4 is fine).
    Without fp8 on the prefill kind the ``auto`` choice applies, and the reason says why.

KV whose bits are not numbers (the simulated engine's KV carries token ids) is never
converted, whatever the policy: its worker publishes no KV dtype.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

from orchestrator.core.hardware import CPU_HOST, GpuProfile
from orchestrator.core.records import WorkerInfo
from transport.wire import DType


class KvPolicy(enum.StrEnum):
    AUTO = "auto"
    NATIVE = "native"
    FP16 = "fp16"
    FP8 = "fp8"


@dataclass(frozen=True, slots=True)
class KvChoice:
    """The negotiated wire dtype of one transfer, and why."""

    dtype: DType | None
    """What the KV travels in; None: as the prefill engine holds it (unknown here)."""
    reason: str
    source: DType | None = None
    """The prefill engine's KV dtype, when known."""

    @property
    def converted(self) -> bool:
        return self.dtype is not None and self.dtype is not self.source

    @property
    def label(self) -> str:
        """``float16 (H100→T4: float32 narrowed to fp16)``: what a request record shows."""
        name = self.dtype.name.lower() if self.dtype is not None else "native"
        return f"{name} ({self.reason})"

    def ratio(self) -> float:
        """Wire bytes per source byte, scales aside (1.0 when not converted or unknown)."""
        if self.dtype is None or self.source is None:
            return 1.0
        return self.dtype.itemsize / self.source.itemsize


CONVERTIBLE = frozenset({DType.FLOAT32, DType.BFLOAT16, DType.FLOAT16})


def gpu_kv_dtype(gpu: GpuProfile) -> DType:
    """The dtype a GPU of this kind holds KV in: bf16 where it has bf16, else fp16."""
    return DType.BFLOAT16 if gpu.supports_bf16 else DType.FLOAT16


def _name(gpu: GpuProfile | None) -> str:
    return gpu.name if gpu is not None else CPU_HOST.name


def _auto(source: DType, prefill: GpuProfile | None, decode: GpuProfile | None) -> KvChoice:
    pair = f"{_name(prefill)}→{_name(decode)}"
    if prefill is None or decode is None:
        return KvChoice(source, f"{pair}: not a GPU pair, KV as computed", source)
    if source is DType.FLOAT32:
        return KvChoice(DType.FLOAT16, f"{pair}: float32 narrowed to fp16", source)
    if source is DType.BFLOAT16 and gpu_kv_dtype(decode) is DType.FLOAT16:
        return KvChoice(DType.FLOAT16, f"{pair}: {decode.name} has no bf16", source)
    return KvChoice(source, f"{pair}: {source.name.lower()} native", source)


def negotiate(
    source: DType | None,
    prefill: GpuProfile | None,
    decode: GpuProfile | None,
    policy: KvPolicy,
) -> KvChoice:
    """The wire dtype for KV held as ``source`` (None: not convertible) by a prefill worker
    on ``prefill`` going to a decode worker on ``decode`` (None: not a GPU). See the module
    docstring for the rule."""
    if source is None or source not in CONVERTIBLE:
        return KvChoice(source, "KV not convertible: sent as computed", source)
    if policy is KvPolicy.NATIVE:
        return KvChoice(source, "policy native", source)
    if policy is KvPolicy.FP16:
        return KvChoice(DType.FLOAT16, "policy fp16", source)
    if policy is KvPolicy.FP8:
        if prefill is not None and prefill.supports_fp8:
            return KvChoice(
                DType.FLOAT8_E4M3,
                f"policy fp8: {prefill.name} quantizes to e4m3 with per-head scales, "
                f"{_name(decode)} dequantizes on receive",
                source,
            )
        fallback = _auto(source, prefill, decode)
        return KvChoice(
            fallback.dtype,
            f"fp8 refused, {_name(prefill)} has no fp8; {fallback.reason}",
            source,
        )
    return _auto(source, prefill, decode)


def _profile(table: Mapping[str, GpuProfile], kind: str) -> GpuProfile | None:
    """The GPU profile of a worker's kind; None for the CPU host or an unknown kind."""
    for key, profile in table.items():
        if key.lower() == kind.strip().lower():
            return None if profile.name == CPU_HOST.name else profile
    return None


def source_dtype(worker: WorkerInfo) -> DType | None:
    """The KV dtype a worker published (None when it publishes none or an unknown one)."""
    try:
        return DType[worker.kv_dtype.upper()] if worker.kv_dtype else None
    except KeyError:
        return None


def negotiate_for(
    prefill: WorkerInfo, decode: WorkerInfo, policy: KvPolicy, table: Mapping[str, GpuProfile]
) -> KvChoice:
    """`negotiate` for two registered workers, their kinds looked up in ``table``."""
    return negotiate(
        source_dtype(prefill),
        _profile(table, prefill.gpu_kind),
        _profile(table, decode.gpu_kind),
        policy,
    )
