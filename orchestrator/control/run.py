"""One request being driven on this replica, and the chunks its clients see.

A `Run` is what survives the request's failovers: its spec, the epoch it writes at, the
tokens the client has been sent (``output``; of their text, the tail a stop string may
begin in: ``text``) and its timings. State with a single owner
lives with that owner: the journal's buffer in `JournalBuffer` (the relay), the engine time
and KV moved in `Usage` (cost), the failover history in `Attempts` (failover), the attached
clients in `orchestrator.control.sessions`, the prefill-queue ticket in the ledger.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from orchestrator import errors
from orchestrator.control.mux import Tap
from orchestrator.core.cost import PoolUsage, cost_fields, reuse_saving, total_reuse
from orchestrator.core.hardware import CPU_HOST, GpuProfile, get_gpu
from orchestrator.core.logprobs import TokenLogprob
from orchestrator.core.records import JournalEntry, RequestRecord
from orchestrator.core.spec import RequestSpec
from orchestrator.core.state import Edge

log = logging.getLogger(__name__)


@dataclass(slots=True)
class OutChunk:
    request_id: str
    index: int
    token_ids: list[int]
    text: str
    finish_reason: str = ""
    timings: dict[str, float] = field(default_factory=dict)
    record: RequestRecord | None = None
    logprobs: tuple[TokenLogprob, ...] = ()
    """One per token in ``token_ids`` when the request asked for them."""
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    """The prompt's, in the chunk that starts at index 0 (when asked for)."""
    prompt_tokens: int = 0
    """The prompt's length, in tokens (0: not known to whoever made the chunk)."""


@dataclass(slots=True)
class Usage:
    """Engine seconds per pool and KV bytes moved: what the request is billed for; and the
    prompt tokens found cached, what it was spared."""

    gpu_s: dict[str, float] = field(default_factory=dict)
    """Engine seconds per pool ("prefill", "decode", "aggregated"), failed attempts included."""
    gpu_kind: dict[str, str] = field(default_factory=dict)
    pool: str = ""
    """The pool whose worker streams the tokens in the current attempt."""
    kv_moved: int = 0
    reused: list[tuple[int, float | None]] = field(default_factory=list)
    """Per prefill: prompt tokens its worker found cached, and that worker's prefill rate
    (tokens/s; ``None``: not measured yet) to price what they would have cost."""

    def streaming(self, pool: str, gpu_kind: str) -> None:
        """Tokens now come from a worker of ``gpu_kind`` in ``pool``."""
        self.pool = pool
        self.gpu_kind[pool] = gpu_kind

    def spent(self, pool: str, gpu_kind: str, seconds: float) -> None:
        self.gpu_s[pool] = self.gpu_s.get(pool, 0.0) + seconds
        self.gpu_kind.setdefault(pool, gpu_kind)

    def reuse(self, tokens: int, tokens_per_second: float | None) -> None:
        """A prefill found ``tokens`` of the prompt in its worker's cache (not billed)."""
        if tokens > 0:
            self.reused.append((tokens, tokens_per_second))

    def computed(self, seconds: float) -> None:
        """Engine time a streamed chunk reports, counted in the current pool."""
        if self.pool:
            self.gpu_s[self.pool] = self.gpu_s.get(self.pool, 0.0) + seconds

    def cost(
        self, prices: Mapping[str, GpuProfile], usd_per_gb: float, tenant: str, rid: str
    ) -> dict[str, Any]:
        pools = [*self.gpu_s, *(["prefill"] if self.reused else [])]
        gpus = {pool: self._gpu(prices, pool, rid) for pool in pools}
        usages = [PoolUsage(pool, gpus[pool], seconds) for pool, seconds in self.gpu_s.items()]
        prefill = gpus.get("prefill", CPU_HOST)
        reuse = total_reuse(reuse_saving(prefill, n, rate) for n, rate in self.reused)
        return cost_fields(usages, self.kv_moved, usd_per_gb, tenant, reuse)

    def _gpu(self, prices: Mapping[str, GpuProfile], pool: str, rid: str) -> GpuProfile:
        kind = self.gpu_kind.get(pool, "cpu")
        try:
            return get_gpu(prices, kind)
        except errors.ConfigError:
            log.warning("request %s: no price for GPU kind %r; counted at 0", rid, kind)
            return replace(CPU_HOST, name=kind, price_per_hour=0.0)


