"""`OutChunk`s → OpenAI response objects and server-sent events. Pure.

A `Tally` folds the chunks of one request (text, token counts, how it ended); a `Renderer`
turns a tally or a delta into the objects of the call's kind: ``text_completion`` and
``chat.completion`` whole, their ``*.chunk`` forms as events. A stream is
``data: {json}\\n\\n`` events ending in ``data: [DONE]``; a stream that fails after its
headers went out ends instead with one ``data: {"error": {...}}`` event and no ``[DONE]``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from orchestrator.control.orchestrator import OutChunk
from orchestrator.core.logprobs import TokenLogprob
from orchestrator.gateway.errors import ApiError, cancelled

FINISH_REASONS = {"stop": "stop", "eos": "stop", "length": "length"}
"""pdorch's finish reasons that end a request well → OpenAI's. A stop string and the model's
end-of-sequence token are both "stop" to OpenAI; anything else ended it badly."""

DONE = b"data: [DONE]\n\n"


def sse(obj: dict[str, Any]) -> bytes:
    """One server-sent event carrying ``obj`` as compact JSON."""
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


@dataclass(slots=True)
class Tally:
    """What one request produced so far, and how it ended (``finish``, OpenAI's words)."""

    request_id: str
    text: str = ""
    completion_tokens: int = 0
    prompt_tokens: int = 0
    finish: str = ""
    cost_usd: float | None = None
    """What the request cost (its record's ``cost.usd``), once it ended well."""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    offset: int = 0
    """Characters of the answer's text rendered so far (completions' ``text_offset``)."""

    def add(self, chunk: OutChunk) -> str:
        """Count a chunk; returns its text. A chunk that ends the request badly (cancelled)
        raises the `ApiError` to answer with."""
        self.completion_tokens += len(chunk.token_ids)
        self.text += chunk.text
        self.logprobs += chunk.logprobs
        self.prompt_logprobs += chunk.prompt_logprobs
        if chunk.prompt_tokens:
            self.prompt_tokens = chunk.prompt_tokens
        if chunk.finish_reason:
            finish = FINISH_REASONS.get(chunk.finish_reason)
            if finish is None:
                if chunk.finish_reason == "cancelled":
                    raise cancelled(self.request_id)
                raise ApiError(
                    500,
                    f"request {self.request_id!r} ended with {chunk.finish_reason!r}",
                    kind="server_error",
                    code="request_failed",
                )
            self.finish = finish
            if chunk.record is not None:
                self.prompt_tokens = chunk.record.prompt_tokens
                usd = chunk.record.cost.get("usd")
                if isinstance(usd, int | float):
                    self.cost_usd = float(usd)
        return chunk.text

    def usage(self) -> dict[str, Any]:
        """OpenAI's usage object, plus ``pdorch_cost_usd`` when the cost is known (an extra
        field: the official client keeps it, others ignore it; `pdorch migrate` reads it)."""
        out: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }
        if self.cost_usd is not None:
            out["pdorch_cost_usd"] = self.cost_usd
        return out


@dataclass(frozen=True, slots=True)
class Renderer:
    chat: bool
    model: str
    request_id: str
    created: int
    """Unix seconds, the same in every object of one response."""
    logprobs: bool = False
    """Render log probabilities (chat's ``logprobs``, completions' ``logprobs``)."""
    echo: str | None = None
    """Completions with ``echo``: the prompt's text ("" for token ids: the tokens' texts)."""
    continuous_usage: bool = False
    """Every streamed chunk carries the usage so far."""

    @property
    def id(self) -> str:
        return f"{'chatcmpl' if self.chat else 'cmpl'}-{self.request_id}"

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def whole(self, tally: Tally) -> dict[str, Any]:
        """The non-streamed response."""
        choice: dict[str, Any] = {"index": 0}
        prompt = tally.prompt_logprobs if self.echo is not None else []
        if self.chat:
            choice["message"] = {"role": "assistant", "content": tally.text, "refusal": None}
        else:
            choice["text"] = self._echoed(prompt) + tally.text
        choice |= {
            "logprobs": self._logprobs(tally, prompt, tally.logprobs),
            "finish_reason": tally.finish,
        }
        kind = "chat.completion" if self.chat else "text_completion"
        return self._head(kind) | {"choices": [choice], "usage": tally.usage()}

    def _echoed(self, prompt: list[TokenLogprob]) -> str:
        if self.echo is None:
            return ""
        return self.echo or "".join(lp.text for lp in prompt)

    def _logprobs(
        self, tally: Tally, prompt: list[TokenLogprob], tokens: list[TokenLogprob]
    ) -> dict[str, Any] | None:
        if not self.logprobs or not (prompt or tokens or self.chat):
            return None
        if self.chat:
            return {"content": [_chat_logprob(lp) for lp in tokens], "refusal": None}
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": []}
        offsets = []
        for lp in [*prompt, *tokens]:
            out["tokens"].append(lp.text)
            out["token_logprobs"].append(lp.logprob)
            out["top_logprobs"].append(_top_dict(lp))
            offsets.append(tally.offset)
            tally.offset += len(lp.text)
        return out | {"text_offset": offsets}

    def _chunk(
        self,
        text: str | None,
        finish: str | None,
        role: bool = False,
        logprobs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            delta: dict[str, str] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        choice |= {"logprobs": logprobs, "finish_reason": finish}
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return self._head(kind) | {"choices": [choice]}

    def _event(self, obj: dict[str, Any], tally: Tally) -> bytes:
        if self.continuous_usage:
            obj["usage"] = tally.usage()
        return sse(obj)

    def opening(self, tally: Tally) -> bytes | None:
        """The first event of a chat stream (the assistant's role, no text); none for text."""
        return self._event(self._chunk("", None, role=True), tally) if self.chat else None

    def delta(self, text: str, chunk: OutChunk, tally: Tally) -> bytes | None:
        """The event of one chunk (already added to ``tally``): its text and, when asked
        for, its tokens' log probabilities (a completion's echo: the prompt first). None
        when the chunk holds nothing to send."""
        prompt = list(chunk.prompt_logprobs) if self.echo is not None else []
        text = self._echoed(prompt) + text if prompt else text
        if not text and not (self.logprobs and (chunk.logprobs or prompt)):
            return None
        logprobs = self._logprobs(tally, prompt, list(chunk.logprobs))
        return self._event(self._chunk(text, None, logprobs=logprobs), tally)

    def closing(self, tally: Tally, include_usage: bool) -> bytes:
        """The events after the last text: the finish reason, usage if asked, ``[DONE]``."""
        events = [self._event(self._chunk(None if self.chat else "", tally.finish), tally)]
        if include_usage:
            kind = "chat.completion.chunk" if self.chat else "text_completion"
            events.append(sse(self._head(kind) | {"choices": [], "usage": tally.usage()}))
        events.append(DONE)
        return b"".join(events)


def _top_dict(lp: TokenLogprob) -> dict[str, float] | None:
    """Completions' ``top_logprobs`` entry: text -> log probability, the alternatives and
    the token itself (as vLLM answers); None where the token has none (the first prompt
    token)."""
    if lp.logprob is None:
        return None
    return {t.text: t.logprob for t in lp.top} | {lp.text: lp.logprob}


def _chat_logprob(lp: TokenLogprob) -> dict[str, Any]:
    def one(text: str, logprob: float | None) -> dict[str, Any]:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return one(lp.text, lp.logprob) | {"top_logprobs": [one(t.text, t.logprob) for t in lp.top]}


def error_event(error: ApiError) -> bytes:
    """The last event of a stream that failed after its headers were sent."""
    return sse(error.body())
