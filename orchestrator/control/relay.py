"""The relay: a worker's token chunks to the client's, journalled first; and the request's end.

Each chunk from a worker is checked (its index must be the next one the client is owed —
across failovers the client sees contiguous indices), cut at a stop string, journalled
(`JournalWriter`) and only then handed on. A stream that ends without a finish reason, or
skips an index, fails the attempt with a retryable `WorkerError` of phase ``stream``.

`Relay.finish` records how the request ended — once, after the journal is settled — with
its timings and cost, and returns the final record.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import AsyncGenerator, Mapping, Sequence
from typing import Any

from orchestrator import errors
from orchestrator.api import convert, worker_pb2
from orchestrator.control.journal import JournalWriter
from orchestrator.control.metrics import ControlMetrics
from orchestrator.control.run import OutChunk, Run
from orchestrator.control.settings import ControlSettings
from orchestrator.core.records import JournalEntry, RequestRecord
from orchestrator.core.state import Edge
from orchestrator.store.base import Store

log = logging.getLogger(__name__)


def as_json(d: Mapping[str, Any]) -> str:
    return json.dumps(d, sort_keys=True)


def stop_cut(before: str, delta: str, stops: Sequence[str]) -> int | None:
    """Offset in ``delta`` where the earliest stop string begins (it may start in ``before``)."""
    text = before + delta
    best: int | None = None
    for s in stops:
        pos = text.find(s, max(0, len(before) - len(s) + 1))
        if pos != -1 and (best is None or pos < best):
            best = pos
    return None if best is None else max(0, best - len(before))


class Relay:
    def __init__(
        self,
        store: Store,
        settings: ControlSettings,
        writer: JournalWriter,
        metrics: ControlMetrics | None,
    ) -> None:
        self.store = store
        self.settings = settings
        self.writer = writer
        self.metrics = metrics

    async def relay(
        self, run: Run, stream: AsyncGenerator[worker_pb2.TokenChunk, None]
    ) -> AsyncGenerator[OutChunk, None]:
        spec, rid = run.spec, run.rid
        finish = ""
        async with contextlib.aclosing(stream):
            async for chunk in stream:
                run.check()
                ids = list(chunk.token_ids)
                delta = chunk.text
                reason = convert.finish_from_pb(chunk.finish_reason)
                if chunk.compute_ms:
                    run.usage.computed(chunk.compute_ms / 1000)
                if spec.stop and delta:
                    cut = stop_cut(run.text, delta, spec.stop)
                    if cut is not None:
                        delta, reason = delta[:cut], "stop"
                scores = convert.logprobs_from_pb(chunk.logprobs) if chunk.logprobs else ()
                prompt = (
                    convert.logprobs_from_pb(chunk.prompt_logprobs) if chunk.prompt_logprobs else ()
                )
                if ids or delta or prompt:
                    produced = len(run.output)
                    if chunk.index != produced:
                        raise errors.WorkerError(
                            "decode",
                            f"token index {chunk.index}, expected {produced}",
                            retryable=True,
                            phase="stream",
                        )
                    if spec.sampling.logprobs is not None and len(scores) != len(ids):
                        raise errors.WorkerError(
                            "decode",
                            f"{len(scores)} log-probabilities for {len(ids)} tokens",
                            retryable=False,
                            phase="stream",
                        )
                    entry = JournalEntry(chunk.index, tuple(ids), delta, scores, prompt)
                    try:
                        # The first token is the client's TTFT: never held for the gather.
                        first = run.first_token_at is None and bool(ids)
                        await self.writer.journal(run, entry, first=first)
                    except errors.RequestEndedError:  # cancelled through another replica
                        yield OutChunk(rid, produced, [], "", "cancelled", run.timings)
                        return
                    if run.first_token_at is None and ids:
                        run.first_token_at = time.monotonic()
                        run.timings["ttft_ms"] = (run.first_token_at - run.started) * 1000
                    run.output.extend(ids)
                    run.text += delta
                    yield OutChunk(
                        rid,
                        chunk.index,
                        ids,
                        delta,
                        logprobs=scores,
                        prompt_logprobs=prompt,
                        prompt_tokens=len(spec.prompt),
                    )
                if reason:
                    finish = reason
                    break
        if not finish:
            raise errors.WorkerError(
                "decode", "stream ended without a finish", retryable=True, phase="stream"
            )
        yield await self.complete(run, finish)

    async def complete(self, run: Run, finish: str) -> OutChunk:
        """Record the request done; its final chunk."""
        now = time.monotonic()
        run.timings["total_ms"] = (now - run.started) * 1000
        produced = len(run.output)
        if run.first_token_at is not None and produced > 1:
            run.timings["tpot_ms"] = (now - run.first_token_at) * 1000 / (produced - 1)
        record = await self.finish(run, Edge.FINISH, finish, "")
        return OutChunk(run.rid, produced, [], "", finish, run.timings, record)

    async def _adopted(self, run: Run) -> None:
        """A decode stream that finished before any of its chunks was journalled (none
        carried a token) still adopted the KV: its own transition (decoding -> done needs
        it). Refused as invalid, it was taken already (or the request was cancelled: the
        end's transition says so)."""
        run.journal.adopt = None
        with contextlib.suppress(errors.InvalidTransitionError):
            await self.store.transition(run.rid, Edge.KV_ADOPTED, epoch=run.epoch)

    async def finish(self, run: Run, edge: Edge, reason: str, error: str) -> RequestRecord | None:
        """Settle the journal, then end the request along ``edge`` (a terminal one) with its
        timings and cost: one store call (`Store.end`: the transition, the indexes, the
        tenant's cost, the final record)."""
        state = edge.target
        s = self.settings
        cost = run.cost(s.prices, s.transfer_usd_per_gb)
        try:
            await self.writer.settle(run)
            if run.journal.adopt is not None and edge is Edge.FINISH:
                await self._adopted(run)
            record = await self.store.end(
                run.rid,
                edge,
                epoch=run.epoch,
                tenant=run.spec.tenant,
                cost=cost,
                fields={
                    "finish_reason": reason,
                    "timings": as_json(run.timings),
                    "error": error,
                    "cost": as_json(cost),
                },
            )
        except errors.PdorchError as exc:
            # A client's Cancel records the end itself, often first: the client's business,
            # not a warning.
            cancelled = edge is Edge.CANCEL and isinstance(exc, errors.InvalidTransitionError)
            level = logging.INFO if cancelled else logging.WARNING
            log.log(level, "request %s: could not record %s: %s", run.rid, state, exc)
            return None
        if self.metrics is not None:
            self.metrics.finished(str(state), reason, run.timings, cost)
        return record
