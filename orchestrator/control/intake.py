"""Intake: a client's input becomes a request — validated, tokenized, admitted, created.

Nothing is written before the request is known to be valid and admissible: the input is
checked against the limits (`RequestLimits`, one place), the prompt tokenized on a worker
and checked against the model, and admission (`Ledger.estimate`) refuses early what would
only queue to time out; a call whose deadline passed meanwhile is refused too (its client
is gone: nothing is started for it). Then the record is created in the store — already
placed when the first attempt's placement could be booked (`Failover.book`): created in
the state its placement edge leads to, with that edge's fields, so the first attempt takes
no transition of its own before its prefill — idempotently: the
client's request id is the key, and a resubmission with the same body (`RequestSpec
.body_hash`) by the same tenant is answered from the existing request; a different body, or
another tenant's request under that id, is refused alike (`ConflictError`), so a reused id
never returns another tenant's output.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace

from orchestrator import errors
from orchestrator.api import worker_pb2
from orchestrator.control.directory import WorkerDirectory
from orchestrator.control.ledger import Booking, Ledger, placed
from orchestrator.control.legs import WorkerLegs
from orchestrator.control.metrics import ControlMetrics
from orchestrator.control.settings import ControlSettings
from orchestrator.core.idents import id_problem
from orchestrator.core.records import RequestRecord, WorkerInfo
from orchestrator.core.spec import GenerateInput, RequestSpec
from orchestrator.core.state import apply
from orchestrator.store.base import Store

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Admitted:
    spec: RequestSpec
    workers: Sequence[WorkerInfo]
    ttft_estimate_s: float | None


def _check_deadline(inp: GenerateInput) -> None:
    """Refuse a request whose caller's deadline passed: no one could receive its tokens."""
    if inp.deadline is not None and time.monotonic() >= inp.deadline:
        raise errors.DeadlineExceededError("the call's deadline passed before the request started")


class Intake:
    def __init__(
        self,
        store: Store,
        settings: ControlSettings,
        legs: WorkerLegs,
        ledger: Ledger,
        metrics: ControlMetrics | None,
        owner: str,
        directory: WorkerDirectory,
    ) -> None:
        self.store = store
        self.settings = settings
        self.legs = legs
        self.ledger = ledger
        self.metrics = metrics
        self.owner = owner
        self.directory = directory
        """The live workers, listed at most ``workers_cache_s`` ago (two store round trips
        per request saved under load; a worker's heartbeat changes once a second anyway)."""

    def rejected(self, exc: errors.PdorchError) -> None:
        if self.metrics is not None:
            self.metrics.rejections.labels(type(exc).__name__).inc()

    async def known(self, rid: str) -> bool:
        """Whether ``rid`` names a request already created (its resubmission is admitted);
        an id no request can have is not looked up."""
        return id_problem(rid) is None and await self.store.get(rid) is not None

    async def admit(self, inp: GenerateInput, driving: int) -> Admitted:
        """Validate, tokenize and admit (nothing written yet); ``driving``: runs here now."""
        try:
            self.settings.limits.check(inp)
            _check_deadline(inp)
            workers = await self.directory.listing()
            if not workers:
                raise errors.UnavailableError("no workers registered")
            fingerprints = self.ledger.fleet(workers).fingerprints
            if len(fingerprints) > 1:
                log.warning("workers serve different models: %s", sorted(fingerprints))
            ids = await self._tokens(inp, workers)
            spec = RequestSpec.admitted(inp, inp.request_id or uuid.uuid4().hex, ids)
            try:
                estimate = self.ledger.estimate(workers, len(ids), driving)
            except errors.OverloadedError:
                # A resubmission (or resume) of a request already admitted is never refused.
                if not await self.known(inp.request_id):
                    raise
                estimate = None
            _check_deadline(inp)  # admission took time: is anyone still waiting?
        except errors.PdorchError as exc:
            self.rejected(exc)
            raise
        return Admitted(spec, workers, estimate)

    async def create(
        self, spec: RequestSpec, booking: Booking | None = None
    ) -> tuple[RequestRecord, RequestRecord | None]:
        """Create the request's record: (the record, the existing one when the id was
        already used — with the same body; a different body raises ConflictError). With
        ``booking`` (the first attempt's placement) the record is created placed: its
        placement edge taken from the initial state, by the edge's own rule."""
        record = spec.record(self.owner)
        if booking is not None:
            edge, fields = placed(booking.placement)
            state, epoch = apply(edge, record.state, record.epoch)
            record = replace(
                record,
                state=state,
                epoch=epoch,
                mode=fields["mode"],
                placement=fields["placement"],
                prefill_worker=fields["prefill_worker"],
                decode_worker=fields["decode_worker"],
            )
        try:
            existing = await self.store.create(
                record, self.settings.admission.tenant_limit(spec.tenant)
            )
        except errors.OverloadedError as exc:
            self.rejected(exc)
            raise
        # Another tenant's request under this id is refused the same way as a different
        # body — never followed (its output is not this caller's), never told apart.
        if existing is not None and (
            existing.body_hash != record.body_hash or (existing.tenant or "default") != spec.tenant
        ):
            raise errors.ConflictError(
                f"request id {spec.request_id!r} was already used for a different request"
            )
        return record, existing

    async def _tokens(self, inp: GenerateInput, workers: Sequence[WorkerInfo]) -> tuple[int, ...]:
        model = workers[0]
        if inp.token_ids is not None:
            self.settings.limits.check_vocab(inp.token_ids, model)
            ids = tuple(inp.token_ids)
        else:
            req = worker_pb2.TokenizeRequest()
            if inp.text is not None:
                req.text = inp.text
            else:
                for role, content in inp.chat or ():
                    req.chat.messages.add(role=role, content=content)
            ids = tuple((await self.legs.tokenize(req, workers)).ids)
        self.settings.limits.check_prompt(ids, inp.max_tokens, model)
        return ids
