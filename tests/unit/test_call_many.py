"""The worker's side of ``CallMany`` without gRPC (`workers.calls`): calls of one message run
apart, their replies batched; a failure, a cancel or a bad command touches one call."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import grpc

from orchestrator.api import worker_pb2
from orchestrator.workers.calls import CallMany, Unary
from orchestrator.workers.host import Context

LIMIT_S = 10.0


def run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(asyncio.wait_for(coro, LIMIT_S))


class Bodies:
    """Tokenize: the text's word lengths. Prefill: ``len(token_ids)`` after ``epoch`` loop
    turns; epoch 0 is refused FAILED_PRECONDITION, epoch 99 raises, epoch 1000 never ends."""

    def __init__(self) -> None:
        self.cancelled: list[str] = []

    async def tokenize(
        self, request: worker_pb2.TokenizeRequest, _context: Context
    ) -> worker_pb2.TokenizeResponse:
        return worker_pb2.TokenizeResponse(ids=[len(w) for w in request.text.split()])

    async def prefill(
        self, request: worker_pb2.PrefillRequest, context: Context
    ) -> worker_pb2.PrefillResponse:
        if request.epoch == 0:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "stale epoch")
        if request.epoch == 99:
            raise RuntimeError("engine broke")
        try:
            if request.epoch == 1000:
                await asyncio.Event().wait()
            for _ in range(request.epoch):
                await asyncio.sleep(0)
        except asyncio.CancelledError:
            self.cancelled.append(request.request_id)
            raise
        return worker_pb2.PrefillResponse(first_token=len(request.token_ids))


def prefill(cid: int, epoch: int, n: int = 3) -> worker_pb2.CallCommand:
    request = worker_pb2.PrefillRequest(request_id=f"r{cid}", epoch=epoch, token_ids=[1] * n)
    return worker_pb2.CallCommand(call=cid, prefill=request)


async def messages(
    first: list[worker_pb2.CallCommand],
    later: list[worker_pb2.CallCommand],
    when: asyncio.Event,
) -> AsyncIterator[worker_pb2.CallCommands]:
    """``first``, then ``later`` once ``when`` is set (not after a sleep: a loaded machine
    may not have run the first message's calls by then)."""
    yield worker_pb2.CallCommands(commands=first)
    await when.wait()
    yield worker_pb2.CallCommands(commands=later)
    await asyncio.Event().wait()  # the orchestrator keeps its side open


def test_calls_run_apart_and_each_gets_one_reply() -> None:
    async def main() -> None:
        bodies = Bodies()
        many = CallMany(Unary(bodies.tokenize, bodies.prefill))
        text = worker_pb2.TokenizeRequest(text="a bcd")
        first = [
            prefill(1, 1, 4), prefill(2, 0), prefill(3, 99), prefill(4, 1000),
            worker_pb2.CallCommand(call=5, tokenize=text), worker_pb2.CallCommand(call=6),
            prefill(7, 3, 2),
        ]  # fmt: skip
        later = [
            worker_pb2.CallCommand(call=4, cancel=worker_pb2.CallCancel()),
            prefill(7, 1000),  # 7 is done by now: a new call of the same name
            prefill(7, 1000),  # ... and now it is running
        ]
        seen_7 = asyncio.Event()  # the first call 7 answered: it is done
        batches = many.serve(messages(first, later, seen_7))
        replies: dict[int, list[worker_pb2.CallReply]] = {}
        count = 0
        while count < 7:
            for reply in (await anext(batches)).replies:
                replies.setdefault(reply.call, []).append(reply)
                count += 1
            if 7 in replies:
                seen_7.set()
        assert replies[1] == [worker_pb2.CallReply(call=1, prefill={"first_token": 4})]
        assert replies[5] == [worker_pb2.CallReply(call=5, tokenize={"ids": [1, 3]})]
        failed = {c: (r[0].failure.code, r[0].failure.details) for c, r in replies.items()
                  if r[0].HasField("failure")}  # fmt: skip
        assert failed[2] == (grpc.StatusCode.FAILED_PRECONDITION.value[0], "stale epoch")
        assert failed[3][0] == grpc.StatusCode.UNKNOWN.value[0]
        assert "engine broke" in failed[3][1]
        assert failed[6] == (grpc.StatusCode.INVALID_ARGUMENT.value[0], "an empty command")
        assert replies[7][0].prefill.first_token == 2
        assert replies[7][1].failure.code == grpc.StatusCode.ALREADY_EXISTS.value[0]
        assert replies[7][1].failure.details.startswith("call 7 is already running: this start")
        assert 4 not in replies  # cancelled: no reply
        assert bodies.cancelled == ["r4"]
        await batches.aclose()
        assert sorted(bodies.cancelled) == ["r4", "r7"]  # the call's end stops the rest

    run(main())
