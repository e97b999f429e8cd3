"""KV dtype negotiation per prefill→decode pair (`orchestrator.core.kvdtype`)."""

from __future__ import annotations

import pytest

from orchestrator.core.hardware import CPU_HOST, DEFAULT_GPUS, PRICED_KINDS, GpuProfile
from orchestrator.core.kvdtype import KvPolicy, negotiate, negotiate_for
from orchestrator.core.records import WorkerInfo
from transport.wire import DType

F32, F16, BF16, FP8 = DType.FLOAT32, DType.FLOAT16, DType.BFLOAT16, DType.FLOAT8_E4M3
AUTO, NATIVE, P16, P8 = KvPolicy.AUTO, KvPolicy.NATIVE, KvPolicy.FP16, KvPolicy.FP8


def gpu(name: str) -> GpuProfile | None:
    return None if name == "cpu" else DEFAULT_GPUS[name]


@pytest.mark.parametrize(
    ("source", "prefill", "decode", "policy", "wire", "why"),
    [
        # auto: 16-bit KV native where the decode kind holds it, bf16 -> fp16 for T4
        (BF16, "H100", "L4", AUTO, BF16, "bfloat16 native"),
        (BF16, "H100", "H100", AUTO, BF16, "bfloat16 native"),
        (BF16, "H100", "T4", AUTO, F16, "T4 has no bf16"),
        (F16, "H100", "T4", AUTO, F16, "float16 native"),
        (F16, "A100", "L4", AUTO, F16, "float16 native"),
        # auto: float32 (the CPU engine as a GPU) narrowed to fp16 (bench: fp16 keeps tokens)
        (F32, "H100", "T4", AUTO, F16, "H100→T4: float32 narrowed to fp16"),
        (F32, "H100", "L4", AUTO, F16, "float32 narrowed to fp16"),
        (F32, "A100", "L40S", AUTO, F16, "float32 narrowed to fp16"),
        # auto: no GPU on a side -> as computed
        (F32, "cpu", "cpu", AUTO, F32, "not a GPU pair"),
        (F32, "H100", "cpu", AUTO, F32, "not a GPU pair"),
        (BF16, "cpu", "T4", AUTO, BF16, "not a GPU pair"),
        # native never converts, even bf16 to a T4
        (BF16, "H100", "T4", NATIVE, BF16, "policy native"),
        (F32, "H100", "T4", NATIVE, F32, "policy native"),
        # fp16 forced
        (F32, "cpu", "cpu", P16, F16, "policy fp16"),
        (BF16, "H100", "L4", P16, F16, "policy fp16"),
        # fp8: needs fp8 on the prefill kind only
        (F32, "H100", "T4", P8, FP8, "H100 quantizes"),
        (BF16, "L4", "A100", P8, FP8, "A100 dequantizes"),
        (BF16, "A100", "T4", P8, F16, "fp8 refused, A100 has no fp8; A100→T4: T4 has no bf16"),
        (F32, "T4", "L4", P8, F16, "fp8 refused, T4 has no fp8"),
        (BF16, "T4", "L4", P8, BF16, "fp8 refused, T4 has no fp8; T4→L4: bfloat16 native"),
        (F32, "cpu", "cpu", P8, F32, "fp8 refused, CPU has no fp8; CPU→CPU: not a GPU pair"),
    ],
)
def test_the_table_of_pairs(
    source: DType, prefill: str, decode: str, policy: KvPolicy, wire: DType, why: str
) -> None:
    choice = negotiate(source, gpu(prefill), gpu(decode), policy)
    assert choice.dtype is wire
    assert why in choice.reason
    assert choice.converted == (wire is not source)


@pytest.mark.parametrize("policy", list(KvPolicy))
def test_kv_that_is_not_numbers_is_never_converted(policy: KvPolicy) -> None:
    choice = negotiate(None, gpu("H100"), gpu("T4"), policy)
    assert choice.dtype is None
    assert not choice.converted
    assert choice.label.startswith("native (KV not convertible")


def test_auto_never_picks_fp8() -> None:
    for source in (F32, BF16, F16):
        for p in DEFAULT_GPUS.values():
            for d in DEFAULT_GPUS.values():
                assert negotiate(source, p, d, AUTO).dtype is not FP8


def test_ratio_and_label() -> None:
    choice = negotiate(F32, gpu("H100"), gpu("T4"), AUTO)
    assert choice.ratio() == 0.5
    assert choice.label == "float16 (H100→T4: float32 narrowed to fp16)"
    assert negotiate(F32, gpu("H100"), gpu("T4"), P8).ratio() == 0.25


def worker(kind: str, kv_dtype: str = "float32") -> WorkerInfo:
    return WorkerInfo(
        worker_id=f"w-{kind}",
        role="prefill",
        address="a:1",
        kv_address="a:2",
        transport="tcp",
        model="m",
        fingerprint="f",
        max_context=100,
        vocab_size=10,
        kv_bytes_per_token=4,
        kv_capacity_bytes=1000,
        gpu_kind=kind,
        kv_dtype=kv_dtype,
    )


def test_negotiate_for_workers_looks_kinds_up_case_insensitively() -> None:
    got = negotiate_for(worker("h100"), worker("t4"), AUTO, PRICED_KINDS)
    assert got.dtype is F16
    assert got.source is F32
    # the CPU host is priced but is not a GPU; an unknown kind is not one either
    assert negotiate_for(worker("cpu"), worker("T4"), AUTO, PRICED_KINDS).dtype is F32
    assert negotiate_for(worker("H100"), worker("X9"), AUTO, PRICED_KINDS).dtype is F32
    assert CPU_HOST.name in PRICED_KINDS


def test_negotiate_for_a_worker_without_a_kv_dtype_sends_as_computed() -> None:
    assert negotiate_for(worker("H100", ""), worker("T4"), P8, PRICED_KINDS).dtype is None
    assert negotiate_for(worker("H100", "int4"), worker("T4"), P8, PRICED_KINDS).dtype is None
