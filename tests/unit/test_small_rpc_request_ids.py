"""A request sent without a client id is named by the orchestrator before anything can fail
(`rpc.many.named`): the id it runs under is the one its rpc log lines carry — never ``''``
— on ``Generate`` and on ``GenerateMany`` alike. No gRPC server: the servicer is called
with a stand-in context and orchestrator."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Coroutine
from typing import Any, NoReturn

import grpc
import pytest

from orchestrator import errors
from orchestrator.api import orchestrator_pb2 as pb
from orchestrator.api.many import StreamAborted
from orchestrator.control.orchestrator import GenerateInput, OutChunk, Sink
from orchestrator.core.idents import shown
from orchestrator.rpc import service
from orchestrator.rpc.many import GenerateMany

LIMIT_S = 10.0


def run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(asyncio.wait_for(coro, LIMIT_S))


class Refusing:
    """An orchestrator that refuses every request, keeping the ids it was given."""

    def __init__(self) -> None:
        self.ids: list[str] = []

    async def generate(
        self, inp: GenerateInput, sink: Sink | None = None
    ) -> AsyncIterator[OutChunk]:
        self.ids.append(inp.request_id)
        raise errors.InvalidRequestError("max_tokens", "too many")
        yield  # an async generator, as `Orchestrator.generate` is


class Aborted(Exception):
    pass


class Context:
    """What `OrchestratorService.Generate` asks of a grpc.aio servicer context."""

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()

    def time_remaining(self) -> float | None:
        return None

    def set_trailing_metadata(self, trailing: object) -> None:
        pass

    async def abort(self, code: grpc.StatusCode, details: str) -> NoReturn:
        raise Aborted(code, details)


def _logged_ids(caplog: pytest.LogCaptureFixture, refusing: Refusing) -> None:
    assert len(refusing.ids) == 1
    rid = refusing.ids[0]
    assert rid, "the orchestrator names the request"
    failed = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    assert failed, caplog.text
    assert all(f"request {shown(rid)} failed" in m for m in failed), failed
    assert "request ''" not in caplog.text


def test_generate_logs_the_id_it_assigned(caplog: pytest.LogCaptureFixture) -> None:
    refusing = Refusing()
    svc = service.OrchestratorService(refusing)  # type: ignore[arg-type]

    async def main() -> None:
        call = svc.Generate(pb.GenerateRequest(text="x", max_tokens=5), Context())  # type: ignore[arg-type]
        with pytest.raises(Aborted):
            async for _ in call:
                pass

    with caplog.at_level(logging.INFO, logger="orchestrator.rpc"):
        run(main())
    _logged_ids(caplog, refusing)


def test_generate_many_logs_the_id_it_assigned(caplog: pytest.LogCaptureFixture) -> None:
    refusing = Refusing()

    def input_of(req: pb.GenerateRequest, until: float | None) -> GenerateInput:
        return service._input(req, "default", until)

    def failed(exc: errors.PdorchError) -> StreamAborted:
        return StreamAborted(grpc.StatusCode.INVALID_ARGUMENT, str(exc), ())

    async def commands(stop: asyncio.Event) -> AsyncIterator[pb.GenerateCommand]:
        yield pb.GenerateCommand(stream=0, start=pb.GenerateRequest(text="x", max_tokens=5))
        await stop.wait()

    async def main() -> None:
        call = GenerateMany(refusing.generate, input_of, service._fill_chunk, failed)
        stop = asyncio.Event()
        batches = call.serve(commands(stop))
        batch = await anext(batches)
        assert [e.HasField("failure") for e in batch.events] == [True]
        stop.set()
        await batches.aclose()

    with caplog.at_level(logging.INFO, logger="orchestrator.rpc"):
        run(main())
    _logged_ids(caplog, refusing)
