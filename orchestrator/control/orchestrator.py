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
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import grpc
import tenacity

from orchestrator import errors
from orchestrator.aio import cancel_and_wait
from orchestrator.api import convert, worker_pb2
from orchestrator.control.clients import WorkerClients, translated
from orchestrator.control.metrics import ControlMetrics
from orchestrator.core.admission import (
    AdmissionPolicy,
    Decision,
    PrefillQueue,
    admit,
    disaggregate_or_not,
)
from orchestrator.core.breaker import Breakers
from orchestrator.core.cost import PoolUsage, cost_fields
from orchestrator.core.deadlines import StateDeadlines, overdue
from orchestrator.core.hardware import CPU_HOST, PRICED_KINDS, GpuProfile, get_gpu
from orchestrator.core.kvdtype import KvPolicy, negotiate_for
from orchestrator.core.rates import Rates
from orchestrator.core.records import (
    JournalEntry,
    RequestRecord,
    WorkerInfo,
    body_hash,
    unjournalled_after,
)
from orchestrator.core.sampling import SamplingParams
from orchestrator.core.scheduler import Mode, Placement, place
from orchestrator.core.state import Edge, State
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
    """How often a follower (resubmission, resume) polls the journal of a request."""
    watch_interval_s: float = 0.5
    """How often a wait on a worker checks that its heartbeat is still alive."""
    max_attempts: int = 4
    """Attempts per request (the first plus failovers) before it fails."""
    retry_initial_s: float = 0.05
    retry_max_s: float = 1.0
    breaker_cooldown_s: float = 2.0
    """A worker whose call failed is skipped this long, then probed by one request."""
    store_outage_s: float = 30.0
    """How long a finishing request waits for an unreachable store before giving up."""
    reap_interval_s: float = 1.0
    """How often a replica looks for requests whose owner's lease expired."""
    deadlines: StateDeadlines = field(default_factory=StateDeadlines)
    """The backstop per state (`orchestrator.core.deadlines`): enforced by every replica."""
    deadline_scan_s: float = 5.0
    """How often a replica checks every live request against its state's deadline."""
    prices: Mapping[str, GpuProfile] = field(default_factory=lambda: dict(PRICED_KINDS))
    """GPU kind (a worker's --gpu-kind) -> its profile and price per hour."""
    transfer_usd_per_gb: float = 0.0
    """What moving a GB of KV between workers costs (0 inside a cluster)."""
    detach_grace_s: float = 10.0
    """A request whose client went away keeps running this long, so the client can reconnect
    (to any replica) and resume; with no client attached by then it is cancelled."""
    attach_refresh_s: float = 1.0
    """How often a client following a request from the journal says it is still there."""
    kv_dtype: KvPolicy = KvPolicy.AUTO
    """How the KV's wire dtype is chosen per prefill→decode pair (`orchestrator.core.kvdtype`)."""
    admission: AdmissionPolicy = field(default_factory=AdmissionPolicy)
    """Early rejection (SLO, bounded queues, in-flight and tenant limits) and conditional
    disaggregation (`orchestrator.core.admission`)."""


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
    tenant: str = "default"
    """Who is billed (rpc: the x-pdorch-tenant call metadata)."""


@dataclass(slots=True)
class OutChunk:
    request_id: str
    index: int
    token_ids: list[int]
    text: str
    finish_reason: str = ""
    timings: dict[str, float] = field(default_factory=dict)
    record: RequestRecord | None = None


@dataclass(slots=True)
class _Run:
    """One request being driven: what the client has been sent so far survives failovers."""

    rid: str
    epoch: int
    prompt: list[int]
    inp: GenerateInput
    started: float
    output: list[int] = field(default_factory=list)
    text: str = ""
    first_token_at: float | None = None
    timings: dict[str, float] = field(default_factory=dict)
    excluded: set[str] = field(default_factory=set)
    failovers: int = 0
    last_error: str = ""
    lease_lost: bool = False
    cancelled: bool = False
    """This replica cancelled the run (its client left, or a Cancel). Checked at every chunk
    and watch step, so that a ``Task.cancel()`` lost on its way still ends the run."""
    entries: list[JournalEntry] = field(default_factory=list)
    """Every chunk relayed by this run, to re-journal what a restarted Redis lost."""
    unjournalled: int = 0
    """How many of the last ``entries`` are not in the journal yet (Redis unreachable)."""
    clients: set[asyncio.Queue[OutChunk | BaseException | None]] = field(default_factory=set)
    """The streams of the clients attached on this replica (the drive outlives them)."""
    gpu_s: dict[str, float] = field(default_factory=dict)
    """Engine seconds per pool ("prefill", "decode", "aggregated"), failed attempts included."""
    gpu_kind: dict[str, str] = field(default_factory=dict)
    pool: str = ""
    """The pool whose worker streams the tokens in the current attempt."""
    kv_moved: int = 0
    queued: tuple[str, int] | None = None
    """(prefill worker, tokens) while this run waits in that worker's queue."""


def _check(run: _Run) -> None:
    """Raise what the run's flags say: taken over by a peer, or cancelled here."""
    if run.lease_lost:
        raise errors.LeaseLostError(f"request {run.rid!r} taken over")
    if run.cancelled:
        raise asyncio.CancelledError(f"request {run.rid!r} cancelled")


def _retryable(exc: BaseException) -> bool:
    if isinstance(exc, errors.WorkerError):
        return exc.retryable_instance
    return isinstance(exc, errors.PdorchError) and exc.retryable


