"""The only place that converts between protobuf messages and core types."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from orchestrator.api import common_pb2, worker_pb2
from orchestrator.core.logprobs import TokenLogprob, TopLogprob
from orchestrator.core.sampling import SamplingParams
from transport.wire import DType

_FINISH = {
    "": common_pb2.FINISH_REASON_UNSPECIFIED,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "stop": common_pb2.FINISH_REASON_STOP,
    "eos": common_pb2.FINISH_REASON_EOS,
    "cancelled": common_pb2.FINISH_REASON_CANCELLED,
    "error": common_pb2.FINISH_REASON_ERROR,
}
_FINISH_BACK = {v: k for k, v in _FINISH.items()}


def kv_dtype_to_pb(dtype: DType | None) -> worker_pb2.KvDtype.ValueType:
    """A wire dtype for a Prefill call (None: as computed). The enum's numbers are DType's."""
    return worker_pb2.KvDtype.ValueType(0 if dtype is None else int(dtype))


def kv_dtype_from_pb(value: worker_pb2.KvDtype.ValueType) -> DType | None:
    """None for UNSPECIFIED; ValueError for a number this version does not know."""
    return None if value == worker_pb2.KV_DTYPE_UNSPECIFIED else DType(int(value))


def sampling_from_pb(msg: common_pb2.SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=float(msg.temperature),
        top_p=float(msg.top_p) if msg.HasField("top_p") else 1.0,
        seed=int(msg.seed),
        top_k=int(msg.top_k),
        min_p=float(msg.min_p),
        repetition_penalty=(
            float(msg.repetition_penalty) if msg.HasField("repetition_penalty") else 1.0
        ),
        min_tokens=int(msg.min_tokens),
        ignore_eos=bool(msg.ignore_eos),
        logprobs=int(msg.logprobs) if msg.HasField("logprobs") else None,
        prompt_logprobs=int(msg.prompt_logprobs) if msg.HasField("prompt_logprobs") else None,
    )


def sampling_to_pb(p: SamplingParams) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(
        temperature=p.temperature,
        top_p=p.top_p,
        seed=p.seed,
        top_k=p.top_k,
        min_p=p.min_p,
        repetition_penalty=p.repetition_penalty,
        min_tokens=p.min_tokens,
        ignore_eos=p.ignore_eos,
        logprobs=p.logprobs,
        prompt_logprobs=p.prompt_logprobs,
    )


def logprob_to_pb(lp: TokenLogprob) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(
        token_id=lp.token_id,
        text=lp.text,
        logprob=lp.logprob,
        top=[
            common_pb2.TopLogprob(token_id=t.token_id, text=t.text, logprob=t.logprob)
            for t in lp.top
        ],
    )


def logprob_from_pb(msg: common_pb2.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(
        token_id=int(msg.token_id),
        logprob=float(msg.logprob) if msg.HasField("logprob") else None,
        top=tuple(TopLogprob(int(t.token_id), float(t.logprob), t.text) for t in msg.top),
        text=msg.text,
    )


def logprobs_from_pb(
    msgs: Iterable[common_pb2.TokenLogprob],
) -> tuple[TokenLogprob, ...]:
    return tuple(logprob_from_pb(m) for m in msgs)


def finish_to_pb(reason: str) -> common_pb2.FinishReason.ValueType:
    return _FINISH.get(reason, common_pb2.FINISH_REASON_ERROR)


def finish_from_pb(value: common_pb2.FinishReason.ValueType) -> str:
    return _FINISH_BACK.get(value, "error")


def timings_to_pb(t: dict[str, float]) -> common_pb2.Timings:
    return common_pb2.Timings(
        queue_ms=t.get("queue_ms", 0.0),
        prefill_ms=t.get("prefill_ms", 0.0),
        transfer_ms=t.get("transfer_ms", 0.0),
        ttft_ms=t.get("ttft_ms", 0.0),
        tpot_ms=t.get("tpot_ms", 0.0),
        total_ms=t.get("total_ms", 0.0),
    )


def cost_to_pb(cost: Mapping[str, Any]) -> common_pb2.Cost:
    """A record's cost fields (`orchestrator.core.cost.cost_fields`) as the `Cost` message."""
    return common_pb2.Cost(
        usd=float(cost.get("usd", 0.0)),
        prefill_gpu_s=float(cost.get("prefill_gpu_s", 0.0)),
        decode_gpu_s=float(cost.get("decode_gpu_s", 0.0)),
        aggregated_gpu_s=float(cost.get("aggregated_gpu_s", 0.0)),
        transfer_bytes=int(cost.get("transfer_bytes", 0)),
        transfer_usd=float(cost.get("transfer_usd", 0.0)),
        prefill_gpu=str(cost.get("prefill_gpu", "")),
        decode_gpu=str(cost.get("decode_gpu", "")),
        tenant=str(cost.get("tenant", "")),
    )
