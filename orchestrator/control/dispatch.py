"""One attempt on its placement: the worker legs in order, each step recorded in the store.

Disaggregated: ``prefill`` (queued → prefilling), the prefill leg — which moves the KV to the
decode worker — then ``kv_sent`` (→ transferring), written while the decode stream opens
and awaited before its first chunk (a round trip off the first token), and ``kv_adopted``
(→ decoding) at that first chunk, taken by the chunk's journal write in the same store call
(`JournalBuffer.adopt`: a round trip less per request). KV the decode worker may hold but
never adopted is released on any way out. Aggregated: ``aggregate`` (queued → decoding) and
one worker's stream.

The placement's own edge (``prefill`` or ``aggregate``, `orchestrator.control.ledger.placed`)
is not taken here when the record was created with it already (a request's first attempt,
booked before its creation: `recorded`); every later attempt takes it as a transition.

Every transition names its `Edge` and carries the attempt's epoch, so an attempt that was
fenced off (a failover, a takeover) cannot move the request. What happens when a leg fails
is `orchestrator.control.failover`'s business; this module only runs the legs.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from dataclasses import replace
from typing import Any

from orchestrator.api import convert, worker_pb2
from orchestrator.control.ledger import Booking, Ledger, placed
from orchestrator.control.legs import WorkerLegs
from orchestrator.control.metrics import ControlMetrics
from orchestrator.control.relay import as_json
from orchestrator.control.run import Run
from orchestrator.control.settings import ControlSettings
from orchestrator.core.kvdtype import negotiate_for
from orchestrator.core.prefix import suffix_plan
from orchestrator.core.records import WorkerInfo
from orchestrator.core.routing import suffix_note
from orchestrator.core.sampling import SamplingParams
from orchestrator.core.scheduler import Mode, Placement
from orchestrator.core.state import Edge
from orchestrator.store.base import Store

Chunks = AsyncGenerator[worker_pb2.TokenChunk, None]


class Dispatch:
    def __init__(
        self,
        store: Store,
        legs: WorkerLegs,
        ledger: Ledger,
        settings: ControlSettings,
        metrics: ControlMetrics | None,
    ) -> None:
        self.store = store
        self.legs = legs
        self.ledger = ledger
        self.settings = settings
        self.metrics = metrics

    def stream(self, run: Run, booking: Booking, *, recorded: bool = False) -> Chunks:
        """The worker token stream of this attempt, in the booked placement's mode;
        ``recorded``: the record was created placed (its placement edge is taken)."""
        placement = booking.placement
        run.journal.adopt = None  # an earlier attempt's, never taken: not this attempt's
        if placement.mode is Mode.DISAGGREGATED:
            return self._disaggregated(run, booking, recorded)
        if self.metrics is not None and not placement.by_choice:
            down = "prefill" if placement.decode.role == "decode" else "decode"
            self.metrics.fallbacks.labels(down).inc()
        return self._aggregated(run, placement, recorded)

    async def _placed(self, run: Run, placement: Placement) -> None:
        """Take the placement's edge out of queued (``prefill`` or ``aggregate``)."""
        edge, fields = placed(placement)
        await self.store.transition(run.rid, edge, epoch=run.epoch, fields=fields)

    async def _disaggregated(self, run: Run, booking: Booking, recorded: bool) -> Chunks:
        placement = booking.placement
        assert placement.prefill is not None
        prefill, decode = placement.prefill, placement.decode
        if not recorded:
            await self._placed(run, placement)
        adopted = False
        inner = self._prefill_then_decode(run, booking, prefill, decode)
        try:
            async with contextlib.aclosing(inner):
                async for chunk in inner:
                    adopted = True
                    yield chunk
        finally:
            if not adopted:  # the KV may have reached the decode worker: don't leave it held
                await self.legs.release(decode, run.rid, run.epoch)

    async def _prefill_then_decode(
        self, run: Run, booking: Booking, prefill: WorkerInfo, decode: WorkerInfo
    ) -> Chunks:
        tokens = list(run.spec.prompt) + run.output  # after a failover: what the client has
        sampling = convert.sampling_to_pb(_sampling(run))
        kv = negotiate_for(prefill, decode, self.settings.kv_dtype, self.settings.prices)
        request = worker_pb2.PrefillRequest(
            request_id=run.rid,
            epoch=run.epoch,
            token_ids=tokens,
            sampling=sampling,
            first_index=len(run.output),
            kv_target=decode.kv_address,
            kv_dtype=convert.kv_dtype_to_pb(kv.dtype),
        )
        held, block_size = booking.decode_prefix
        plan = suffix_plan(tokens, held, block_size) if self.settings.routing.suffix_only else None
        if plan is not None:
            request.decode_prefix_tokens = plan.tokens
            request.decode_prefix_hash = plan.digest
        try:
            resp = await self.legs.prefill(prefill, decode, request, run.check)
        finally:
            self.ledger.prefilled(booking)
        self.ledger.answered(booking, prefill.worker_id)
        rates = self.ledger.rates
        cached = min(int(resp.cached_tokens), len(tokens))  # prefill_ms is the others' time
        rates.prefill(
            prefill.worker_id, prefill.gpu_kind, len(tokens) - cached, resp.prefill_ms / 1000
        )
        # What the cached tokens would have taken: the worker's mean rate, or this prefill's
        # own before the mean has enough samples.
        rate = rates.prefill_rate(prefill.worker_id, prefill.gpu_kind)
        if rate is None and resp.prefill_ms > 0 and len(tokens) > cached:
            rate = (len(tokens) - cached) / (resp.prefill_ms / 1000)
        run.usage.reuse(cached, rate)
        rates.transfer(int(resp.kv_bytes), resp.transfer_ms / 1000)
        run.timings["prefill_ms"] = resp.prefill_ms
        run.timings["transfer_ms"] = resp.transfer_ms
        run.usage.spent("prefill", prefill.gpu_kind, resp.prefill_ms / 1000)
        run.usage.kv_moved += int(resp.kv_bytes)
        if self.metrics is not None:
            self.metrics.transfer_bytes.inc(int(resp.kv_bytes))
            self.metrics.transfer_seconds.inc(resp.transfer_ms / 1000)
        run.usage.streaming("decode", decode.gpu_kind)
        fields: dict[str, object] = {
            "kv_bytes": resp.kv_bytes,
            "kv_dtype": kv.label,
            "timings": as_json(run.timings),
        }
        if plan is not None:  # the record says what moved, and why
            note = suffix_note(
                plan.tokens, int(resp.kv_prefix_tokens), resp.kv_prefix_refused, len(tokens)
            )
            fields["placement"] = f"{booking.placement.reason}; {note}"
        # Recorded while the decode stream opens, not before (a round trip off the first
        # token): awaited before the first chunk, whose journal write takes kv_adopted.
        recording = asyncio.ensure_future(
            self.store.transition(run.rid, Edge.KV_SENT, epoch=run.epoch, fields=fields)
        )
        stream = self.legs.decode(
            decode,
            worker_pb2.DecodeRequest(
                request_id=run.rid,
                epoch=run.epoch,
                token_ids=tokens,
                last_token=resp.first_token,
                generated=len(run.output) + 1,
                sampling=sampling,
                max_tokens=run.spec.max_tokens,
                kv_timeout_s=self.settings.kv_timeout_s,
                prompt_tokens=len(run.spec.prompt),
                flush_ms=_window_ms(run, self.settings),
            ),
            run.check,
            run.tap,
        )
        first = True
        try:
            async with contextlib.aclosing(stream):
                async for chunk in stream:
                    if first:  # the decode worker adopted the KV: recorded by the chunk's
                        first = False  # journal write, in the same store call (no round trip)
                        await recording  # kv_sent's error (a fenced epoch, an outage) wins
                        run.journal.adopt = Edge.KV_ADOPTED
                        _scored_by_prefill(chunk, resp)
                    yield chunk
            await recording  # a stream that ended without a chunk
        finally:
            await _settled(recording)

    async def _aggregated(self, run: Run, placement: Placement, recorded: bool) -> Chunks:
        worker = placement.decode
        run.usage.pool = "aggregated"
        run.usage.gpu_kind.setdefault("aggregated", worker.gpu_kind)
        if not recorded:
            await self._placed(run, placement)
        stream = self.legs.generate(
            worker,
            worker_pb2.AggregatedRequest(
                request_id=run.rid,
                epoch=run.epoch,
                token_ids=list(run.spec.prompt) + run.output,
                sampling=convert.sampling_to_pb(_sampling(run)),
                max_tokens=run.spec.max_tokens,
                first_index=len(run.output),
                prompt_tokens=len(run.spec.prompt),
                flush_ms=_window_ms(run, self.settings),
            ),
            run.check,
        )
        async with contextlib.aclosing(stream):
            async for chunk in stream:
                yield chunk


