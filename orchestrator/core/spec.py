"""A request as a client asks for it, and as it is driven: one frozen spec. Pure.

`GenerateInput` is what a front (rpc, gateway) hands the control plane: the prompt in one of
three shapes, untokenized. `RequestLimits.check` validates it — the one place where the
orchestrator's limits (``max_tokens``, stop strings, the request id) are enforced — and
`RequestLimits.check_prompt` checks the tokenized prompt against the model. What a request
id may be is `orchestrator.core.idents`'s rule (in UTF-8 bytes, the KV header's bound).

`RequestSpec` is the request once tokenized: what every attempt (and a replica that takes
the request over) runs. It is built from the input at intake (`RequestSpec.admitted`) and
from the stored record on resume (`RequestSpec.from_record`); both meet in the same fields,
and the record's sampling list and body hash are written by the spec alone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from orchestrator.core.idents import check_request_id, shown
from orchestrator.core.records import RequestRecord, WorkerInfo, body_hash
from orchestrator.core.sampling import SamplingParams
from orchestrator.core.state import INITIAL
from orchestrator.errors import InvalidRequestError

MAX_CHUNK_WINDOW_MS = 1000
"""The longest a token may be held back to share a message with later ones, whatever a
request or a replica asks (workers cap their coalescing window at it): a stream that sends
less than once a second looks hung to a client and to the orchestrator's silence watch."""


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
    deadline: float | None = None
    """``time.monotonic()`` after which no client can receive the answer (rpc: the call's
    deadline); a request not created by then is refused, never started."""
    chunk_window_ms: int = 0
    """The chunk window the client asks (`RequestSpec.chunk_window_ms`; 0: the replica's)."""


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What the orchestrator accepts (beyond the model's context, checked per model)."""

    max_tokens: int = 2048
    """Largest ``max_tokens`` a request may ask for."""
    max_stop_strings: int = 8
    max_stop_chars: int = 256
    """Longest stop string: the text held back while it may begin one (`core.stops`), and
    journalled with every chunk meanwhile, is at most this less one character."""

    def check(self, inp: GenerateInput) -> None:
        """Raise InvalidRequestError (naming the field) for the first invalid part of ``inp``."""
        if inp.request_id:  # empty: the orchestrator names the request
            check_request_id(inp.request_id)
        given = [p for p in (inp.text, inp.chat, inp.token_ids) if p is not None]
        if len(given) != 1:
            raise InvalidRequestError("prompt", "give exactly one of text, chat, tokens")
        if inp.text is not None and not inp.text.strip():
            raise InvalidRequestError("prompt", "empty")
        if inp.chat is not None and not inp.chat:
            raise InvalidRequestError("prompt", "no chat messages")
        if inp.token_ids is not None and not inp.token_ids:
            raise InvalidRequestError("prompt", "no token ids")
        if inp.max_tokens <= 0 or inp.max_tokens > self.max_tokens:
            raise InvalidRequestError(
                "max_tokens", f"must be in [1, {self.max_tokens}], got {shown(inp.max_tokens)}"
            )
        for name, message in inp.sampling.problems():
            raise InvalidRequestError(name, message)
        if inp.sampling.min_tokens > inp.max_tokens:
            raise InvalidRequestError(
                "min_tokens",
                f"{shown(inp.sampling.min_tokens)} exceeds max_tokens {inp.max_tokens}",
            )
        if not 0 <= inp.chunk_window_ms <= MAX_CHUNK_WINDOW_MS:
            raise InvalidRequestError(
                "chunk_window_ms",
                f"must be in [0, {MAX_CHUNK_WINDOW_MS}], got {inp.chunk_window_ms}",
            )
        self._check_stop(inp.stop)
        texts = [("prompt", inp.text or ""), ("stop", *inp.stop)]
        texts += [("prompt", role, content) for role, content in inp.chat or ()]
        for name, *parts in texts:
            if any(not _is_text(p) for p in parts):
                raise InvalidRequestError(name, "not valid Unicode (a lone surrogate)")

    def _check_stop(self, stop: tuple[str, ...]) -> None:
        if any(not x for x in stop):
            raise InvalidRequestError("stop", "a stop string may not be empty")
        if len(stop) > self.max_stop_strings:
            raise InvalidRequestError(
                "stop", f"at most {self.max_stop_strings} stop strings, got {len(stop)}"
            )
        longest = max(map(len, stop), default=0)
        if longest > self.max_stop_chars:
            raise InvalidRequestError(
                "stop", f"a stop string is at most {self.max_stop_chars} characters, got {longest}"
            )

    @staticmethod
    def check_vocab(ids: tuple[int, ...], model: WorkerInfo) -> None:
        """Token ids a client gave: each must be in the model's vocabulary."""
        bad = [t for t in ids if not 0 <= t < model.vocab_size]
        if bad:
            raise InvalidRequestError(
                "prompt", f"token id {bad[0]} outside the vocabulary of {model.vocab_size}"
            )

    @staticmethod
    def check_prompt(ids: tuple[int, ...], max_tokens: int, model: WorkerInfo) -> None:
        """The tokenized prompt: not empty, and with ``max_tokens`` within the model's context."""
        if not ids:
            raise InvalidRequestError("prompt", "tokenizes to nothing")
        if len(ids) + max_tokens > model.max_context:
            raise ContextExceededError(len(ids), max_tokens, model.max_context)


class ContextExceededError(InvalidRequestError):
    """`RequestLimits.check_prompt`'s refusal, with its numbers: a front may explain it in
    its own terms (the gateway, when ``max_tokens`` is its default, not the client's)."""

    def __init__(self, prompt_tokens: int, max_tokens: int, context: int) -> None:
        super().__init__(
            "prompt",
            f"{prompt_tokens} prompt tokens + max_tokens {max_tokens} exceed the model's "
            f"context of {context}",
        )
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.context = context


def _is_text(s: str) -> bool:
    """Whether ``s`` is text UTF-8 can carry (a front decoding JSON may hand over a lone
    surrogate, which no protobuf string or tokenizer accepts)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _sampling_list(p: SamplingParams) -> list[float]:
    """How a record stores sampling: [temperature, top_p, seed], followed — only when one of
    them is set, so that older records and their body hashes stay as they were — by [top_k,
    min_p, repetition_penalty, min_tokens, ignore_eos, logprobs, prompt_logprobs] (ignore_eos
    as 0/1, an unset count as -1)."""
    out: list[float] = [p.temperature, p.top_p, p.seed]
    later = _sampling_later(p)
    if later != _sampling_later(SamplingParams()):
        out += later
    return out


def _sampling_later(p: SamplingParams) -> list[float]:
    counts = [-1 if n is None else n for n in (p.logprobs, p.prompt_logprobs)]
    return [p.top_k, p.min_p, p.repetition_penalty, p.min_tokens, int(p.ignore_eos), *counts]


def _sampling_from_list(values: list[float]) -> SamplingParams:
    """The inverse of `_sampling_list` (a record without sampling: the defaults)."""
    if not values:
        return SamplingParams()
    temperature, top_p, seed, *later = values
    base = SamplingParams(float(temperature), float(top_p), int(seed))
    if not later:
        return base
    top_k, min_p, penalty, min_tokens, ignore_eos, logprobs, prompt_logprobs = later
    return SamplingParams(
        base.temperature,
        base.top_p,
        base.seed,
        top_k=int(top_k),
        min_p=float(min_p),
        repetition_penalty=float(penalty),
        min_tokens=int(min_tokens),
        ignore_eos=bool(ignore_eos),
        logprobs=None if logprobs < 0 else int(logprobs),
        prompt_logprobs=None if prompt_logprobs < 0 else int(prompt_logprobs),
    )


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """What to generate: the same for every attempt and every replica that drives it."""

    request_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    tenant: str = "default"
    chunk_window_ms: int = 0
    """How the client wants its tokens delivered, not what to generate: at most one chunk
    per this many milliseconds (0: the driving replica's ``stream_flush_ms``). Neither in
    the body hash nor in the record: a resubmission may ask another window, and a replica
    taking the request over streams at its own."""

    @classmethod
    def admitted(cls, inp: GenerateInput, request_id: str, ids: tuple[int, ...]) -> RequestSpec:
        """The spec of a validated input whose prompt tokenized to ``ids``."""
        return cls(
            request_id,
            ids,
            inp.max_tokens,
            inp.sampling,
            inp.stop,
            inp.tenant,
            chunk_window_ms=inp.chunk_window_ms,
        )

    @classmethod
    def from_record(cls, record: RequestRecord) -> RequestSpec:
        """The spec a record was created from (a takeover resumes from it)."""
        return cls(
            request_id=record.request_id,
            prompt=tuple(record.prompt_ids),
            max_tokens=record.max_tokens,
            sampling=_sampling_from_list(record.sampling),
            stop=tuple(record.stop),
            tenant=record.tenant or "default",
        )

    def body_hash(self) -> str:
        """What a resubmission must match to follow this request (tenant and id excluded)."""
        return body_hash(
            {
                "tokens": list(self.prompt),
                "max_tokens": self.max_tokens,
                "sampling": _sampling_list(self.sampling),
                "stop": list(self.stop),
            }
        )

    def record(self, owner: str, created_at: float | None = None) -> RequestRecord:
        """The record to create for this spec (queued, epoch 1)."""
        return RequestRecord(
            request_id=self.request_id,
            state=INITIAL,
            epoch=1,
            body_hash=self.body_hash(),
            prompt_tokens=len(self.prompt),
            max_tokens=self.max_tokens,
            created_at=time.time() if created_at is None else created_at,
            owner=owner,
            prompt_ids=list(self.prompt),
            sampling=_sampling_list(self.sampling),
            stop=list(self.stop),
            tenant=self.tenant,
        )
