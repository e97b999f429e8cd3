"""A worker's gRPC server given what protobuf cannot decode: INVALID_ARGUMENT with one INFO
line, as the orchestrator's own server answers (it answered UNKNOWN, with a traceback
logged per call). A real worker process's server, in process, over loopback."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest

from orchestrator.api import common_pb2, worker_pb2
from orchestrator.core.records import WorkerInfo
from orchestrator.workers.server import Worker, WorkerSettings
from orchestrator.workers.sim_engine import SimEngine, SimRunner, SimSpec


async def _code_of(call: object) -> tuple[grpc.StatusCode, str]:
    try:
        if hasattr(call, "__aiter__"):
            async for _ in call:  # type: ignore[attr-defined]
                pass
        else:
            await call  # type: ignore[misc]
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details() or ""
    raise AssertionError("the call succeeded")


async def _scenario() -> None:
    engine = SimEngine(SimSpec.parse("llama-3-8b@L4"))

    async def publish(_info: WorkerInfo) -> None:
        return None

    worker = Worker(engine, WorkerSettings(role="decode"), publish, runner=SimRunner(engine))
    address = await worker.start()
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            tokenize = channel.unary_unary("/pdorch.v1.WorkerService/Tokenize")
            bad = (
                worker_pb2.TokenizeRequest(text="ab")
                .SerializeToString()
                .replace(b"ab", b"\xff\xfe")
            )
            code, details = await _code_of(tokenize(bad, timeout=5))
            assert code == grpc.StatusCode.INVALID_ARGUMENT
            assert "UTF-8" in details
            generate = channel.unary_stream("/pdorch.v1.WorkerService/Generate")
            req = worker_pb2.AggregatedRequest(
                request_id="rid",
                epoch=1,
                token_ids=[1, 2, 3],
                sampling=common_pb2.SamplingParams(),
                max_tokens=2,
                prompt_tokens=3,
            )
            raw = req.SerializeToString().replace(b"rid", b"r\xc3(")
            code, _ = await _code_of(generate(raw, timeout=5))
            assert code == grpc.StatusCode.INVALID_ARGUMENT
            # Many decode streams on one call: an undecodable command refuses the call.
            many = channel.stream_stream("/pdorch.v1.DecodeService/DecodeMany")
            start = worker_pb2.DecodeCommand(
                stream=1, start=worker_pb2.DecodeRequest(request_id="rid", epoch=1)
            )
            raw = start.SerializeToString().replace(b"rid", b"r\xc3(")
            code, details = await _code_of(many(iter([raw]), timeout=5))
            assert code == grpc.StatusCode.INVALID_ARGUMENT
            assert "undecodable" in details
            # Many unary calls on one call: an undecodable command refuses the call.
            calls = channel.stream_stream("/pdorch.v1.WorkerService/CallMany")
            prefill = worker_pb2.CallCommands(
                commands=[
                    worker_pb2.CallCommand(
                        call=1, prefill=worker_pb2.PrefillRequest(request_id="rid", epoch=1)
                    )
                ]
            )
            raw = prefill.SerializeToString().replace(b"rid", b"r\xc3(")
            code, details = await _code_of(calls(iter([raw]), timeout=5))
            assert code == grpc.StatusCode.INVALID_ARGUMENT
            assert "undecodable" in details
            # Still serving well-formed calls.
            ok = tokenize(
                worker_pb2.TokenizeRequest(text="two words").SerializeToString(), timeout=5
            )
            assert worker_pb2.TokenizeResponse.FromString(await ok).ids
    finally:
        await worker.stop()


def test_worker_answers_invalid_argument_to_undecodable_requests(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO):
        asyncio.run(_scenario())
    refused = [r for r in caplog.records if "undecodable" in r.getMessage()]
    assert len(refused) == 4  # Tokenize, Generate, DecodeMany, CallMany: one line each
    assert all(r.levelno == logging.INFO and r.exc_info is None for r in refused)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def _out_of_range() -> None:
    engine = SimEngine(SimSpec.parse("llama-3-8b@L4"))

    async def publish(_info: WorkerInfo) -> None:
        return None

    worker = Worker(engine, WorkerSettings(role="prefill"), publish, runner=SimRunner(engine))
    address = await worker.start()
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            generate = channel.unary_stream("/pdorch.v1.WorkerService/Generate")
            req = worker_pb2.AggregatedRequest(
                request_id="rid", epoch=1, token_ids=[1, 2, 3], max_tokens=2,
                prompt_tokens=3, first_index=2**32 - 1,
            )  # fmt: skip
            code, details = await _code_of(generate(req.SerializeToString(), timeout=5))
            assert code == grpc.StatusCode.INVALID_ARGUMENT, details
            assert "first_index: 4294967295 is beyond the context" in details
            prefill = channel.unary_unary("/pdorch.v1.PrefillService/Prefill")
            for target in ("not an address", "127.0.0.1:0", "127.0.0.1:99999", ":1"):
                req2 = worker_pb2.PrefillRequest(
                    request_id="rid", epoch=1, token_ids=[1, 2], kv_target=target
                )
                code, details = await _code_of(prefill(req2.SerializeToString(), timeout=5))
                assert code == grpc.StatusCode.INVALID_ARGUMENT, (target, details)
                assert "is not host:port" in details
    finally:
        await worker.stop()


def test_worker_refuses_out_of_range_indices_and_malformed_kv_targets(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """INVALID_ARGUMENT naming the field — not UNKNOWN with a traceback logged."""
    with caplog.at_level(logging.INFO):
        asyncio.run(_out_of_range())
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
