"""A fake worker fleet for in-process tests of the control plane (no processes, no sockets).

`FakeFleet` stands in for `WorkerClients`: each worker answers the worker API's calls the way
a real one does (`orchestrator.workers.server`) — prefill returns output token
``first_index``, the decode stream re-emits the token already sampled at ``generated - 1``
then continues to ``max_tokens``, aggregated generation does both — with a deterministic
token per index, so a test can check every index and token a client sees. Faults are set per
worker: a status code after N decoded chunks, a hang (the stream goes silent), a prefill
failure blamed on the KV's receiver, a slow stream. gRPC failures are real
`grpc.aio.AioRpcError`s, so the control plane translates them as it does in production.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Coroutine
from dataclasses import dataclass, field
from typing import Any, cast

import grpc

from orchestrator.api import common_pb2, worker_pb2
from orchestrator.api.protocol import BLAME_KEY, BLAME_KV_TARGET
from orchestrator.control.clients import WorkerClients
from orchestrator.core.prefix import encode_keys
from orchestrator.core.records import WorkerInfo

VOCAB = 1000
KV_BYTES_PER_TOKEN = 16
PREFIX_BLOCK = 16


def token(index: int) -> int:
    """The token every fake worker produces at output ``index``."""
    return 100 + index % 500


def text(index: int) -> str:
    return f"<{index}>"


def logprob(index: int) -> common_pb2.TokenLogprob:
    """The log probability every fake worker reports for output ``index``."""
    return common_pb2.TokenLogprob(
        token_id=token(index), text=text(index), logprob=-0.5 - index / 100
    )


def rpc_error(code: grpc.StatusCode, details: str, blame: bool = False) -> grpc.aio.AioRpcError:
    trailing = grpc.aio.Metadata((BLAME_KEY, BLAME_KV_TARGET)) if blame else grpc.aio.Metadata()
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, details, "")


@dataclass
class FakeWorker:
    worker_id: str
    role: str
    fail_after: int | None = None
    """Decode/generate: fail with ``fail_code`` after this many chunks."""
    fail_code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE
    hang_after: int | None = None
    """Decode/generate: go silent after this many chunks (until cancelled)."""
    prefill_error: grpc.StatusCode | None = None
    blame_kv_target: bool = False
    """A failed prefill says the KV's receiver failed (the decode worker)."""
    delay_s: float = 0.0
    """Pause before each decoded chunk (a slow stream, so a test can act mid-request)."""
    calls: list[tuple[str, int]] = field(default_factory=list)
    """(call, epoch) of every call received."""
    released: list[tuple[str, int]] = field(default_factory=list)
    cancelled: int = 0
    """Streams the orchestrator cancelled."""
    samplings: list[common_pb2.SamplingParams] = field(default_factory=list)
    """The sampling parameters of every prefill and aggregated call, in order."""
    prefix_keys: tuple[int, ...] = ()
    """Block keys (of `PREFIX_BLOCK` tokens) its heartbeat says its prefix cache holds."""
    decode_lacks_prefix: bool = False
    """Prefill: a suffix-only transfer asked for is refused by the receiver (whole KV sent)."""
    prefill_requests: list[worker_pb2.PrefillRequest] = field(default_factory=list)
    empty_first: bool = False
    """Decode: the stream opens with a chunk that carries no token (a keep-alive)."""
    windows: list[float] = field(default_factory=list)
    """The coalescing window (``flush_ms``) each decode and aggregated call asked for."""
    eos_at: int | None = None
    """Decode/generate: the model ends the output at this index (EOS: a chunk of its own,
    with no token)."""

    @property
    def info(self) -> WorkerInfo:
        return WorkerInfo(
            worker_id=self.worker_id,
            role=self.role,
            address=f"{self.worker_id}:1",
            kv_address=f"{self.worker_id}:2" if self.role == "decode" else "",
            transport="tcp",
            model="fake",
            fingerprint="fake-model",
            max_context=4096,
            vocab_size=VOCAB,
            kv_bytes_per_token=KV_BYTES_PER_TOKEN,
            kv_capacity_bytes=KV_BYTES_PER_TOKEN * 1_000_000,
            kv_block_size=PREFIX_BLOCK if self.prefix_keys else 0,
            kv_prefix=encode_keys(self.prefix_keys),
        )

    def decoded(self, rid: str, epoch: int) -> int:
        return sum(1 for call, e in self.calls if call == f"decode:{rid}" and e == epoch)

    async def stream(
        self, first: int, max_tokens: int, scored: bool = False, skip_first: bool = False
    ) -> AsyncIterator[worker_pb2.TokenChunk]:
        """The token chunks from output index ``first`` (already sampled) to the end, with
        log probabilities when ``scored`` (but the first's when ``skip_first``: a decode
        stream's first token is the prefill's)."""
        if self.empty_first:
            yield worker_pb2.TokenChunk(index=first)
        last = max_tokens if self.eos_at is None else min(max_tokens, self.eos_at)
        for n, index in enumerate(range(first, last)):
            if self.fail_after is not None and n >= self.fail_after:
                raise rpc_error(self.fail_code, f"{self.worker_id} broke")
            if self.hang_after is not None and n >= self.hang_after:
                await asyncio.Event().wait()  # silent until the orchestrator gives up
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            scores = [logprob(index)] if scored and not (skip_first and n == 0) else []
            yield worker_pb2.TokenChunk(
                index=index,
                token_ids=[token(index)],
                text=text(index),
                compute_ms=1.0,
                logprobs=scores,
            )
        finish = (
            common_pb2.FINISH_REASON_LENGTH if last == max_tokens else common_pb2.FINISH_REASON_EOS
        )
        yield worker_pb2.TokenChunk(index=last, finish_reason=finish)


