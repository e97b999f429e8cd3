"""Plain records shared by the store, control and rpc layers. Pure."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from json.encoder import encode_basestring_ascii
from typing import Any

from orchestrator.core.logprobs import TokenLogprob
from orchestrator.core.state import State


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """What a worker publishes in its heartbeat."""

    worker_id: str
    role: str
    """"prefill" or "decode" (every worker can also run a request aggregated)."""
    address: str
    """gRPC host:port."""
    kv_address: str
    """KV transport receiver host:port ("" for a pure prefill worker)."""
    transport: str
    """KV transport backend ("ucx", "tcp"): a decode worker's receiver's, a prefill worker's
    sender's; "" when unknown (placement pairs only workers that match, `scheduler`)."""
    model: str
    fingerprint: str
    max_context: int
    vocab_size: int
    kv_bytes_per_token: int
    kv_capacity_bytes: int
    kv_used_bytes: int = 0
    active: int = 0
    gpu_kind: str = "cpu"
    kv_dtype: str = ""
    """The engine's KV dtype (`transport.wire.DType` name, lower case: "float32") when its
    KV may be converted on the way to a decode worker; "" when it must travel as computed
    (the simulated engine's KV bits carry token ids). See `orchestrator.core.kvdtype`."""
    kv_blocks: int = 0
    """Blocks in the engine's own KV block pool (vLLM's); 0 for an engine without one."""
    kv_free_blocks: int = 0
    """Of those, the free ones now. Every request over, all are free again: what the chaos
    checker's leak check compares with the pool's size."""
    kv_block_size: int = 0
    """Tokens per block of the engine's prefix cache; 0: no prefix cache (reference and
    simulated engines), ``kv_prefix`` is then empty."""
    kv_prefix: str = ""
    """The blocks its prefix cache holds, as `orchestrator.core.prefix.encode_keys` (newest
    last, bounded by the worker): what KV-aware routing reads."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> WorkerInfo:
        return cls(**json.loads(text))

    @property
    def kv_free_bytes(self) -> int:
        return max(0, self.kv_capacity_bytes - self.kv_used_bytes)


@dataclass(slots=True)
class RequestRecord:
    """A request as stored. Timings are milliseconds."""

    request_id: str
    state: State
    epoch: int
    body_hash: str
    prompt_tokens: int
    max_tokens: int
    created_at: float
    owner: str = ""
    mode: str = ""
    placement: str = ""
    """Why the request runs in its mode (conditional disaggregation's reason, pool down)."""
    prefill_worker: str = ""
    decode_worker: str = ""
    output_tokens: int = 0
    kv_bytes: int = 0
    kv_dtype: str = ""
    """The KV's negotiated wire dtype and why (`orchestrator.core.kvdtype.KvChoice.label`)."""
    finish_reason: str = ""
    error: str = ""
    timings: dict[str, float] = field(default_factory=dict)
    prompt_ids: list[int] = field(default_factory=list)
    """What another orchestrator needs to resume the request after a takeover."""
    sampling: list[float] = field(default_factory=list)
    """`orchestrator.core.spec`'s sampling list: [temperature, top_p, seed], then the later
    parameters when any is set."""
    stop: list[str] = field(default_factory=list)
    tenant: str = ""
    cost: dict[str, Any] = field(default_factory=dict)
    """`orchestrator.core.cost.cost_fields`, set when the request ends."""
    updated_at: float = 0.0
    """Redis time (ms) of the last progress: a transition or a journalled chunk. Set by the
    store's scripts, read by the deadline reaper."""

    def to_fields(self) -> dict[str, str]:
        # Shallow (every field is a plain value, list or dict): `asdict` deep-copies the
        # prompt's ids one by one, on every request's creation.
        d: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        d["state"] = str(self.state)
        for name in ("timings", "prompt_ids", "sampling", "stop", "cost"):
            d[name] = json.dumps(d[name], sort_keys=True)
        return {k: str(v) for k, v in d.items()}

    @classmethod
    def from_fields(cls, f: dict[str, str]) -> RequestRecord:
        return cls(
            request_id=f["request_id"],
            state=State(f["state"]),
            epoch=int(f["epoch"]),
            body_hash=f["body_hash"],
            prompt_tokens=int(f["prompt_tokens"]),
            max_tokens=int(f["max_tokens"]),
            created_at=float(f["created_at"]),
            owner=f.get("owner", ""),
            mode=f.get("mode", ""),
            placement=f.get("placement", ""),
            prefill_worker=f.get("prefill_worker", ""),
            decode_worker=f.get("decode_worker", ""),
            output_tokens=int(f.get("output_tokens", "0")),
            kv_bytes=int(f.get("kv_bytes", "0")),
            kv_dtype=f.get("kv_dtype", ""),
            finish_reason=f.get("finish_reason", ""),
            error=f.get("error", ""),
            timings=json.loads(f.get("timings", "{}")),
            prompt_ids=json.loads(f.get("prompt_ids", "[]")),
            sampling=json.loads(f.get("sampling", "[]")),
            stop=json.loads(f.get("stop", "[]")),
            tenant=f.get("tenant", ""),
            cost=json.loads(f.get("cost", "{}")),
            updated_at=float(f.get("updated_at", "0")),
        )


@dataclass(frozen=True, slots=True)
class JournalEntry:
    """One relayed chunk of output, as journalled: tokens [index, index + len), and — for a
    request that asked for them — their log-probabilities and the prompt's (first chunk).

    JSON: ``[index, ids, text]``, with a fourth element ``{"logprobs": [...], "prompt":
    [...]}`` only when there are log-probabilities (so journals of requests without them
    are what they always were), ``"finish"`` in it on the request's last chunk and
    ``"held"`` when text waits."""

    index: int
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()
    """One per token, or none."""
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    finish: str = ""
    """The request's finish reason, on the chunk that ended it (a stop string, EOS, the
    length): a replica taking the request over before its end was recorded ends it so,
    rather than generating past it. An empty chunk carries it when the end came alone."""
    held: str = ""
    """Output text produced by this chunk's tokens and before, not given out yet: it may
    begin a stop string (`core.stops`). ``text`` is what the clients got; a replica taking
    the request over carries on from the last chunk's ``held``."""

    def to_json(self) -> str:
        if not (self.logprobs or self.prompt_logprobs or self.finish or self.held):
            # What `json.dumps` writes for [index, ids, text], without its machinery
            # (every relayed chunk is journalled: ~1 µs a chunk less). The same only for
            # int ids — as they are: a worker's chunk carries them as protobuf integers.
            ids = ", ".join(map(str, self.token_ids))
            return f"[{self.index}, [{ids}], {encode_basestring_ascii(self.text)}]"
        more: dict[str, Any] = {}
        if self.logprobs or self.prompt_logprobs:
            more["logprobs"] = [lp.to_json() for lp in self.logprobs]
            more["prompt"] = [lp.to_json() for lp in self.prompt_logprobs]
        if self.finish:
            more["finish"] = self.finish
        if self.held:
            more["held"] = self.held
        return json.dumps([self.index, list(self.token_ids), self.text, more])

    @classmethod
    def from_json(cls, text: str | bytes) -> JournalEntry:
        index, ids, delta, *extra = json.loads(text)
        more: dict[str, Any] = extra[0] if extra else {}
        return cls(
            int(index),
            tuple(int(i) for i in ids),
            str(delta),
            tuple(TokenLogprob.from_json(x) for x in more.get("logprobs", ())),
            tuple(TokenLogprob.from_json(x) for x in more.get("prompt", ())),
            str(more.get("finish", "")),
            str(more.get("held", "")),
        )


def unjournalled_after(entries: Sequence[JournalEntry], journal_end: int) -> int | None:
    """How many of ``entries`` (a writer's chunks, in order) the journal still lacks when
    it ends at ``journal_end`` tokens; None when that end is no chunk boundary of ours.

    Two ways the journal and its writer disagree: the store lost its last writes (a Redis
    restart inside the AOF fsync window: the end is behind) or a write landed whose reply the
    writer never saw (cancelled while awaiting it, connection dropped after the command ran:
    the end is ahead). Both resync the same way: write again from the journal's end.
    """
    for i, e in enumerate(entries):
        if e.index >= journal_end:
            return len(entries) - i if e.index == journal_end else None
    if entries and entries[-1].index + len(entries[-1].token_ids) == journal_end:
        return 0
    return None


def body_hash(payload: object) -> str:
    """Stable hash of a request body, for idempotent resubmission checks."""
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]
