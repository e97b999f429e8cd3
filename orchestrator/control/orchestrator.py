"""Admission, placement, dispatch and relay of one request — the orchestrator's core loop.

`Orchestrator.generate` validates a request, tokenizes it (on a worker), creates its record
in the store (idempotently, keyed by the client's request id), places it, and then drives
it: prefill on a prefill worker with the chosen decode worker as the KV target, then the
decode stream, relayed to the client and journalled (each chunk is appended to the token
journal with an epoch check before the client sees it). A resubmission of a known request
id with the same body follows the existing request from its journal instead of generating
again; with a different body it is refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, field

import grpc

from orchestrator import errors
from orchestrator.api import common_pb2, convert, worker_pb2
from orchestrator.control.clients import WorkerClients, translated
from orchestrator.core.records import JournalEntry, RequestRecord, WorkerInfo, body_hash
from orchestrator.core.sampling import SamplingParams
from orchestrator.core.scheduler import Mode, Placement, place
from orchestrator.core.state import State
from orchestrator.store.redis_store import RedisStore

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ControlSettings:
    max_tokens_limit: int = 2048
    max_stop_strings: int = 8
    max_request_id_len: int = 128
    fallback: str = "local"
    """When a pool is down: "local" runs aggregated on the other pool; "fail" refuses."""
    prefill_timeout_s: float = 120.0
    kv_timeout_s: float = 30.0
    token_timeout_s: float = 60.0
    """Longest silence from a decode stream before the request fails."""
    follow_poll_s: float = 0.05
    """How often a follower (resubmission) polls the journal of a request it does not own."""


@dataclass(frozen=True, slots=True)
class GenerateInput:
    request_id: str
    text: str | None = None
    chat: tuple[tuple[str, str], ...] | None = None
    token_ids: tuple[int, ...] | None = None
    max_tokens: int = 64
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    resume_from: int = 0


@dataclass(slots=True)
class OutChunk:
    request_id: str
    index: int
    token_ids: list[int]
    text: str
    finish_reason: str = ""
    timings: dict[str, float] = field(default_factory=dict)
    record: RequestRecord | None = None


class Orchestrator:
    def __init__(
        self, store: RedisStore, clients: WorkerClients, settings: ControlSettings, owner: str
    ) -> None:
        self.store = store
        self.clients = clients
        self.settings = settings
        self.owner = owner
        self._driving: dict[str, asyncio.Task[object]] = {}

    # --------------------------------------------------------------------- validation

    def _validate(self, inp: GenerateInput) -> None:
        s = self.settings
        if len(inp.request_id) > s.max_request_id_len:
            raise errors.InvalidRequestError("request_id", f"longer than {s.max_request_id_len}")
        given = [p for p in (inp.text, inp.chat, inp.token_ids) if p is not None]
        if len(given) != 1:
            raise errors.InvalidRequestError("prompt", "give exactly one of text, chat, tokens")
        if inp.text is not None and not inp.text.strip():
            raise errors.InvalidRequestError("prompt", "empty")
        if inp.chat is not None and not inp.chat:
            raise errors.InvalidRequestError("prompt", "no chat messages")
        if inp.token_ids is not None and not inp.token_ids:
            raise errors.InvalidRequestError("prompt", "no token ids")
        if inp.max_tokens <= 0 or inp.max_tokens > s.max_tokens_limit:
            raise errors.InvalidRequestError(
                "max_tokens", f"must be in [1, {s.max_tokens_limit}], got {inp.max_tokens}"
            )
        for name, message in inp.sampling.problems():
            raise errors.InvalidRequestError(name, message)
        if len(inp.stop) > s.max_stop_strings or any(not x for x in inp.stop):
            raise errors.InvalidRequestError(
                "stop", f"at most {s.max_stop_strings} non-empty strings"
            )

    async def _tokens(self, inp: GenerateInput, workers: Sequence[WorkerInfo]) -> list[int]:
        model = workers[0]
        if inp.token_ids is not None:
            bad = [t for t in inp.token_ids if not 0 <= t < model.vocab_size]
            if bad:
                raise errors.InvalidRequestError(
                    "prompt", f"token id {bad[0]} outside the vocabulary of {model.vocab_size}"
                )
            ids = list(inp.token_ids)
        else:
            worker = min(workers, key=lambda w: (w.active, w.worker_id))
            req = worker_pb2.TokenizeRequest()
            if inp.text is not None:
                req.text = inp.text
            else:
                for role, content in inp.chat or ():
                    req.chat.messages.add(role=role, content=content)
            async with translated(worker.worker_id, "tokenize"):
                resp = await self.clients.get(worker.address).general.Tokenize(req, timeout=30)
            ids = list(resp.ids)
        if not ids:
            raise errors.InvalidRequestError("prompt", "tokenizes to nothing")
        if len(ids) + inp.max_tokens > model.max_context:
            raise errors.InvalidRequestError(
                "prompt",
                f"{len(ids)} prompt tokens + max_tokens {inp.max_tokens} exceed the model's "
                f"context of {model.max_context}",
            )
        return ids

    # ------------------------------------------------------------------------ generate

    async def generate(self, inp: GenerateInput) -> AsyncIterator[OutChunk]:
        self._validate(inp)
        started = time.monotonic()
        workers = await self.store.workers()
        if not workers:
            raise errors.UnavailableError("no workers registered")
        fingerprints = {w.fingerprint for w in workers}
        if len(fingerprints) > 1:
            log.warning("workers serve different models: %s", sorted(fingerprints))
        ids = await self._tokens(inp, workers)
        rid = inp.request_id or uuid.uuid4().hex
        digest = body_hash(
            {
                "tokens": ids,
                "max_tokens": inp.max_tokens,
                "sampling": [inp.sampling.temperature, inp.sampling.top_p, inp.sampling.seed],
                "stop": list(inp.stop),
            }
        )
        record = RequestRecord(
            request_id=rid,
            state=State.QUEUED,
            epoch=1,
            body_hash=digest,
            prompt_tokens=len(ids),
            max_tokens=inp.max_tokens,
            created_at=time.time(),
            owner=self.owner,
        )
        existing = await self.store.create(record)
        if existing is not None:
            if existing.body_hash != digest:
                raise errors.ConflictError(
                    f"request id {rid!r} was already used for a different request"
                )
            async for chunk in self.follow(rid, inp.resume_from):
                yield chunk
            return
        task = asyncio.current_task()
        if task is not None:
            self._driving[rid] = task  # so Cancel can stop it
        try:
            async for chunk in self._drive(record, ids, inp, workers, started):
                if chunk.index + len(chunk.token_ids) > inp.resume_from or chunk.finish_reason:
                    yield chunk
        finally:
            self._driving.pop(rid, None)

    async def _drive(
        self,
        record: RequestRecord,
        ids: list[int],
        inp: GenerateInput,
        workers: Sequence[WorkerInfo],
        started: float,
    ) -> AsyncIterator[OutChunk]:
        rid = record.request_id
        epoch = record.epoch
        timings: dict[str, float] = {}
        try:
            placement = place(workers, len(ids) + inp.max_tokens, fallback=self.settings.fallback)
        except errors.PdorchError as exc:
            await self._fail(rid, epoch, State.QUEUED, exc)
            raise
        timings["queue_ms"] = (time.monotonic() - started) * 1000
        try:
            if placement.mode is Mode.DISAGGREGATED:
                stream = self._disaggregated(rid, epoch, ids, inp, placement, timings)
            else:
                stream = self._aggregated(rid, epoch, ids, inp, placement, timings)
            async for chunk in self._relay(rid, epoch, inp, stream, timings, started):
                yield chunk
        except asyncio.CancelledError:
            await self._finish(rid, epoch, State.CANCELLED, "cancelled", timings, "")
            raise
        except errors.PdorchError as exc:
            await self._fail(rid, epoch, None, exc)
            raise

    async def _disaggregated(
        self,
        rid: str,
        epoch: int,
        ids: list[int],
        inp: GenerateInput,
        placement: Placement,
        timings: dict[str, float],
    ) -> AsyncGenerator[worker_pb2.TokenChunk, None]:
        assert placement.prefill is not None
        prefill, decode = placement.prefill, placement.decode
        await self.store.transition(
            rid,
            epoch=epoch,
            target=State.PREFILLING,
            sources=frozenset({State.QUEUED}),
            fields={
                "mode": Mode.DISAGGREGATED,
                "prefill_worker": prefill.worker_id,
                "decode_worker": decode.worker_id,
            },
        )
        sampling = convert.sampling_to_pb(inp.sampling)
        adopted = False
        inner = self._prefill_then_decode(rid, epoch, ids, inp, prefill, decode, sampling, timings)
        try:
            async with contextlib.aclosing(inner):
                async for chunk in inner:
                    adopted = True
                    yield chunk
        finally:
            if not adopted:  # the KV may have reached the decode worker: don't leave it held
                await self._release(decode, rid, epoch)

    async def _release(self, decode: WorkerInfo, rid: str, epoch: int) -> None:
        with contextlib.suppress(grpc.RpcError, asyncio.TimeoutError):
            await asyncio.shield(
                self.clients.get(decode.address).decode.Release(
                    worker_pb2.ReleaseRequest(request_id=rid, epoch=epoch), timeout=2.0
                )
            )

    async def _prefill_then_decode(
        self,
        rid: str,
        epoch: int,
        ids: list[int],
        inp: GenerateInput,
        prefill: WorkerInfo,
        decode: WorkerInfo,
        sampling: common_pb2.SamplingParams,
        timings: dict[str, float],
    ) -> AsyncGenerator[worker_pb2.TokenChunk, None]:
        async with translated(prefill.worker_id, "prefill"):
            resp = await self.clients.get(prefill.address).prefill.Prefill(
                worker_pb2.PrefillRequest(
                    request_id=rid,
                    epoch=epoch,
                    token_ids=ids,
                    sampling=sampling,
                    first_index=0,
                    kv_target=decode.kv_address,
                ),
                timeout=self.settings.prefill_timeout_s,
            )
        timings["prefill_ms"] = resp.prefill_ms
        timings["transfer_ms"] = resp.transfer_ms
        await self.store.transition(
            rid,
            epoch=epoch,
            target=State.TRANSFERRING,
            sources=frozenset({State.PREFILLING}),
            fields={"kv_bytes": resp.kv_bytes, "timings": _json(timings)},
        )
        call = self.clients.get(decode.address).decode.Decode(
            worker_pb2.DecodeRequest(
                request_id=rid,
                epoch=epoch,
                token_ids=ids,
                last_token=resp.first_token,
                generated=1,
                sampling=sampling,
                max_tokens=inp.max_tokens,
                kv_timeout_s=self.settings.kv_timeout_s,
                prompt_tokens=len(ids),
            )
        )
        first = True
        try:
            async with translated(decode.worker_id, "decode"):
                async for chunk in call:
                    if first:  # the decode worker adopted the KV
                        first = False
                        await self.store.transition(
                            rid,
                            epoch=epoch,
                            target=State.DECODING,
                            sources=frozenset({State.TRANSFERRING}),
                        )
                    yield chunk
        finally:
            call.cancel()  # a stop string or a cancelled client ends the decode early

    async def _aggregated(
        self,
        rid: str,
        epoch: int,
        ids: list[int],
        inp: GenerateInput,
        placement: Placement,
        timings: dict[str, float],
    ) -> AsyncGenerator[worker_pb2.TokenChunk, None]:
        worker = placement.decode
        await self.store.transition(
            rid,
            epoch=epoch,
            target=State.DECODING,
            sources=frozenset({State.QUEUED}),
            fields={"mode": Mode.AGGREGATED, "decode_worker": worker.worker_id},
        )
        call = self.clients.get(worker.address).general.Generate(
            worker_pb2.AggregatedRequest(
                request_id=rid,
                epoch=epoch,
                token_ids=ids,
                sampling=convert.sampling_to_pb(inp.sampling),
                max_tokens=inp.max_tokens,
                first_index=0,
                prompt_tokens=len(ids),
            )
        )
        try:
            async with translated(worker.worker_id, "generate"):
                async for chunk in call:
                    yield chunk
        finally:
            call.cancel()

    async def _relay(
        self,
        rid: str,
        epoch: int,
        inp: GenerateInput,
        stream: AsyncGenerator[worker_pb2.TokenChunk, None],
        timings: dict[str, float],
        started: float,
    ) -> AsyncIterator[OutChunk]:
        text_so_far = ""
        produced = 0
        first_token_at: float | None = None
        finish = ""
        async with contextlib.aclosing(stream):
            async for chunk in _with_timeout(stream, self.settings.token_timeout_s):
                ids = list(chunk.token_ids)
                delta = chunk.text
                reason = convert.finish_from_pb(chunk.finish_reason)
                if inp.stop and delta:
                    cut = _stop_cut(text_so_far, delta, inp.stop)
                    if cut is not None:
                        delta, reason = delta[:cut], "stop"
                if ids or delta:
                    if chunk.index != produced:
                        raise errors.WorkerError(
                            "decode",
                            f"token index {chunk.index}, expected {produced}",
                            retryable=True,
                        )
                    entry = JournalEntry(chunk.index, tuple(ids), delta)
                    try:
                        await self.store.append(rid, epoch, entry)
                    except errors.RequestEndedError:  # cancelled through another replica
                        yield OutChunk(rid, produced, [], "", "cancelled", timings)
                        return
                    if first_token_at is None and ids:
                        first_token_at = time.monotonic()
                        timings["ttft_ms"] = (first_token_at - started) * 1000
                    produced += len(ids)
                    text_so_far += delta
                    yield OutChunk(rid, chunk.index, ids, delta)
                if reason:
                    finish = reason
                    break
        if not finish:
            raise errors.WorkerError("decode", "stream ended without a finish", retryable=True)
        now = time.monotonic()
        timings["total_ms"] = (now - started) * 1000
        if first_token_at is not None and produced > 1:
            timings["tpot_ms"] = (now - first_token_at) * 1000 / (produced - 1)
        record = await self._finish(rid, epoch, State.DONE, finish, timings, "")
        yield OutChunk(rid, produced, [], "", finish, timings, record)

    async def _finish(
        self,
        rid: str,
        epoch: int,
        state: State,
        reason: str,
        timings: dict[str, float],
        error: str,
    ) -> RequestRecord | None:
        try:
            await self.store.transition(
                rid,
                epoch=epoch,
                target=state,
                fields={"finish_reason": reason, "timings": _json(timings), "error": error},
            )
            return await self.store.get(rid)
        except errors.PdorchError as exc:
            log.warning("request %s: could not record %s: %s", rid, state, exc)
            return None

    async def _fail(self, rid: str, epoch: int, _from: State | None, exc: Exception) -> None:
        await self._finish(rid, epoch, State.FAILED, "error", {}, str(exc))

    # ---------------------------------------------------------------------- following

    async def follow(self, rid: str, start: int = 0) -> AsyncIterator[OutChunk]:
        """Stream a request this call does not drive, from its journal (resubmit, resume)."""
        entries_seen = 0
        while True:
            record = await self.store.get(rid)
            if record is None:
                raise errors.NotFoundError(f"no request {rid!r}")
            entries = await self.store.journal(rid, entries_seen)
            for e in entries:
                entries_seen += 1
                end = e.index + len(e.token_ids)
                if end <= start and e.token_ids:
                    continue
                ids = list(e.token_ids[max(0, start - e.index) :])
                yield OutChunk(rid, max(e.index, start), ids, e.text)
            if record.state.terminal and not entries:
                if record.state is State.FAILED:
                    raise errors.WorkerError("request", record.error or "failed", retryable=False)
                yield OutChunk(
                    rid,
                    record.output_tokens,
                    [],
                    "",
                    record.finish_reason or str(record.state),
                    record.timings,
                    record,
                )
                return
            if not entries:
                await asyncio.sleep(self.settings.follow_poll_s)

    async def cancel(self, rid: str) -> State:
        record = await self.store.get(rid)
        if record is None:
            raise errors.NotFoundError(f"no request {rid!r}")
        if record.state.terminal:
            return record.state
        task = self._driving.get(rid)
        if task is not None:  # driven here: cancelling it cancels the worker calls too
            task.cancel()
        with contextlib.suppress(errors.StaleEpochError, errors.InvalidTransitionError):
            await self.store.transition(
                rid,
                epoch=record.epoch,
                target=State.CANCELLED,
                fields={"finish_reason": "cancelled"},
            )
        got = await self.store.get(rid)
        return got.state if got else State.CANCELLED

    async def get(self, rid: str) -> RequestRecord:
        record = await self.store.get(rid)
        if record is None:
            raise errors.NotFoundError(f"no request {rid!r}")
        return record


def _json(d: dict[str, float]) -> str:
    return json.dumps(d, sort_keys=True)


def _stop_cut(before: str, delta: str, stops: Sequence[str]) -> int | None:
    """Offset in ``delta`` where the earliest stop string begins (it may start in ``before``)."""
    text = before + delta
    best: int | None = None
    for s in stops:
        pos = text.find(s, max(0, len(before) - len(s) + 1))
        if pos != -1 and (best is None or pos < best):
            best = pos
    return None if best is None else max(0, best - len(before))


async def _with_timeout(
    stream: AsyncIterator[worker_pb2.TokenChunk], timeout_s: float
) -> AsyncIterator[worker_pb2.TokenChunk]:
    it = aiter(stream)
    while True:
        try:
            chunk = await asyncio.wait_for(anext(it), timeout_s)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise errors.WorkerError(
                "decode", f"no token for {timeout_s}s", retryable=True
            ) from None
        yield chunk