Hand = Callable[[OutChunk], None]
"""Hands a chunk to the run's clients."""


def _nowhere(chunk: OutChunk) -> None:
    """A run nobody attached to (a takeover's: its clients follow the journal)."""


@dataclass(slots=True)
class JournalBuffer:
    """Every chunk relayed by this run, to re-journal what a restarted Redis lost; and the
    clients' chunks waiting for theirs to be written."""

    entries: list[JournalEntry] = field(default_factory=list)
    unjournalled: int = 0
    """How many of the last ``entries`` are not in the journal yet (Redis unreachable)."""
    handing: deque[OutChunk] = field(default_factory=deque)
    """The clients' chunks of the last ``len(handing)`` entries, held until those are
    written (`JournalWriter.submit`); then handed to ``hand``."""
    hand: Hand = _nowhere
    refused: errors.PdorchError | None = None
    """Why a write of this run's was refused (stale epoch, request ended, a gap it could not
    resync), until the relay raises it (`JournalWriter.refusal`)."""
    adopt: Edge | None = None
    """An edge the run's next write takes along with its first chunk, in the same store
    call (`Store.append_many`'s ``edges``): the decode stream's first chunk adopts the KV
    (`Edge.KV_ADOPTED`) without a round trip of its own. Cleared once a write carrying it
    landed, and at every attempt's start."""


@dataclass(slots=True)
class Attempts:
    """The failover history: whom to avoid, how many failovers, why the last one."""

    excluded: set[str] = field(default_factory=set)
    failovers: int = 0
    last_error: str = ""


@dataclass(slots=True)
class Run:
    """One request being driven: what the client has been sent so far survives failovers."""

    spec: RequestSpec
    epoch: int
    started: float
    output: list[int] = field(default_factory=list)
    held: str = ""
    """Output text not given to the clients yet: it may begin a stop string
    (`core.stops`); empty when the request has no stop strings."""
    first_token_at: float | None = None
    timings: dict[str, float] = field(default_factory=dict)
    lease_lost: bool = False
    cancelled: bool = False
    """This replica cancelled the run (its client left, or a Cancel). Checked at every chunk
    and watch step, so that a ``Task.cancel()`` lost on its way still ends the run."""
    stopped: errors.PdorchError | None = None
    """Why the run was cancelled when it was not for its client (the reaper failed the
    request past its state's deadline): what its clients are told, not "cancelled"."""
    journal: JournalBuffer = field(default_factory=JournalBuffer)
    usage: Usage = field(default_factory=Usage)
    attempts: Attempts = field(default_factory=Attempts)
    deliver: Hand = _nowhere
    """Fans a chunk out to the clients attached here (`orchestrator.control.sessions`)."""
    tap: Tap = field(default_factory=Tap)

    @property
    def rid(self) -> str:
        return self.spec.request_id

    @property
    def sent(self) -> int:
        """Tokens the clients were handed: ``output`` but those whose chunks wait for their
        journal write."""
        return len(self.output) - sum(len(c.token_ids) for c in self.journal.handing)

    def check(self) -> None:
        """Raise what the run's flags say: taken over by a peer, or cancelled here."""
        if self.lease_lost:
            raise errors.LeaseLostError(f"request {self.rid!r} taken over")
        if self.cancelled:
            raise asyncio.CancelledError(f"request {self.rid!r} cancelled")

    def cost(self, prices: Mapping[str, GpuProfile], usd_per_gb: float) -> dict[str, Any]:
        return self.usage.cost(prices, usd_per_gb, self.spec.tenant, self.rid)
