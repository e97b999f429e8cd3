"""The reference runtime behind the worker API: a synchronous `Engine` on one thread.

Engine calls run on the worker's engine thread (`batcher.EngineRunner`); decode steps of
every active sequence are interleaved by the `DecodeBatcher`. KV moves through pdorch's
transport: a prefill pushes the prompt's KV with the `KvSender`, a decode worker's
`KvReceiver` holds it until the Decode call claims it. Used for the transformers engine
and the simulated one (which brings its own runner).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import replace
from typing import Any

import grpc
import numpy as np

from orchestrator.api import common_pb2, convert, worker_pb2
from orchestrator.api.protocol import BLAME_KEY, BLAME_KV_TARGET, blames_kv_target, transport_status
from orchestrator.core.logprobs import TokenLogprob
from orchestrator.core.sampling import SamplingParams
from orchestrator.workers.batcher import DecodeBatcher, EngineRunner
from orchestrator.workers.batcher import Sequence as DecodeSequence
from orchestrator.workers.engine import DecodeState, Engine, PrefillResult
from orchestrator.workers.host import Context, EngineHost
from orchestrator.workers.metrics import WorkerMetrics
from orchestrator.workers.text import TextDeltas
from transport import errors as terr
from transport import kvcodec, wire
from transport.receiver import KvReceiver
from transport.sender import KvSender

log = logging.getLogger(__name__)


class ReferenceHost(EngineHost):
    def __init__(
        self,
        engine: Engine,
        *,
        kv_capacity_bytes: int,
        max_batch: int,
        sender: KvSender | None = None,
        receiver: KvReceiver | None = None,
        metrics: WorkerMetrics | None = None,
        runner: EngineRunner | None = None,
    ) -> None:
        self.engine = engine
        self.info = engine.info
        self.transport = (
            receiver.backend if receiver is not None else sender.backend if sender else ""
        )
        self.metrics = metrics
        self._capacity = kv_capacity_bytes
        self._sender = sender
        self._receiver = receiver
        self._runner = runner if runner is not None else EngineRunner(engine)
        """Where engine calls run: the engine thread; a simulated engine's own runner."""
        self._batcher = DecodeBatcher(self._runner, max_batch)
        if receiver is not None:  # suffix-only transfers: the engine's prefix cache decides
            receiver.prefix_check = engine.holds_prefix
        self._decoding: dict[int, DecodeState] = {}
        """The sequences being decoded now (by ``id``): what `kv_used` sums, so the gauge
        is the KV they hold at this moment, grown token by token, and 0 once they end."""

    async def start(self, host: str, kv_port: int) -> str:
        address = ""
        if self._receiver is not None:
            address = await self._receiver.start(host, kv_port)
        if self._sender is not None:
            await self._sender.start()
        self._batcher.start()
        return address

    async def close(self) -> None:
        await self._batcher.close()
        if self._sender is not None:
            await self._sender.close()
        if self._receiver is not None:
            await self._receiver.close()
        self._runner.shutdown()

    def active(self) -> int:
        return self._batcher.active

    def kv_used(self) -> int:
        held = self._receiver.inbox.bytes_in_use if self._receiver else 0
        return held + sum(self.engine.kv_bytes(s) for s in list(self._decoding.values()))

    def kv_capacity(self) -> int:
        return self._capacity

    def kv_prefix(self) -> tuple[int, str]:
        return self.engine.prefix_report()

    async def tokenize(self, text: str) -> list[int]:
        return await self._runner.call(self.engine.tokenize, text)

    async def chat_tokens(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        return await self._runner.call(self.engine.chat_tokens, messages)

    # ------------------------------------------------------------------------- decoding

    async def stream(
        self,
        request_id: str,
        state: DecodeState,
        max_tokens: int,
        prompt_tokens: int,
        context: Context,
        compute_s: float = 0.0,
        first: PrefillResult | None = None,
    ) -> AsyncIterator[worker_pb2.TokenChunk]:
        """Emit the token already sampled (index generated-1), then decode to the end.

        Each chunk carries the engine time spent on the request since the previous one
        (``compute_s``: what this worker spent before decoding, e.g. the prefill), and the
        log-probabilities asked for: ``first``, the prefill this worker ran, has the first
        token's and the prompt's. The state's KV counts in `kv_used` from the first chunk
        until the stream ends."""
        self._decoding[id(state)] = state
        try:
            steps = self._steps(
                request_id, state, max_tokens, prompt_tokens, context, compute_s, first
            )
            async with contextlib.aclosing(steps):
                async for chunk in steps:
                    yield chunk
        finally:
            del self._decoding[id(state)]

    async def _steps(
        self,
        request_id: str,
        state: DecodeState,
        max_tokens: int,
        prompt_tokens: int,
        context: Context,
        compute_s: float,
        first: PrefillResult | None,
    ) -> AsyncGenerator[worker_pb2.TokenChunk, None]:
        eos = set() if state.sampling.ignore_eos else set(self.engine.info.eos_token_ids)
        output = list(state.token_ids[prompt_tokens:])
        last = output[-1]
        text = TextDeltas(self.engine.detokenize, output[:-1])
        index = state.generated - 1
        first_ms = compute_s * 1000
        prompt = [self._named(lp) for lp in first.prompt_logprobs] if first else []
        if last in eos:
            yield worker_pb2.TokenChunk(
                index=index,
                finish_reason=common_pb2.FINISH_REASON_EOS,
                compute_ms=first_ms,
                prompt_logprobs=prompt,
            )
            return
        scored = first.first_logprob if first else None
        delta, ends = text.push_ends([last])
        yield worker_pb2.TokenChunk(
            index=index,
            token_ids=[last],
            text=delta,
            text_ends=ends,
            compute_ms=first_ms,
            logprobs=[self._named(scored)] if scored is not None else [],
            prompt_logprobs=prompt,
        )
        if state.generated >= max_tokens:
            yield worker_pb2.TokenChunk(
                index=state.generated,
                text=text.flush(),
                finish_reason=common_pb2.FINISH_REASON_LENGTH,
            )
            return
        seq = DecodeSequence(request_id, state)
        self._batcher.add(seq)
        reported = 0.0

        def spent() -> float:
            nonlocal reported
            delta, reported = seq.compute_s - reported, seq.compute_s
            return delta * 1000

        try:
            while True:
                got = await seq.tokens.get()
                batch = [got]
                while not seq.tokens.empty():  # coalesce what is already there
                    batch.append(seq.tokens.get_nowait())
                ids: list[int] = []
                finish = common_pb2.FINISH_REASON_UNSPECIFIED
                for item in batch:
                    if isinstance(item, BaseException):
                        await context.abort(grpc.StatusCode.INTERNAL, f"decode failed: {item}")
                    assert isinstance(item, int)
                    if item in eos:
                        finish = common_pb2.FINISH_REASON_EOS
                        break
                    ids.append(item)
                    if index + 1 + len(ids) >= max_tokens:
                        finish = common_pb2.FINISH_REASON_LENGTH
                        break
                if ids:
                    delta, ends = text.push_ends(ids)
                    scores = [state.logprobs.pop(index + 1 + i, None) for i in range(len(ids))]
                    yield worker_pb2.TokenChunk(
                        index=index + 1,
                        token_ids=ids,
                        text=delta,
                        text_ends=ends,
                        compute_ms=spent(),
                        logprobs=[self._named(lp) for lp in scores if lp is not None],
                    )
                    index += len(ids)
                if finish != common_pb2.FINISH_REASON_UNSPECIFIED:
                    yield worker_pb2.TokenChunk(
                        index=index + 1,
                        text=text.flush(),
                        finish_reason=finish,
                        compute_ms=spent(),
                    )
                    return
        finally:
            self._batcher.remove(seq)

    def _named(self, lp: TokenLogprob) -> common_pb2.TokenLogprob:
        """A log-probability with its tokens' texts, for the wire."""
        return convert.logprob_to_pb(lp.named(lambda t: self.engine.detokenize([t])))

    async def start_state(
        self,
        kv: wire.KvCache | list[tuple[Any, Any]],
        token_ids: list[int],
        last: int,
        generated: int,
        sampling: SamplingParams,
    ) -> DecodeState:
        layers = kv.layers if isinstance(kv, wire.KvCache) else kv
        state = await self._runner.call(
            self.engine.start_decode, list(layers), token_ids, last, generated, sampling
        )
        if isinstance(kv, wire.KvCache):
            kv.release()
        return state

    # ----------------------------------------------------------------------------- RPCs

    async def generate(
        self, request: worker_pb2.AggregatedRequest, context: Context
    ) -> AsyncIterator[worker_pb2.TokenChunk]:
        ids = list(request.token_ids)
        sampling = convert.sampling_from_pb(request.sampling)
        first_index = int(request.first_index)
        started = time.perf_counter()
        result = await self._runner.call(self.engine.prefill, ids, sampling, first_index, None)
        state = await self.start_state(
            result.kv, ids, result.first_token, first_index + 1, sampling
        )
        async for chunk in self.stream(
            request.request_id,
            state,
            int(request.max_tokens),
            int(request.prompt_tokens),
            context,
            time.perf_counter() - started,  # the prefill, on this worker
            result,
        ):
            yield chunk

    async def prefill(
        self, request: worker_pb2.PrefillRequest, context: Context
    ) -> worker_pb2.PrefillResponse:
        if not request.kv_target or self._sender is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "no KV target or sender")
        assert self._sender is not None
        ids = list(request.token_ids)
        rid = request.request_id
        sampling = convert.sampling_from_pb(request.sampling)
        started = time.perf_counter()
        result = await self._runner.call(
            self.engine.prefill, ids, sampling, int(request.first_index), None
        )
        prefill_ms = (time.perf_counter() - started) * 1000
        info = self.engine.info
        try:
            wire_dtype = convert.kv_dtype_from_pb(request.kv_dtype) or info.kv_dtype
        except ValueError:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "unknown kv_dtype")
        if wire_dtype is not info.kv_dtype and not info.kv_convertible:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, "this engine's KV cannot be converted"
            )
        sent = time.perf_counter()
        prefix = int(request.decode_prefix_tokens)
        if not 0 <= prefix < len(ids):
            log.warning(
                "%s: a decode prefix of %d of %d tokens; sending all", rid, prefix, len(ids)
            )
            prefix = 0
        refused = False
        try:
            try:
                header = await self._push(request, result.kv, wire_dtype, prefix)
            except terr.PrefixMissingError as exc:  # the decode worker lacks it: send it all
                log.info("suffix-only KV of %s refused (%s); sending the whole KV", rid, exc)
                refused = True
                header = await self._push(request, result.kv, wire_dtype, 0)
        except kvcodec.KvCodecError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"KV conversion: {exc}")
        except terr.TransportError as exc:
            log.warning(
                "KV transfer of %s to %s failed: %s", request.request_id, request.kv_target, exc
            )
            if blames_kv_target(exc):  # the receiving end is the one to avoid
                context.set_trailing_metadata(((BLAME_KEY, BLAME_KV_TARGET),))
            await context.abort(transport_status(exc), f"KV transfer failed: {exc}")
        transfer_s = time.perf_counter() - sent
        if self.metrics is not None:
            self.metrics.prefill_seconds.observe(prefill_ms / 1000)
            self.metrics.compute_seconds.inc(prefill_ms / 1000)
            self.metrics.transfer_seconds.inc(transfer_s)
            self.metrics.kv_sent_bytes.inc(header.payload_bytes)
        scored = result.first_logprob
        return worker_pb2.PrefillResponse(
            first_token=result.first_token,
            kv_bytes=header.payload_bytes,
            prefill_ms=prefill_ms,
            transfer_ms=transfer_s * 1000,
            kv_dtype=convert.kv_dtype_to_pb(wire_dtype),
            first_logprob=self._named(scored) if scored is not None else None,
            prompt_logprobs=[self._named(lp) for lp in result.prompt_logprobs],
            cached_tokens=result.cached_tokens,
            kv_prefix_tokens=header.prefix_tokens,
            kv_prefix_refused=refused,
        )

    async def _push(
        self,
        request: worker_pb2.PrefillRequest,
        kv: list[tuple[Any, Any]],
        wire_dtype: wire.DType,
        prefix: int,
    ) -> wire.KvHeader:
        """Send the KV of the tokens after the first ``prefix`` (0: all of it; else the
        header names the prefix, ``request.decode_prefix_hash``) to the request's target."""
        assert self._sender is not None
        if prefix:  # the suffix's KV: tokens are the second axis of (heads, tokens, dim)
            kv = [(np.ascontiguousarray(k[:, prefix:]), np.ascontiguousarray(v[:, prefix:]))
                  for k, v in kv]  # fmt: skip
        info = self.engine.info
        layers = await _to_wire(kv, info.kv_dtype, wire_dtype)
        header = kvcodec.wire_header(
            request.request_id, int(request.epoch), info.fingerprint, layers, wire_dtype
        )
        if prefix:
            header = replace(
                header, prefix_tokens=prefix, prefix_hash=bytes(request.decode_prefix_hash)
            )
        cache = wire.KvCache(
            header,
            tuple((layer.k, layer.v) for layer in layers),
            scales=tuple(layer.scales for layer in layers if layer.scales is not None),
        )
        # The whole KV exists: one-sided, one message and one reply (else layer by layer).
        await self._sender.send(request.kv_target, cache)
        return header

    async def decode(
        self, request: worker_pb2.DecodeRequest, context: Context
    ) -> AsyncIterator[worker_pb2.TokenChunk]:
        if self._receiver is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "not a decode worker")
        assert self._receiver is not None
        rid, epoch = request.request_id, int(request.epoch)
        try:
            kv = await self._receiver.take(rid, epoch, request.kv_timeout_s or 30.0)
        except terr.TransportError as exc:
            await context.abort(transport_status(exc), f"no usable KV for {rid}: {exc}")
        ids = list(request.token_ids)
        if kv.header.total_tokens != len(ids):
            kv.release()
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"KV covers {kv.header.total_tokens} tokens, request has {len(ids)}",
            )
        prefix, prefix_hash = kv.header.prefix_tokens, kv.header.prefix_hash
        started = time.perf_counter()
        adopt: wire.KvCache | list[tuple[Any, Any]] = kv
        compute = self.engine.info.kv_dtype
        if kv.header.dtype is not compute or kv.header.scales is not wire.ScaleLayout.NONE:
            try:  # back to the dtype this engine computes in (`transport.kvcodec`)
                adopt = await asyncio.to_thread(kvcodec.decode_layers, kv, compute)
            except terr.WireFormatError as exc:
                await context.abort(grpc.StatusCode.DATA_LOSS, f"KV of {rid}: {exc}")
            finally:
                kv.release()
        if prefix:  # a suffix: the prefix's KV comes from this worker's own cache
            try:
                adopt = await self._runner.call(self._extend, adopt, ids[:prefix], prefix_hash)
            except ValueError as exc:  # evicted since the transfer was accepted: re-prefill
                await context.abort(grpc.StatusCode.ABORTED, f"KV of {rid}: {exc}")
        state = await self.start_state(
            adopt,
            ids,
            int(request.last_token),
            int(request.generated),
            convert.sampling_from_pb(request.sampling),
        )
        adopted_s = time.perf_counter() - started
        async for chunk in self.stream(
            rid, state, int(request.max_tokens), int(request.prompt_tokens), context, adopted_s
        ):
            yield chunk

    def _extend(
        self, kv: wire.KvCache | list[tuple[Any, Any]], prefix: list[int], digest: bytes
    ) -> list[tuple[Any, Any]]:
        """The cached KV of ``prefix`` followed by ``kv``, a suffix's (released here)."""
        try:
            head = self.engine.prefix_kv(prefix, digest)
            tail = kv.layers if isinstance(kv, wire.KvCache) else kv
            return [
                (np.concatenate((hk, k), axis=1), np.concatenate((hv, v), axis=1))
                for (hk, hv), (k, v) in zip(head, tail, strict=True)
            ]
        finally:
            if isinstance(kv, wire.KvCache):
                kv.release()

    async def release(self, request: worker_pb2.ReleaseRequest) -> bool:
        if self._receiver is None:
            return False
        # Only that attempt's KV (or an older one's); its epoch is closed for good.
        return self._receiver.discard(request.request_id, int(request.epoch))


async def _to_wire(
    kv: list[tuple[Any, Any]], source: wire.DType, target: wire.DType
) -> list[kvcodec.EncodedLayer]:
    """The prefill's KV in the negotiated wire dtype (converted in a thread: it is numpy work
    proportional to the KV's size); as is, without a copy, when no conversion is asked."""
    if target is source:
        return [kvcodec.EncodedLayer(k, v) for k, v in kv]
    return await asyncio.to_thread(
        lambda: [kvcodec.encode_layer(k, v, source, target) for k, v in kv]
    )
