"""The chaos clients: what a careful user's client does, with every step recorded.

Each request has a client-chosen id (its idempotency key). When a stream breaks with a code
that says "try again" the client reconnects — to the next orchestrator replica — with the
same id and body and ``resume_from_index`` = the first index it still needs; a definite
error ends the request. Every invoke, chunk and outcome goes into the `History`.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from orchestrator.api import common_pb2, orchestrator_pb2, orchestrator_pb2_grpc
from orchestrator.api.tls import Tls
from orchestrator.chaos.history import History, Op, RequestSpec
from orchestrator.chaos.scenario import Workload
from orchestrator.rpc.client import channel as client_channel
from orchestrator.rpc.many_client import ManyClient, StreamFailed, status_of

# Codes after which resuming may succeed: the replica, a link or the store had a problem.
RETRYABLE = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
    }
)

_TEXT = (
    "lighthouse keeper storm harbour lantern tide gull rope anchor fog bell stone path island "
    "morning letter ship captain map compass river bridge orchard winter garden quiet kitchen "
    "window clock train station market bread candle forest road cloud"
)
_WORDS = tuple(_TEXT.split())


@dataclass(frozen=True, slots=True)
class RequestPlan:
    key: int
    prompt: str
    max_tokens: int
    temperature: float
    seed: int


def make_requests(workload: Workload, seed: int) -> list[RequestPlan]:
    """The workload's requests, drawn from ``seed`` (the same seed gives the same prompts)."""
    rng = random.Random(seed)  # noqa: S311 - reproducible workloads, not secrets
    # Every prompt's opening, the same for every seed (a system prompt): no draws from rng.
    shared = [_WORDS[(7 * i) % len(_WORDS)] for i in range(workload.shared_prefix_words)]
    plans = []
    for key in range(workload.requests):
        words = rng.randint(*workload.prompt_words)
        prompt = " ".join([*shared, *(rng.choice(_WORDS) for _ in range(words))])
        sampled = rng.random() < workload.sampled_share
        plans.append(
            RequestPlan(
                key=key,
                prompt=prompt,
                max_tokens=rng.randint(*workload.output_tokens),
                temperature=0.8 if sampled else 0.0,
                seed=rng.randrange(1 << 31) if sampled else 0,
            )
        )
    return plans


def _message(plan: RequestPlan, rid: str, resume: int) -> orchestrator_pb2.GenerateRequest:
    return orchestrator_pb2.GenerateRequest(
        request_id=rid,
        text=plan.prompt,
        max_tokens=plan.max_tokens,
        sampling=common_pb2.SamplingParams(temperature=plan.temperature, seed=plan.seed),
        resume_from_index=resume,
    )


class _Stream:
    """One attempt's stream, read chunk by chunk: a ``Generate`` call or a request on a
    ``GenerateMany`` call (its chunks, then something that is not one: the end)."""

    def __init__(
        self,
        call: grpc.aio.UnaryStreamCall[Any, orchestrator_pb2.GenerateChunk] | None,
        chunks: AsyncGenerator[orchestrator_pb2.GenerateChunk, None] | None,
    ) -> None:
        self._call = call
        self._chunks = chunks

    async def read(self) -> object:
        if self._call is not None:
            return await self._call.read()
        assert self._chunks is not None
        try:
            return await anext(self._chunks)
        except StopAsyncIteration:
            return None  # as a call's read gives grpc.aio.EOF

    async def cancel(self) -> None:
        if self._call is not None:
            self._call.cancel()
        elif self._chunks is not None:
            await self._chunks.aclose()