async def _settled(recording: asyncio.Future[Any]) -> None:
    """``recording`` over before the attempt ends, so a failover's store calls never race
    this attempt's: cancelled if still in flight (as an awaited call is when its attempt is
    cancelled or fails); its error is dropped when the attempt already ends on its own."""
    if not recording.done():
        recording.cancel()
    await asyncio.wait({recording})  # this task's own cancellation still propagates
    if not recording.cancelled():
        recording.exception()  # retrieved: never logged as unhandled


def _window_ms(run: Run, settings: ControlSettings) -> float:
    """The chunk window asked of the attempt's worker stream: the client's
    (`RequestSpec.chunk_window_ms`), else this replica's ``stream_flush_ms``."""
    return float(run.spec.chunk_window_ms) or settings.stream_flush_ms


def _sampling(run: Run) -> SamplingParams:
    """The attempt's parameters: a continuation (tokens already sent) asks no prompt
    log-probabilities — the first chunk carried them, and the journal has them."""
    p = run.spec.sampling
    return replace(p, prompt_logprobs=None) if run.output else p


def _scored_by_prefill(chunk: worker_pb2.TokenChunk, resp: worker_pb2.PrefillResponse) -> None:
    """The decode stream's first chunk starts with the token the prefill sampled: its
    log-probability and the prompt's come from the prefill's response."""
    if resp.HasField("first_logprob") and chunk.token_ids and not chunk.logprobs:
        chunk.logprobs.append(resp.first_logprob)
    if resp.prompt_logprobs and not chunk.prompt_logprobs:
        chunk.prompt_logprobs.extend(resp.prompt_logprobs)
