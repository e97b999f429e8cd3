"""What the vLLM engine host honours without starting an engine: ignore_eos leaves no stop
token. (Log probabilities are no longer refused: `test_vllm_pd`.)"""

from __future__ import annotations

import importlib
import warnings
from types import ModuleType

import pytest

from orchestrator.api import common_pb2
from orchestrator.workers.engine import ModelInfo
from transport.wire import DType

pytestmark = pytest.mark.vllm


def _host() -> ModuleType:
    """The engine host module (importing vLLM warns of torch.jit deprecations: not ours)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return importlib.import_module("orchestrator.workers.vllm.engine")


def test_ignore_eos_leaves_no_stop_token() -> None:
    vllm_engine = _host()
    info = ModelInfo("m", "f", 1, 1, 1, 10, 100, (7, 9), DType.FLOAT32)
    assert vllm_engine._eos(info, common_pb2.SamplingParams()) == (7, 9)
    assert vllm_engine._eos(info, common_pb2.SamplingParams(ignore_eos=True)) == ()