class Clients:
    """Drives a workload against orchestrator replicas, recording into a history."""

    def __init__(
        self,
        addresses: Sequence[str],
        history: History,
        t0: float,
        *,
        concurrency: int,
        timeout_s: float,
        prefix: str,
        idle_timeout_s: float = 10.0,
        tls: Tls | None = None,
        many: bool = False,
    ) -> None:
        """``tls``: the client identity's credentials (the cluster runs TLS); ``many``: every
        request on one ``GenerateMany`` call per replica (`rpc.many_client`)."""
        self.addresses = list(addresses)
        self.history = history
        self.t0 = t0
        self.timeout_s = timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.prefix = prefix
        self._slots = asyncio.Semaphore(concurrency)
        self._rng = random.Random(history.seed)  # noqa: S311 - jitter, not secrets
        self._channels = {a: client_channel(a, tls=tls) for a in self.addresses}
        self._many = (
            {
                a: ManyClient(orchestrator_pb2_grpc.OrchestratorStub(c))
                for a, c in self._channels.items()
            }
            if many
            else None
        )

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def close(self) -> None:
        for client in (self._many or {}).values():
            await client.close()
        for channel in self._channels.values():
            await channel.close(None)

    async def run(self, plans: Sequence[RequestPlan]) -> dict[int, tuple[int, ...]]:
        """Run every request; returns key → tokens of the ones that completed."""
        results = await asyncio.gather(*(self._one(p) for p in plans))
        return {p.key: r for p, r in zip(plans, results, strict=True) if r is not None}

    async def _one(self, plan: RequestPlan) -> tuple[int, ...] | None:
        rid = f"{self.prefix}-{plan.key}"
        self.history.requests[rid] = RequestSpec(rid, plan.key, plan.max_tokens)
        async with self._slots:
            return await self._stream(plan, rid)

    def _call(
        self, address: str, request: orchestrator_pb2.GenerateRequest, timeout_s: float
    ) -> _Stream:
        if self._many is not None:
            return _Stream(None, self._many[address].generate(request, timeout_s))
        stub = orchestrator_pb2_grpc.OrchestratorStub(self._channels[address])
        return _Stream(stub.Generate(request, timeout=timeout_s), None)

    async def _stream(self, plan: RequestPlan, rid: str) -> tuple[int, ...] | None:
        deadline = time.monotonic() + self.timeout_s
        tokens: list[int] = []
        replica = plan.key % len(self.addresses)
        backoff = 0.05
        attempt = 0
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None  # indeterminate: no definite answer in time
            attempt += 1
            address = self.addresses[replica]
            add = self.history.add
            add(Op(self.now(), "invoke", rid, attempt, address, index=len(tokens)))
            call = self._call(address, _message(plan, rid, len(tokens)), remaining)
            try:
                while True:
                    try:  # a careful client: a replica silent this long is given up on
                        chunk = await asyncio.wait_for(call.read(), self.idle_timeout_s)
                    except TimeoutError:
                        await call.cancel()
                        add(Op(self.now(), "info", rid, attempt, address, code="IDLE",
                               detail=f"no chunk for {self.idle_timeout_s}s"))  # fmt: skip
                        break
                    if not isinstance(chunk, orchestrator_pb2.GenerateChunk):  # grpc.aio.EOF
                        add(Op(self.now(), "info", rid, attempt, address, code="EOF",
                               detail="stream ended without a finish reason"))  # fmt: skip
                        break
                    if chunk.token_ids:
                        ids = tuple(chunk.token_ids)
                        add(Op(self.now(), "chunk", rid, attempt, address, chunk.index, ids))
                        if chunk.index == len(tokens):
                            tokens.extend(ids)
                        elif chunk.index < len(tokens) < chunk.index + len(ids):
                            tokens.extend(ids[len(tokens) - chunk.index :])
                    if chunk.finish_reason:
                        reason = common_pb2.FinishReason.Name(chunk.finish_reason)
                        code = reason.removeprefix("FINISH_REASON_").lower()
                        add(Op(self.now(), "ok", rid, attempt, address, code=code))
                        return tuple(tokens)
            except (grpc.aio.AioRpcError, StreamFailed) as exc:
                status, details = status_of(exc)
                kind = "info" if status in RETRYABLE else "fail"
                add(Op(self.now(), kind, rid, attempt, address, code=status.name,
                       detail=details[:200]))  # fmt: skip
                if kind == "fail":
                    return None
            finally:
                await call.cancel()  # a stream left early: its GenerateMany request stopped
            replica = (replica + 1) % len(self.addresses)
            await asyncio.sleep(backoff * (0.5 + self._rng.random()))  # jittered backoff
            backoff = min(backoff * 2, 1.0)