class _Stream:
    """A server stream as grpc.aio returns it: async-iterable, cancellable."""

    def __init__(self, worker: FakeWorker, chunks: AsyncIterator[worker_pb2.TokenChunk]) -> None:
        self._worker = worker
        self._chunks = chunks
        self._cancelled = False

    def __aiter__(self) -> AsyncIterator[worker_pb2.TokenChunk]:
        return self._chunks

    def cancel(self) -> bool:
        if not self._cancelled:
            self._cancelled = True
            self._worker.cancelled += 1
        return True

    def close(self) -> None:
        """A `control.mux.MuxStream` closed early: as a cancelled call."""
        self.cancel()


def _call(coro: Coroutine[Any, Any, Any]) -> Awaitable[Any]:
    """A unary call as grpc.aio returns it: awaitable, cancellable (a task is both)."""
    return asyncio.ensure_future(coro)


class _UnaryOnly:
    supported = False

    async def close(self) -> None:
        return None


class _Stubs:
    def __init__(self, worker: FakeWorker) -> None:
        self.prefill = self
        self.decode = self
        self.general = self
        self.mux = self
        """`control.mux.DecodeMux`: each stream as the worker's Decode call streams it."""
        self.calls = _UnaryOnly()
        """`control.calls.CallMux`: this fake worker takes unary calls only (the shared
        call is tested against a real worker server: tests/integration/test_call_mux.py)."""
        self.w = worker

    supported = True

    def open(self, req: worker_pb2.DecodeRequest) -> _Stream:
        return self.Decode(req)

    async def stalled(self, silence_s: float) -> None:
        """Each fake stream is a call of its own: nothing shared to close."""

    def Prefill(self, req: worker_pb2.PrefillRequest, timeout: float) -> Awaitable[Any]:
        async def run() -> worker_pb2.PrefillResponse:
            w = self.w
            w.calls.append((f"prefill:{req.request_id}", req.epoch))
            w.samplings.append(req.sampling)
            w.prefill_requests.append(req)
            if w.prefill_error is not None:
                raise rpc_error(w.prefill_error, "prefill failed", blame=w.blame_kv_target)
            resp = worker_pb2.PrefillResponse(
                first_token=token(req.first_index),
                kv_bytes=len(req.token_ids) * KV_BYTES_PER_TOKEN,
                prefill_ms=2.0,
                transfer_ms=1.0,
            )
            if req.decode_prefix_tokens and w.decode_lacks_prefix:
                resp.kv_prefix_refused = True
            elif req.decode_prefix_tokens:  # the KV after the prefix only
                resp.kv_prefix_tokens = req.decode_prefix_tokens
                resp.kv_bytes -= req.decode_prefix_tokens * KV_BYTES_PER_TOKEN
            if req.sampling.HasField("logprobs"):
                resp.first_logprob.CopyFrom(logprob(req.first_index))
            if req.sampling.HasField("prompt_logprobs"):
                resp.prompt_logprobs.extend(
                    common_pb2.TokenLogprob(token_id=t, text=str(t)) for t in req.token_ids
                )
            return resp

        return _call(run())

    def Decode(self, req: worker_pb2.DecodeRequest) -> _Stream:
        self.w.calls.append((f"decode:{req.request_id}", req.epoch))
        self.w.windows.append(req.flush_ms)
        assert req.last_token == token(req.generated - 1)
        scored = req.sampling.HasField("logprobs")
        return _Stream(
            self.w, self.w.stream(req.generated - 1, req.max_tokens, scored, skip_first=True)
        )

    def Generate(self, req: worker_pb2.AggregatedRequest) -> _Stream:
        self.w.calls.append((f"generate:{req.request_id}", req.epoch))
        self.w.windows.append(req.flush_ms)
        self.w.samplings.append(req.sampling)
        scored = req.sampling.HasField("logprobs")
        return _Stream(self.w, self.w.stream(req.first_index, req.max_tokens, scored))

    def Release(self, req: worker_pb2.ReleaseRequest, timeout: float) -> Awaitable[Any]:
        async def run() -> worker_pb2.ReleaseResponse:
            self.w.released.append((req.request_id, req.epoch))
            return worker_pb2.ReleaseResponse(released=True)

        return _call(run())

    def Tokenize(self, req: worker_pb2.TokenizeRequest, timeout: float) -> Awaitable[Any]:
        async def run() -> worker_pb2.TokenizeResponse:
            return worker_pb2.TokenizeResponse(ids=[ord(c) % VOCAB for c in req.text])

        return _call(run())


class FakeFleet:
    """Fake workers by id, reached by address as `WorkerClients` reaches real ones."""

    def __init__(self, *workers: FakeWorker) -> None:
        self.workers = {w.worker_id: w for w in workers}

    def get(self, address: str) -> _Stubs:
        return _Stubs(self.workers[address.split(":", maxsplit=1)[0]])

    async def close(self) -> None:
        return None

    def as_clients(self) -> WorkerClients:
        return cast(WorkerClients, self)
