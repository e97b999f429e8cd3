"""The seam between a worker's gRPC servicers and the model runtime behind them.

Runtimes differ in who owns concurrency. The reference engine (`engine.Engine`) is
synchronous: the worker runs it on one thread, interleaves decode steps itself
(`batcher.DecodeBatcher`) and moves KV with pdorch's sender and receiver. vLLM's
``AsyncLLM`` is asynchronous and schedules its own continuous batches; its KV moves through
pdorch's connector inside vLLM's processes. An `EngineHost` hides that difference: the
servicers (`server`) validate a call, hand it to the host and count what comes back; each
RPC body is one host method taking the request message and the call's context (a host
aborts the call with a gRPC status when it fails). Heartbeats read the host's load and KV
room, so the orchestrator sees one kind of worker whatever runs inside.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Sequence
from typing import Any, NoReturn, Protocol

import grpc

from orchestrator.api import worker_pb2
from orchestrator.workers.engine import ModelInfo


class Context(Protocol):
    """What a host uses of its call: to fail it. A gRPC call's context, or one stream of a
    `DecodeMany` call (`workers.mux.StreamContext`)."""

    async def abort(
        self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()
    ) -> NoReturn: ...

    def set_trailing_metadata(self, trailing_metadata: Any) -> None: ...


class EngineHost(abc.ABC):
    info: ModelInfo
    transport: str
    """The KV transport backend the worker moves KV with: a decode worker's receiver's, a
    prefill worker's sender's ("" when none); placement pairs only workers that match."""

    @abc.abstractmethod
    async def start(self, host: str, kv_port: int) -> str:
        """Start the runtime and (decode role) the KV receiver; returns its address or ""."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release the runtime; called once the gRPC server has drained."""

    @abc.abstractmethod
    def active(self) -> int:
        """Requests decoding now."""

    @abc.abstractmethod
    def kv_used(self) -> int:
        """KV bytes held: decoding sequences and received KV not yet claimed."""

    @abc.abstractmethod
    def kv_capacity(self) -> int:
        """KV bytes this worker can hold in all (``kv_capacity - kv_used`` is its room)."""

    def kv_blocks(self) -> tuple[int, int]:
        """(blocks in the engine's KV block pool, free ones); (0, 0) when it has no pool."""
        return 0, 0

    def kv_prefix(self) -> tuple[int, str]:
        """(block size, `orchestrator.core.prefix.encode_keys` of the blocks its prefix cache
        holds) for KV-aware routing; (0, "") for an engine without a prefix cache (the
        reference engine: it recomputes every prompt)."""
        return 0, ""

    @abc.abstractmethod
    async def tokenize(self, text: str) -> list[int]: ...

    @abc.abstractmethod
    async def chat_tokens(self, messages: Sequence[tuple[str, str]]) -> list[int]: ...

    @abc.abstractmethod
    def generate(
        self, request: worker_pb2.AggregatedRequest, context: Context
    ) -> AsyncIterator[worker_pb2.TokenChunk]:
        """The whole request on this worker (validated tokens): the WorkerService stream."""

    @abc.abstractmethod
    async def prefill(
        self, request: worker_pb2.PrefillRequest, context: Context
    ) -> worker_pb2.PrefillResponse:
        """Prefill, sample the first token and push the KV to ``request.kv_target``."""

    @abc.abstractmethod
    def decode(
        self, request: worker_pb2.DecodeRequest, context: Context
    ) -> AsyncIterator[worker_pb2.TokenChunk]:
        """Adopt the KV a prefill worker pushed and stream the rest of the output."""

    @abc.abstractmethod
    async def release(self, request: worker_pb2.ReleaseRequest) -> bool:
        """Drop the request's held KV (idempotent); True if something was freed."""
