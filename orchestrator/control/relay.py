"""The relay: a worker's token chunks to the client's, journalled first; and the request's end.

Each chunk from a worker is checked (its index must be the next one the client is owed —
across failovers the client sees contiguous indices), cut at a stop string (its text, and
its tokens after the one completing the stop string), and submitted to
the journal (`JournalWriter.submit`), which hands it to the clients once it is written —
the relay reads the next chunk meanwhile. A write refused (a stale epoch, the request ended
elsewhere) is raised at the next chunk, or before the end is recorded: no chunk after it
reaches a client. A stream that ends without a finish reason, or skips an index, fails the
attempt with a retryable `WorkerError` of phase ``stream``.

`Relay.finish` records how the request ended — once, after the journal is settled — with
its timings and cost, and returns the final record.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import AsyncGenerator, Callable, Mapping
from functools import partial
from typing import Any

from orchestrator import errors
from orchestrator.api import convert, worker_pb2
from orchestrator.control.journal import JournalWriter
from orchestrator.control.metrics import ControlMetrics
from orchestrator.control.run import OutChunk, Run
from orchestrator.control.settings import ControlSettings
from orchestrator.core import stops
from orchestrator.core.records import JournalEntry, RequestRecord
from orchestrator.core.state import Edge, State
from orchestrator.store.base import Store

log = logging.getLogger(__name__)


def as_json(d: Mapping[str, Any]) -> str:
    return json.dumps(d, sort_keys=True)


async def ended_elsewhere(store: Store, rid: str) -> State | None:
    """How the request's record says it ended, when this replica's write was refused: the
    state (None when the record is gone or the store away) — but `RequestFailedError` is
    raised for a failed one (a peer's deadline reaper failed it while this replica drove
    it: its clients are told so, not that it was cancelled)."""
    try:
        record = await store.get(rid)
    except errors.UnavailableError:
        return None
    if record is not None and record.state is State.FAILED:
        raise errors.RequestFailedError(f"request failed: {record.error or '?'}")
    return None if record is None else record.state


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
        self,
        run: Run,
        stream: AsyncGenerator[worker_pb2.TokenChunk, None],
        answered: Callable[[], None] | None = None,
    ) -> AsyncGenerator[OutChunk, None]:
        """The stream's end, relayed (its chunks go to the clients from the journal's
        writer); ``answered``: called at the first chunk."""
        finish = ""
        run.journal.hand = partial(self._handed, run)
        refused: errors.PdorchError | None = None
        try:
            async with contextlib.aclosing(stream):
                async for chunk in stream:
                    run.check()
                    if (refused := self.writer.refusal(run)) is not None:
                        break
                    if answered is not None:
                        answered()
                        answered = None
                    finish = self._relayed(run, chunk)
                    if finish:
                        break
                    run.tap.take = partial(self._tap, run)  # the next ones: past the reader
        finally:
            run.tap.take = None
        if isinstance(refused, errors.RequestEndedError):
            yield await self._ended_elsewhere(run)
            return
        if refused is not None:
            raise refused
        if not finish:
            raise errors.WorkerError(
                "decode", "stream ended without a finish", retryable=True, phase="stream"
            )
        try:
            await self.writer.flush(run)  # every chunk handed out before the end
        except errors.RequestEndedError:  # cancelled through another replica
            yield await self._ended_elsewhere(run)
            return
        except errors.UnavailableError:
            pass  # handed out unjournalled; the end's record waits for the store (`finish`)
        yield await self.complete(run, finish)

    def _tap(self, run: Run, chunk: worker_pb2.TokenChunk) -> bool:
        """A chunk relayed as it arrives, in the worker call's step (`Tap`): one that
        neither ends the stream nor can fail it — the next index, no stop string, no
        refusal or stop flag pending; anything else is left to the reader (False)."""
        spec = run.spec
        if (
            chunk.finish_reason
            or chunk.index != len(run.output)
            or run.lease_lost
            or run.cancelled
            or run.journal.refused is not None
            or (spec.stop and chunk.text and stops.found(run.held, chunk.text, spec.stop))
            or (spec.sampling.logprobs is not None and len(chunk.logprobs) != len(chunk.token_ids))
        ):
            return False
        self._relayed(run, chunk)
        return True

    def _relayed(self, run: Run, chunk: worker_pb2.TokenChunk) -> str:
        """Check one chunk, cut it at a stop string and submit it to the journal; the
        finish reason it brings (or the stop string's), "" if none."""
        spec = run.spec
        ids = list(chunk.token_ids)
        delta = chunk.text
        reason = convert.finish_from_pb(chunk.finish_reason)
        if chunk.compute_ms:
            run.usage.computed(chunk.compute_ms / 1000)
        held = run.held
        kept = len(ids)
        if spec.stop and (delta or held):
            # Text that may begin a stop string waits for the next chunk (`core.stops`).
            part = stops.split(held, delta, spec.stop, end=bool(reason))
            delta, run.held = part.out, part.held
            if part.stopped:
                reason = "stop"
                # The tokens after the one completing it are not the client's.
                kept = stops.tokens_kept(chunk.text_ends, kept, part.stop_end)
        scores = convert.logprobs_from_pb(chunk.logprobs) if chunk.logprobs else ()
        prompt = convert.logprobs_from_pb(chunk.prompt_logprobs) if chunk.prompt_logprobs else ()
        produced = len(run.output)
        if not (ids or prompt):
            if delta or run.held != held or (reason and reason != "length"):
                # The end alone, before the request's last token (with the text held until
                # then), or text without a token: journalled all the same
                # (`JournalEntry.finish`, `held`: a write more). A length's end needs none:
                # a replica taking the request over finds every token journalled.
                end = OutChunk(run.rid, produced, [], delta, prompt_tokens=len(spec.prompt))
                alone = JournalEntry(produced, (), delta, finish=reason, held=run.held)
                self.writer.submit(run, alone, end)
            return reason
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
        if kept < len(ids):
            del ids[kept:]
            scores = scores[:kept]
        entry = JournalEntry(chunk.index, tuple(ids), delta, scores, prompt, reason, run.held)
        out = OutChunk(
            run.rid,
            chunk.index,
            ids,
            delta,
            logprobs=scores,
            prompt_logprobs=prompt,
            prompt_tokens=len(spec.prompt),
        )
        # The first token is the client's TTFT: never held for the gather.
        first = bool(ids) and not run.output and run.first_token_at is None
        self.writer.submit(run, entry, out, first=first)
        run.output.extend(ids)
        return reason

    @staticmethod
    def _handed(run: Run, out: OutChunk) -> None:
        """A chunk whose journal write landed: to the run's clients (the first token's
        time is the client's time to first token); an end that came alone is not a chunk
        of theirs (their stream's last chunk says it)."""
        if not (out.token_ids or out.text or out.prompt_logprobs):
            return
        if run.first_token_at is None and out.token_ids:
            run.first_token_at = time.monotonic()
            run.timings["ttft_ms"] = (run.first_token_at - run.started) * 1000
        run.deliver(out)

    async def _ended_elsewhere(self, run: Run) -> OutChunk:
        """The stream's end when the request ended through another replica: cancelled (a
        client's Cancel there: this run's work is priced all the same, `_settled`), or
        failed — a peer's deadline reaper — which is raised as the failure it is
        (`ended_elsewhere`), not told as a cancel."""
        if await ended_elsewhere(self.store, run.rid) is State.CANCELLED:
            s = self.settings
            await self._settled(run, run.cost(s.prices, s.transfer_usd_per_gb))
        return OutChunk(run.rid, run.sent, [], "", "cancelled", run.timings)

    async def _settled(self, run: Run, cost: Mapping[str, Any]) -> None:
        """A request a client's Cancel ended before this run could (the Cancel takes the
        terminal transition itself): the work it got is priced — the record's cost, the
        tenant's totals — and counted in the metrics all the same, once whichever replica
        asks (`Store.settle`). Until a QA pass a cancelled request was neither billed nor
        counted."""
        try:
            priced = await self.store.settle(
                run.rid,
                State.CANCELLED,  # (not one a deadline reaper failed meanwhile)
                tenant=run.spec.tenant,
                cost=cost,
                cost_json=as_json(cost),
                fields={"timings": as_json(run.timings)},
            )
        except errors.PdorchError as exc:
            log.warning("request %s: cancelled; its cost not recorded: %s", run.rid, exc)
            return
        if priced and self.metrics is not None:
            self.metrics.finished(str(State.CANCELLED), "cancelled", run.timings, cost)

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
            if edge is Edge.FINISH and isinstance(exc, errors.StaleEpochError):
                # Taken over before its end was recorded: the new owner records it (the
                # end this run journalled, `JournalEntry.finish`, if that write landed;
                # else it generates on) and this run's clients follow it, not our end.
                run.lease_lost = True
                raise errors.LeaseLostError(f"request {run.rid!r} taken over: {exc}") from exc
            # A client's Cancel records the end itself, often first: the client's business,
            # not a warning.
            cancelled = edge is Edge.CANCEL and isinstance(exc, errors.InvalidTransitionError)
            level = logging.INFO if cancelled else logging.WARNING
            log.log(level, "request %s: could not record %s: %s", run.rid, state, exc)
            if cancelled:
                await self._settled(run, cost)
            return None
        if self.metrics is not None:
            self.metrics.finished(str(state), reason, run.timings, cost)
        return record