class Orchestrator:
    def __init__(
        self,
        store: RedisStore,
        clients: WorkerClients,
        settings: ControlSettings,
        owner: str,
        metrics: ControlMetrics | None = None,
    ) -> None:
        self.store = store
        self.metrics = metrics
        self.clients = clients
        self.settings = settings
        self.owner = owner
        self._driving: dict[str, asyncio.Task[object]] = {}
        self._resuming: set[str] = set()
        self._resumed: set[asyncio.Task[None]] = set()
        self._reaper: asyncio.Task[None] | None = None
        self._leased: dict[str, _Run] = {}
        """Requests this replica drives, whose leases `_keep_leases` refreshes together."""
        self._lease_keeper: asyncio.Task[None] | None = None
        self.breakers = Breakers(settings.breaker_cooldown_s)
        self._stopping = False
        self._load: dict[str, tuple[int, int]] = {}
        """Worker id -> (sequences, KV bytes) this replica placed there and has not finished."""
        self._queue: dict[str, tuple[int, int]] = {}
        """Prefill worker id -> (requests, prompt tokens) this replica sent and not yet
        prefilled: the bounded queues admission checks."""
        self._inflight = 0
        """Calls in `generate` now (client streams on this replica)."""
        self.rates = Rates()
        """Measured prefill rates and KV transfer costs (admission and placement read them)."""

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
            req = worker_pb2.TokenizeRequest()
            if inp.text is not None:
                req.text = inp.text
            else:
                for role, content in inp.chat or ():
                    req.chat.messages.add(role=role, content=content)
            resp = await self._tokenize(req, workers)
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

    async def _tokenize(
        self, req: worker_pb2.TokenizeRequest, workers: Sequence[WorkerInfo]
    ) -> worker_pb2.TokenizeResponse:
        """Tokenize on the least-loaded worker that answers (a dead one is skipped)."""
        last: errors.WorkerError | None = None
        for worker in sorted(workers, key=lambda w: (w.active, w.worker_id)):
            try:
                async with translated(worker.worker_id, "tokenize"):
                    return await self.clients.get(worker.address).general.Tokenize(req, timeout=30)
            except errors.WorkerError as exc:
                if not exc.retryable_instance:
                    raise
                last = exc
        raise errors.UnavailableError(f"no worker could tokenize: {last}")

    # ------------------------------------------------------------------------ generate

    async def generate(self, inp: GenerateInput) -> AsyncIterator[OutChunk]:
        """Serve one call. ``max_inflight`` bounds the calls in progress from the first
        await on, so a burst is refused at the door (`OverloadedError`, a retry-after)
        instead of queueing inside the replica; a resubmission of a known request is not."""
        limit = self.settings.admission.max_inflight
        if limit and self._inflight >= limit:
            known = bool(inp.request_id) and await self.store.get(inp.request_id) is not None
            if not known:
                if self.metrics is not None:
                    self.metrics.rejections.labels("OverloadedError").inc()
                raise errors.OverloadedError(
                    f"this orchestrator serves {self._inflight} calls (limit {limit})", 1.0
                )
        self._inflight += 1
        try:
            async for chunk in self._generate(inp):
                yield chunk
        finally:
            self._inflight -= 1

    async def _generate(self, inp: GenerateInput) -> AsyncIterator[OutChunk]:
        started = time.monotonic()
        try:
            workers, ids = await self._admit(inp)
            estimate = await self._early_reject(inp, workers, len(ids))
        except errors.PdorchError as exc:
            if self.metrics is not None:
                self.metrics.rejections.labels(type(exc).__name__).inc()
            raise
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
            prompt_ids=ids,
            sampling=[inp.sampling.temperature, inp.sampling.top_p, inp.sampling.seed],
            stop=list(inp.stop),
            tenant=inp.tenant,
        )
        policy = self.settings.admission
        try:
            existing = await self.store.create(record, policy.tenant_limit(inp.tenant))
        except errors.OverloadedError:
            if self.metrics is not None:
                self.metrics.rejections.labels("OverloadedError").inc()
            raise
        if existing is not None:
            if existing.body_hash != digest:
                raise errors.ConflictError(
                    f"request id {rid!r} was already used for a different request"
                )
            async for chunk in self.follow(rid, inp.resume_from):
                yield chunk
            return
        run = _Run(record.request_id, record.epoch, ids, inp, started)
        if estimate is not None:
            run.timings["ttft_estimate_ms"] = estimate * 1000
        feed: asyncio.Queue[OutChunk | BaseException | None] = asyncio.Queue()
        run.clients.add(feed)
        # The drive is its own task: a client that disconnects does not stop it, so the
        # client can reconnect (to any replica) and resume; see `_detached`.
        task = asyncio.create_task(self._drive_detached(run, workers), name=f"pdorch-drive-{rid}")
        self._driving[rid] = task  # so Cancel can stop it
        try:
            while (item := await feed.get()) is not None:
                if isinstance(item, errors.LeaseLostError):
                    # Another replica took the request over: keep this client's stream going
                    # from the journal the new owner writes, after what the client has.
                    async for chunk in self.follow(rid, max(len(run.output), inp.resume_from)):
                        yield chunk
                    return
                if isinstance(item, BaseException):
                    raise item
                if item.index + len(item.token_ids) > inp.resume_from or item.finish_reason:
                    yield item
        finally:
            run.clients.discard(feed)
            if not task.done() and not run.clients:
                self._detached(run, task)

    async def _admit(self, inp: GenerateInput) -> tuple[list[WorkerInfo], list[int]]:
        """Validate and tokenize (nothing written yet): the workers seen and the prompt ids."""
        self._validate(inp)
        workers = await self.store.workers()
        if not workers:
            raise errors.UnavailableError("no workers registered")
        fingerprints = {w.fingerprint for w in workers}
        if len(fingerprints) > 1:
            log.warning("workers serve different models: %s", sorted(fingerprints))
        return workers, await self._tokens(inp, workers)

    async def _early_reject(
        self, inp: GenerateInput, workers: Sequence[WorkerInfo], prompt_tokens: int
    ) -> float | None:
        """Refuse now (`OverloadedError`, with a retry-after) what would only queue to time
        out; the estimated TTFT otherwise (None before the rates are measured)."""
        queues = []
        for w in workers:
            if w.role == "prefill":
                requests, tokens = self._queue.get(w.worker_id, (0, 0))
                rate = self.rates.prefill_rate(w.worker_id, w.gpu_kind)
                queues.append(PrefillQueue(w.worker_id, requests, tokens, rate))
        transfer = self.rates.transfer_model()
        decodes = [w for w in workers if w.role == "decode"]
        kv_bytes = prompt_tokens * (decodes[0].kv_bytes_per_token if decodes else 0)
        transfer_s = transfer.seconds(kv_bytes) if transfer is not None and decodes else 0.0
        try:
            return admit(
                prompt_tokens, queues, transfer_s, self.settings.admission, len(self._driving)
            ).ttft_estimate_s
        except errors.OverloadedError:
            # A resubmission (or resume) of a request already admitted is never refused.
            if inp.request_id and await self.store.get(inp.request_id) is not None:
                return None
            raise

    async def _drive_detached(self, run: _Run, workers: Sequence[WorkerInfo]) -> None:
        """Drive the request to its end, handing chunks (and the end) to attached clients."""

        def deliver(item: OutChunk | BaseException | None) -> None:
            for client in list(run.clients):
                client.put_nowait(item)  # bounded: at most one chunk per output token

        try:
            async for chunk in self._drive(run, workers):
                deliver(chunk)
        except asyncio.CancelledError:
            if self._stopping:  # handed off: the client resumes on another replica
                deliver(errors.UnavailableError("orchestrator shutting down; resume elsewhere"))
            else:
                deliver(OutChunk(run.rid, len(run.output), [], "", "cancelled", run.timings))
            raise
        except errors.PdorchError as exc:
            deliver(exc)  # the client sees it; the record already says how the request ended
        except Exception as exc:
            log.exception("request %s: drive failed", run.rid)
            deliver(errors.UnavailableError(f"request {run.rid} failed: {exc}"))
        else:
            deliver(None)
        finally:
            self._driving.pop(run.rid, None)

    def _stop_driving(self, rid: str) -> None:
        """Cancel the run driven here, if any: its task, and the flag its checkpoints read.

        The cancel alone can be lost (see ``orchestrator.aio.cancel_and_wait``: redis-py's
        sends under Python 3.11); cancelling again could interrupt the handler recording the
        end, so the flag ends the run instead, at its next chunk or watch step."""
        run = self._leased.get(rid)
        if run is not None:
            run.cancelled = True
        task = self._driving.get(rid)
        if task is not None:
            task.cancel()

    def _detached(self, run: _Run, task: asyncio.Task[None]) -> None:
        """The last local client left: give it ``detach_grace_s`` to come back (here, or on
        another replica — followers mark the request attached in the store), else cancel."""

        async def watch() -> None:
            grace = self.settings.detach_grace_s
            deadline = time.monotonic() + grace
            while not task.done():
                await asyncio.sleep(min(0.5, grace))  # polling attachment with a deadline
                if run.clients:
                    return  # cannot happen today (resumes follow the journal), but cheap
                try:
                    attached = await self.store.client_attached(run.rid)
                except errors.UnavailableError:
                    attached = True  # can't tell while Redis is away: keep generating
                if attached:
                    deadline = time.monotonic() + grace
                elif time.monotonic() > deadline:
                    log.info("request %s: no client for %.0fs, cancelling", run.rid, grace)
                    self._stop_driving(run.rid)
                    return

        watcher = asyncio.create_task(watch(), name=f"pdorch-detached-{run.rid}")
        self._resumed.add(watcher)
        watcher.add_done_callback(self._resumed.discard)

    async def _drive(self, run: _Run, workers: Sequence[WorkerInfo]) -> AsyncIterator[OutChunk]:
        """Run the request to its end, failing over to other workers on retryable errors.

        Each retry bumps the epoch (the store, the decode worker's KV inbox and the journal
        refuse the old one) and resumes from the tokens already relayed: prompt + generated
        tokens are re-prefilled and decoding continues at the next index, so the client sees
        contiguous indices — no duplicate, no gap.
        """
        s = self.settings
        self._leased[run.rid] = run
        if self._lease_keeper is None:
            self._lease_keeper = asyncio.create_task(self._keep_leases(), name="pdorch-leases")
        retrying = tenacity.AsyncRetrying(
            stop=tenacity.stop_after_attempt(s.max_attempts),
            wait=tenacity.wait_exponential_jitter(multiplier=s.retry_initial_s, max=s.retry_max_s),
            retry=tenacity.retry_if_exception(_retryable),
            reraise=True,
        )
        try:
            async for attempt in retrying:
                with attempt:
                    if attempt.retry_state.attempt_number > 1:
                        await self._reassign(run)
                        workers = await self.store.workers()
                    async for chunk in self._attempt(run, workers):
                        yield chunk
        except asyncio.CancelledError:
            if self._stopping and not run.lease_lost:
                # Shutting down (drain): hand the request off — another replica takes it
                # over at once (epoch + 1) and its clients resume there.
                run.lease_lost = True  # the lease keeper must not refresh it meanwhile
                with contextlib.suppress(errors.PdorchError):
                    await self.store.release_lease(run.rid, self.owner)
            elif not run.lease_lost:
                await self._finish(run, Edge.CANCEL, "cancelled", "")
            raise
        except errors.LeaseLostError:
            raise  # the new owner records the end
        except errors.StaleEpochError as exc:
            # Our writes are fenced off: another replica took the request over (our lease
            # lapsed while Redis stalled, say). Not a failure: the new owner continues it
            # and this client follows the journal it writes.
            run.lease_lost = True
            raise errors.LeaseLostError(f"request {run.rid!r} taken over: {exc}") from exc
        except errors.PdorchError as exc:
            if run.lease_lost:
                # This replica lost the request (its lease lapsed and a peer takes it over):
                # what failed here is not the request's fate; the new owner continues it.
                raise errors.LeaseLostError(f"request {run.rid!r} taken over: {exc}") from exc
            await self._finish(run, Edge.FAIL, "error", str(exc))
            raise
        finally:
            if self._leased.get(run.rid) is run:
                del self._leased[run.rid]

    async def _keep_leases(self) -> None:
        """Refresh this replica's lease on every request it drives, all in one round trip
        per interval. A request whose lease is lost (this replica stalled and another took
        over) is told to stop: the new owner continues it."""
        interval = self.store.settings.lease_ttl_s / 3
        while True:
            await asyncio.sleep(interval)
            runs = [r for r in self._leased.values() if not r.lease_lost]
            try:
                held = await self.store.refresh_leases(
                    [(r.rid, r.epoch) for r in runs], self.owner, retake=not self._stopping
                )
            except errors.UnavailableError:
                continue  # the store is down: keep generating, journal writes will tell
            except Exception:
                log.exception("lease refresh failed")  # one bad round must not stop them all
                continue
            for run, ok in zip(runs, held, strict=True):
                if not ok and self._leased.get(run.rid) is run:
                    log.warning("request %s: lease lost to another replica; stopping", run.rid)
                    run.lease_lost = True  # the driver notices within a watch interval

    # ------------------------------------------------------------------- takeover

    async def start(self) -> None:
        """Start the reaper that takes over requests whose owner's lease expired."""
        self._reaper = asyncio.create_task(self._reap(), name="pdorch-takeover-reaper")

    async def stop(self) -> None:
        """Stop reaping and hand every request this replica drives to the others (their
        leases are released, so a peer takes each over at once, epoch + 1)."""
        self._stopping = True
        if self._reaper is not None:
            await cancel_and_wait(self._reaper)
        for run in self._leased.values():
            run.cancelled = True  # in case a task's cancel below is lost (see _stop_driving)
        tasks = [*self._resumed, *self._driving.values()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if self._lease_keeper is not None:  # last: hand-offs above keep their leases till done
            await cancel_and_wait(self._lease_keeper)

    async def _reap(self) -> None:
        scanned = time.monotonic()
        while True:
            await asyncio.sleep(self.settings.reap_interval_s)
            if time.monotonic() - scanned >= self.settings.deadline_scan_s:
                scanned = time.monotonic()
                try:
                    await self._enforce_deadlines()
                except errors.UnavailableError as exc:
                    log.warning("deadline scan skipped: %s", exc)
                except Exception:
                    log.exception("deadline scan failed")
            try:
                rids = [
                    rid
                    for rid in await self.store.active()
                    if rid not in self._driving and rid not in self._resuming
                ]
                # One read for all: only requests whose owner's lease lapsed are tried
                # (take_over checks again, atomically).
                holders = await self.store.lease_holders(rids)
                for rid, holder in zip(rids, holders, strict=True):
                    if holder is not None:
                        continue
                    epoch = await self.store.take_over(rid, self.owner)
                    if epoch is not None:
                        task = asyncio.create_task(
                            self._resume(rid, epoch), name=f"pdorch-resume-{rid}"
                        )
                        self._resumed.add(task)
                        task.add_done_callback(self._resumed.discard)
            except errors.UnavailableError as exc:
                log.warning("takeover scan skipped: %s", exc)
            except Exception:
                log.exception("takeover scan failed")

    async def _enforce_deadlines(self) -> None:
        """Fail every live request that sat in its state past the state's deadline, whoever
        drives it (one CAS per request: one that moved meanwhile is left alone)."""
        rids = await self.store.active()
        if not rids:
            return
        now = await self.store.now_ms()
        for rid, (state, epoch, updated) in (await self.store.progress(rids)).items():
            reason = overdue(state, float(updated), now, self.settings.deadlines)
            if reason is None:
                continue
            if await self.store.expire(rid, state, epoch, updated, reason):
                log.warning("request %s: failed by the reaper: %s", rid, reason)
                self._stop_driving(rid)  # stuck here: stop it (its end is recorded already)

    async def _resume(self, rid: str, epoch: int) -> None:
        """Finish a request taken over from a dead replica, from its journal."""
        self._resuming.add(rid)
        try:
            record = await self.store.get(rid)
            if record is None or not record.prompt_ids:
                return
            entries = await self.store.journal(rid)
            temperature, top_p, seed = record.sampling or [0.0, 1.0, 0]
            inp = GenerateInput(
                request_id=rid,
                token_ids=tuple(record.prompt_ids),
                max_tokens=record.max_tokens,
                sampling=SamplingParams(float(temperature), float(top_p), int(seed)),
                stop=tuple(record.stop),
            )
            run = _Run(rid, epoch, list(record.prompt_ids), inp, time.monotonic())
            run.output = [t for e in entries for t in e.token_ids]
            run.text = "".join(e.text for e in entries)
            run.timings = dict(record.timings)
            log.warning(
                "request %s: taken over at epoch %d from token %d", rid, epoch, len(run.output)
            )
            if len(run.output) >= record.max_tokens:
                # The old owner journalled every token, then lost its lease before recording
                # the end: record it (there is nothing left to generate).
                await self._finish(run, Edge.FINISH, "length", "")
                return
            workers = await self.store.workers()
            async for _ in self._drive(run, workers):
                pass  # clients follow the journal
        except errors.UnavailableError as exc:
            # Redis went away mid-takeover (e.g. still loading its AOF): give the lease back
            # so the next reaper pass — here or on a peer — retries now, not after its TTL.
            log.warning("request %s: resume interrupted: %s", rid, exc)
            with contextlib.suppress(errors.PdorchError):
                await self.store.release_lease(rid, self.owner)
        except (errors.PdorchError, asyncio.CancelledError) as exc:
            log.warning("request %s: resumed run ended: %r", rid, exc)
        finally:
            self._resuming.discard(rid)

    async def _reassign(self, run: _Run) -> None:
        """Fence the failed attempt off: epoch + 1, back to a placing state."""
        record = await self.store.get(run.rid)
        if record is None:
            raise errors.NotFoundError(f"request {run.rid!r} vanished")
        if record.state.terminal:
            raise errors.RequestEndedError(f"request {run.rid!r} is {record.state}")
        new_epoch = await self.store.transition(
            run.rid, Edge.REQUEUE, epoch=record.epoch, fields={"failovers": run.failovers}
        )
        log.warning(
            "request %s: failover %d after %s; epoch %d -> %d, resuming at token %d",
            run.rid, run.failovers, run.last_error, record.epoch, new_epoch, len(run.output),
        )  # fmt: skip
        run.epoch = new_epoch

    async def _attempt(self, run: _Run, workers: Sequence[WorkerInfo]) -> AsyncIterator[OutChunk]:
        if not workers:
            raise errors.UnavailableError("no workers registered")
        remaining = run.inp.max_tokens - len(run.output)
        if remaining <= 0:
            # Every token is out: what failed after the last one only cost the finish.
            yield await self._complete(run, "length")
            return
        now = time.monotonic()
        need = len(run.prompt) + run.inp.max_tokens
        fallback = self.settings.fallback
        blocked = self.breakers.blocked(now)
        held_back = {w.worker_id for w in workers if _breaker_key(w) in blocked}
        prefill_tokens = len(run.prompt) + len(run.output)
        queue = {wid: tokens for wid, (_, tokens) in self._queue.items()}
        rates: dict[str, float] = {}
        for w in workers:
            if w.role == "prefill" and (r := self.rates.prefill_rate(w.worker_id, w.gpu_kind)):
                rates[w.worker_id] = r

        def decide(prefill: WorkerInfo, decode: WorkerInfo) -> Decision:
            return self._decide(prefill_tokens, prefill, decode)

        def placed_on(exclude: set[str]) -> Placement:
            return place(
                workers, need, fallback=fallback, exclude=exclude, load=self._load,
                queue=queue, rates=rates, decide=decide,
            )  # fmt: skip

        try:
            placement = placed_on(run.excluded | held_back)
        except (errors.UnavailableError, errors.OverloadedError):
            # Breakers are advice: with nothing else left, try the workers they hold back.
            placement = placed_on(run.excluded)
        chosen = {w.worker_id: w for w in (placement.prefill, placement.decode) if w}
        kv_need = need * placement.decode.kv_bytes_per_token
        self._count(placement.decode.worker_id, 1, kv_need)
        if placement.prefill is not None:
            self._enqueue(run, placement.prefill.worker_id, prefill_tokens)
        if self.metrics is not None:
            self.metrics.placements.labels(str(placement.mode)).inc()
        try:
            placed = self._placed(run, placement, chosen, now, remaining)
            async with contextlib.aclosing(placed):
                async for chunk in placed:
                    yield chunk
        finally:
            self._count(placement.decode.worker_id, -1, -kv_need)
            self._dequeue(run)

    def _decide(self, tokens: int, prefill: WorkerInfo, decode: WorkerInfo) -> Decision:
        """Conditional disaggregation for a prompt of ``tokens`` (see `disaggregate_or_not`)."""
        policy = self.settings.admission
        if policy.aggregate_below is not None:
            return disaggregate_or_not(
                tokens, policy.aggregate_below, transfer=None, kv_bytes_per_token=0,
                prefill_rate=None, local_speedup=1.0, decode_active=decode.active,
            )  # fmt: skip
        return disaggregate_or_not(
            tokens,
            None,
            transfer=self.rates.transfer_model(),
            kv_bytes_per_token=decode.kv_bytes_per_token,
            prefill_rate=self.rates.prefill_rate(prefill.worker_id, prefill.gpu_kind),
            local_speedup=self._speedup(decode.gpu_kind, prefill.gpu_kind),
            decode_active=decode.active,
        )

    def _speedup(self, kind: str, than: str) -> float:
        """Peak compute of GPU ``kind`` over ``than`` (1.0 when either is not priced)."""
        if kind == than:
            return 1.0
        try:
            a, b = get_gpu(self.settings.prices, kind), get_gpu(self.settings.prices, than)
        except errors.ConfigError:
            return 1.0
        return (a.bf16_tflops or a.fp16_tflops) / (b.bf16_tflops or b.fp16_tflops)

    def _enqueue(self, run: _Run, worker_id: str, tokens: int) -> None:
        requests, queued = self._queue.get(worker_id, (0, 0))
        self._queue[worker_id] = (requests + 1, queued + tokens)
        run.queued = (worker_id, tokens)

    def _dequeue(self, run: _Run) -> None:
        """The run left its prefill worker's queue (prefilled, failed or cancelled)."""
        if run.queued is None:
            return
        worker_id, tokens = run.queued
        run.queued = None
        requests, queued = self._queue.get(worker_id, (1, tokens))
        if requests <= 1:
            self._queue.pop(worker_id, None)
        else:
            self._queue[worker_id] = (requests - 1, max(0, queued - tokens))

    def _count(self, worker_id: str, sequences: int, kv_bytes: int) -> None:
        active, kv = self._load.get(worker_id, (0, 0))
        active, kv = active + sequences, kv + kv_bytes
        if active <= 0:
            self._load.pop(worker_id, None)
        else:
            self._load[worker_id] = (active, kv)

    async def _placed(
        self,
        run: _Run,
        placement: Placement,
        chosen: dict[str, WorkerInfo],
        now: float,
        remaining: int,
    ) -> AsyncGenerator[OutChunk, None]:
        used = [_breaker_key(w) for w in chosen.values()]
        for key in used:
            self.breakers.placed(key, now)
        run.timings.setdefault("queue_ms", (time.monotonic() - run.started) * 1000)
        if placement.mode is Mode.DISAGGREGATED:
            stream = self._disaggregated(run, placement)
        else:
            if self.metrics is not None and not placement.by_choice:
                down = "prefill" if placement.decode.role == "decode" else "decode"
                self.metrics.fallbacks.labels(down).inc()
            stream = self._aggregated(run, placement)
        assert remaining > 0
        try:
            async for chunk in self._relay(run, stream):
                yield chunk
        except errors.WorkerError as exc:
            run.failovers += 1
            run.last_error = str(exc)
            if self.metrics is not None:
                self.metrics.failovers.labels(_cause(exc)).inc()
            run.excluded.add(exc.worker)
            if exc.worker in chosen:
                self.breakers.failure(_breaker_key(chosen[exc.worker]), time.monotonic())
            raise
        for wid in used:
            self.breakers.success(wid)

    async def _disaggregated(
        self, run: _Run, placement: Placement
    ) -> AsyncGenerator[worker_pb2.TokenChunk, None]:
        assert placement.prefill is not None
        prefill, decode = placement.prefill, placement.decode
        await self.store.transition(
            run.rid,
            Edge.PREFILL,
            epoch=run.epoch,
            fields={
                "mode": Mode.DISAGGREGATED,
                "placement": placement.reason,
                "prefill_worker": prefill.worker_id,
                "decode_worker": decode.worker_id,
            },
        )
        adopted = False
        inner = self._prefill_then_decode(run, prefill, decode)
        try:
            async with contextlib.aclosing(inner):
                async for chunk in inner:
                    adopted = True
                    yield chunk
        finally:
            if not adopted:  # the KV may have reached the decode worker: don't leave it held
                await self._release(decode, run.rid, run.epoch)

    async def _release(self, decode: WorkerInfo, rid: str, epoch: int) -> None:
        with contextlib.suppress(grpc.RpcError, asyncio.TimeoutError):
            await asyncio.shield(
                self.clients.get(decode.address).decode.Release(
                    worker_pb2.ReleaseRequest(request_id=rid, epoch=epoch), timeout=2.0
                )
            )

    async def _prefill_then_decode(
        self, run: _Run, prefill: WorkerInfo, decode: WorkerInfo
    ) -> AsyncGenerator[worker_pb2.TokenChunk, None]:
        tokens = run.prompt + run.output  # after a failover: prompt + what the client has
        sampling = convert.sampling_to_pb(run.inp.sampling)
        kv = negotiate_for(prefill, decode, self.settings.kv_dtype, self.settings.prices)
        call = self.clients.get(prefill.address).prefill.Prefill(
            worker_pb2.PrefillRequest(
                request_id=run.rid,
                epoch=run.epoch,
                token_ids=tokens,
                sampling=sampling,
                first_index=len(run.output),
                kv_target=decode.kv_address,
                kv_dtype=convert.kv_dtype_to_pb(kv.dtype),
            ),
            timeout=self.settings.prefill_timeout_s,
        )
        try:
            async with translated(prefill.worker_id, "prefill", kv_target=decode.worker_id):
                resp = await self._watch(call, prefill, run)
        finally:
            self._dequeue(run)
        self.rates.prefill(prefill.worker_id, prefill.gpu_kind, len(tokens), resp.prefill_ms / 1000)
        self.rates.transfer(int(resp.kv_bytes), resp.transfer_ms / 1000)
        run.timings["prefill_ms"] = resp.prefill_ms
        run.timings["transfer_ms"] = resp.transfer_ms
        self._spent(run, "prefill", prefill, resp.prefill_ms / 1000)
        run.kv_moved += int(resp.kv_bytes)
        if self.metrics is not None:
            self.metrics.transfer_bytes.inc(int(resp.kv_bytes))
            self.metrics.transfer_seconds.inc(resp.transfer_ms / 1000)
        run.pool = "decode"
        run.gpu_kind["decode"] = decode.gpu_kind
        await self.store.transition(
            run.rid,
            Edge.KV_SENT,
            epoch=run.epoch,
            fields={"kv_bytes": resp.kv_bytes, "kv_dtype": kv.label, "timings": _json(run.timings)},
        )
        stream = self.clients.get(decode.address).decode.Decode(
            worker_pb2.DecodeRequest(
                request_id=run.rid,
                epoch=run.epoch,
                token_ids=tokens,
                last_token=resp.first_token,
                generated=len(run.output) + 1,
                sampling=sampling,
                max_tokens=run.inp.max_tokens,
                kv_timeout_s=self.settings.kv_timeout_s,
                prompt_tokens=len(run.prompt),
            )
        )
        first = True
        try:
            async with translated(decode.worker_id, "decode"):
                async for chunk in self._watched(stream, decode, run):
                    if first:  # the decode worker adopted the KV
                        first = False
                        await self.store.transition(run.rid, Edge.KV_ADOPTED, epoch=run.epoch)
                    yield chunk
        finally:
            stream.cancel()  # a stop string, a failover or a cancelled client ends it early

    def _spent(self, run: _Run, pool: str, worker: WorkerInfo, seconds: float) -> None:
        run.gpu_s[pool] = run.gpu_s.get(pool, 0.0) + seconds
        run.gpu_kind.setdefault(pool, worker.gpu_kind)

    def _cost(self, run: _Run) -> dict[str, Any]:
        usages = []
        for pool, seconds in run.gpu_s.items():
            kind = run.gpu_kind.get(pool, "cpu")
            try:
                gpu = get_gpu(self.settings.prices, kind)
            except errors.ConfigError:
                log.warning("request %s: no price for GPU kind %r; counted at 0", run.rid, kind)
                gpu = replace(CPU_HOST, name=kind, price_per_hour=0.0)
            usages.append(PoolUsage(pool, gpu, seconds))
        return cost_fields(usages, run.kv_moved, self.settings.transfer_usd_per_gb, run.inp.tenant)

    async def _aggregated(
        self, run: _Run, placement: Placement
    ) -> AsyncGenerator[worker_pb2.TokenChunk, None]:
        worker = placement.decode
        run.pool = "aggregated"
        run.gpu_kind.setdefault("aggregated", worker.gpu_kind)
        await self.store.transition(
            run.rid,
            Edge.AGGREGATE,
            epoch=run.epoch,
            fields={
                "mode": Mode.AGGREGATED,
                "placement": placement.reason,
                "decode_worker": worker.worker_id,
                "prefill_worker": "",
            },
        )
        stream = self.clients.get(worker.address).general.Generate(
            worker_pb2.AggregatedRequest(
                request_id=run.rid,
                epoch=run.epoch,
                token_ids=run.prompt + run.output,
                sampling=convert.sampling_to_pb(run.inp.sampling),
                max_tokens=run.inp.max_tokens,
                first_index=len(run.output),
                prompt_tokens=len(run.prompt),
            )
        )
        try:
            async with translated(worker.worker_id, "generate"):
                async for chunk in self._watched(stream, worker, run):
                    yield chunk
        finally:
            stream.cancel()

    async def _alive(self, worker: WorkerInfo) -> bool:
        try:
            return await self.store.worker_alive(worker.worker_id)
        except errors.UnavailableError:
            return True  # the store is down, not the worker: keep going

    async def _watch(self, call: Any, worker: WorkerInfo, run: _Run) -> Any:
        """Await a unary call, failing fast when the worker's heartbeat disappears."""
        task = asyncio.ensure_future(call)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self.settings.watch_interval_s)
                if done:
                    return task.result()
                _check(run)
                if not await self._alive(worker):
                    raise errors.WorkerError(
                        worker.worker_id, "missed its heartbeats", retryable=True
                    )
        finally:
            if not task.done():
                call.cancel()

    async def _watched(self, stream: Any, worker: WorkerInfo, run: _Run) -> AsyncIterator[Any]:
        """Iterate a worker's token stream; a worker whose heartbeat expired, or a stream
        silent for ``token_timeout_s``, raises a retryable WorkerError."""
        it = aiter(stream)
        silent = 0.0
        step = self.settings.watch_interval_s
        while True:
            nxt = asyncio.ensure_future(anext(it))
            try:
                while True:
                    done, _ = await asyncio.wait({nxt}, timeout=step)
                    if done:
                        break
                    _check(run)
                    silent += step
                    if silent >= self.settings.token_timeout_s:
                        raise errors.WorkerError(
                            worker.worker_id, f"no token for {silent:.0f}s", retryable=True
                        )
                    if not await self._alive(worker):
                        raise errors.WorkerError(
                            worker.worker_id, "missed its heartbeats", retryable=True
                        )
            finally:
                if not nxt.done():
                    nxt.cancel()
            try:
                chunk = nxt.result()
            except StopAsyncIteration:
                return
            silent = 0.0
            yield chunk

    async def _relay(
        self, run: _Run, stream: AsyncGenerator[worker_pb2.TokenChunk, None]
    ) -> AsyncIterator[OutChunk]:
        inp, rid = run.inp, run.rid
        finish = ""
        async with contextlib.aclosing(stream):
            async for chunk in stream:
                _check(run)
                ids = list(chunk.token_ids)
                delta = chunk.text
                reason = convert.finish_from_pb(chunk.finish_reason)
                if chunk.compute_ms and run.pool:
                    run.gpu_s[run.pool] = run.gpu_s.get(run.pool, 0.0) + chunk.compute_ms / 1000
                if inp.stop and delta:
                    cut = _stop_cut(run.text, delta, inp.stop)
                    if cut is not None:
                        delta, reason = delta[:cut], "stop"
                if ids or delta:
                    produced = len(run.output)
                    if chunk.index != produced:
                        raise errors.WorkerError(
                            "decode",
                            f"token index {chunk.index}, expected {produced}",
                            retryable=True,
                        )
                    entry = JournalEntry(chunk.index, tuple(ids), delta)
                    try:
                        await self._journal(run, entry)
                    except errors.RequestEndedError:  # cancelled through another replica
                        yield OutChunk(rid, produced, [], "", "cancelled", run.timings)
                        return
                    if run.first_token_at is None and ids:
                        run.first_token_at = time.monotonic()
                        run.timings["ttft_ms"] = (run.first_token_at - run.started) * 1000
                    run.output.extend(ids)
                    run.text += delta
                    yield OutChunk(rid, chunk.index, ids, delta)
                if reason:
                    finish = reason
                    break
        if not finish:
            raise errors.WorkerError("decode", "stream ended without a finish", retryable=True)
        yield await self._complete(run, finish)

    async def _complete(self, run: _Run, finish: str) -> OutChunk:
        """Record the request done; its final chunk."""
        now = time.monotonic()
        run.timings["total_ms"] = (now - run.started) * 1000
        produced = len(run.output)
        if run.first_token_at is not None and produced > 1:
            run.timings["tpot_ms"] = (now - run.first_token_at) * 1000 / (produced - 1)
        record = await self._finish(run, Edge.FINISH, finish, "")
        return OutChunk(run.rid, produced, [], "", finish, run.timings, record)

    async def _journal(self, run: _Run, entry: JournalEntry) -> None:
        """Journal a chunk before the client sees it — or, while Redis is unreachable, keep it
        to journal later and let the stream go on (the worker does not need Redis)."""
        run.entries.append(entry)
        run.unjournalled += 1
        try:
            await self._flush(run)
        except errors.UnavailableError as exc:
            if run.unjournalled == 1:
                log.warning("request %s: journal unreachable, buffering: %s", run.rid, exc)

    async def _flush(self, run: _Run) -> None:
        while run.unjournalled:
            entry = run.entries[-run.unjournalled]
            try:
                await self.store.append(run.rid, run.epoch, entry)
            except errors.JournalGapError as gap:
                # Redis came back without its last writes (AOF fsync window), or a write
                # landed whose reply we never saw (cancelled mid-call): resync from the
                # journal's end, writing again only what it lacks.
                pending = unjournalled_after(run.entries, gap.journal_end)
                if pending is None:
                    raise
                if gap.journal_end < entry.index:
                    log.warning(
                        "request %s: re-journalling %d chunks lost by the store", run.rid, pending
                    )
                run.unjournalled = pending
                continue
            run.unjournalled -= 1

    async def _settle(self, run: _Run) -> None:
        """Before a final transition: wait (bounded) for the store and flush the journal."""
        deadline = time.monotonic() + self.settings.store_outage_s
        delay = 0.05
        while True:
            try:
                await self._flush(run)
            except errors.UnavailableError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(delay)  # backoff while the store is down
                delay = min(delay * 2, 1.0)
            else:
                return

    async def _finish(self, run: _Run, edge: Edge, reason: str, error: str) -> RequestRecord | None:
        state = edge.target
        cost = self._cost(run)
        try:
            await self._settle(run)
            await self.store.transition(
                run.rid,
                edge,
                epoch=run.epoch,
                fields={
                    "finish_reason": reason,
                    "timings": _json(run.timings),
                    "error": error,
                    "cost": _json(cost),
                },
            )
            with contextlib.suppress(errors.PdorchError):
                await self.store.add_tenant_cost(run.inp.tenant, cost)
            if self.metrics is not None:
                self.metrics.finished(str(state), reason, run.timings, cost)
            return await self.store.get(run.rid)
        except errors.PdorchError as exc:
            log.warning("request %s: could not record %s: %s", run.rid, state, exc)
            return None

    # ---------------------------------------------------------------------- following

    async def follow(self, rid: str, start: int = 0) -> AsyncIterator[OutChunk]:
        """Stream a request this call does not drive, from its journal (resubmit, resume)."""
        entries_seen = 0
        touched = 0.0
        while True:
            if time.monotonic() - touched > self.settings.attach_refresh_s:
                with contextlib.suppress(errors.UnavailableError):
                    await self.store.touch_client(rid, 3 * self.settings.attach_refresh_s)
                touched = time.monotonic()
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
                    raise errors.RequestFailedError(f"request failed: {record.error or '?'}")
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
        self._stop_driving(rid)  # driven here: cancelling it cancels the worker calls too
        with contextlib.suppress(errors.StaleEpochError, errors.InvalidTransitionError):
            await self.store.transition(
                rid, Edge.CANCEL, epoch=record.epoch, fields={"finish_reason": "cancelled"}
            )
        got = await self.store.get(rid)
        return got.state if got else State.CANCELLED

    async def get(self, rid: str) -> RequestRecord:
        record = await self.store.get(rid)
        if record is None:
            raise errors.NotFoundError(f"no request {rid!r}")
        return record


def _breaker_key(w: WorkerInfo) -> str:
    """Breakers follow a worker *process*: a restarted worker (new address) starts closed."""
    return f"{w.worker_id}@{w.address}"


def _cause(exc: errors.WorkerError) -> str:
    """A bounded label for what failed: the phase named in the error, or the heartbeat."""
    text = str(exc)
    if "missed its heartbeats" in text:
        return "heartbeat"
    for phase in ("prefill", "decode", "generate", "tokenize"):
        if f": {phase}:" in text:
            return phase
    return "other"


def _json(d: Mapping[str, Any]) -> str:
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
