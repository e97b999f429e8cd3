"""What the vLLM engine host refuses by name (issue 17 defect 13: log probabilities are not
wired through vLLM): INVALID_ARGUMENT whose details the orchestrator reads back as the
parameter (`orchestrator.api.protocol.refusal`), so a gateway client gets a 400 naming
``logprobs``; and what it honours (ignore_eos: no stop tokens). No engine is started."""

from __future__ import annotations

import asyncio
import importlib
import warnings
from types import ModuleType
from typing import Any

import grpc
import pytest

from orchestrator.api import common_pb2
from orchestrator.api.protocol import REFUSABLE_FIELDS
from orchestrator.workers.engine import ModelInfo
from transport.wire import DType

pytestmark = pytest.mark.vllm


def _host() -> ModuleType:
    """The engine host module (importing vLLM warns of torch.jit deprecations: not ours)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return importlib.import_module("orchestrator.workers.vllm.engine")


class _Refused(Exception):
    pass


class _Context:
    def __init__(self) -> None:
        self.aborted: tuple[Any, str] | None = None

    async def abort(self, code: Any, details: str) -> None:
        self.aborted = (code, details)
        raise _Refused


@pytest.mark.parametrize("name", ["logprobs", "prompt_logprobs"])
def test_log_probabilities_are_refused_naming_the_parameter(name: str) -> None:
    vllm_engine = _host()
    msg = common_pb2.SamplingParams(temperature=0.5, **{name: 1})
    context = _Context()
    with pytest.raises(_Refused):
        asyncio.run(vllm_engine._refuse_logprobs(msg, context))  # type: ignore[arg-type]
    assert context.aborted is not None
    code, details = context.aborted
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    field, _, why = details.partition(": ")
    assert field == name
    assert field in REFUSABLE_FIELDS
    assert "vLLM" in why
    plain = _Context()
    asyncio.run(vllm_engine._refuse_logprobs(common_pb2.SamplingParams(), plain))  # type: ignore[arg-type]
    assert plain.aborted is None


def test_ignore_eos_leaves_no_stop_token() -> None:
    vllm_engine = _host()
    info = ModelInfo("m", "f", 1, 1, 1, 10, 100, (7, 9), DType.FLOAT32)
    assert vllm_engine._eos(info, common_pb2.SamplingParams()) == (7, 9)
    assert vllm_engine._eos(info, common_pb2.SamplingParams(ignore_eos=True)) == ()
