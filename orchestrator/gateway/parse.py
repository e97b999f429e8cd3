"""OpenAI request bodies → `Call`: what to generate and how to answer. Pure.

Type and shape are checked here (a wrong one is a 400 naming the parameter); value ranges
that pdorch itself enforces (``max_tokens``, ``temperature``, ``top_p``, ``seed``, ``stop``)
are left to `control`'s validation, so there is one rule for gRPC and HTTP clients alike.

Honoured beyond OpenAI's own, as vLLM's OpenAI server takes them: ``top_k`` (0 or -1: off),
``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos`` — all part of pdorch's seeded
sampling (`orchestrator.core.sampling`) — and ``stream_options.continuous_usage_stats``.
Log probabilities: chat's ``logprobs``/``top_logprobs``, completions' ``logprobs`` (0-20
alternatives) and ``echo`` (the prompt, and with ``logprobs`` the prompt's log
probabilities: what log-likelihood evaluations read).

What pdorch cannot honour is refused, not ignored: ``n`` or ``best_of`` above 1, batched
prompts, ``suffix``, ``echo`` on chat, ``presence_penalty``/``frequency_penalty``,
``logit_bias``, tools and structured output, and vLLM's other extensions unless neutral
(`_VLLM_NEUTRAL`: guided decoding, beam search, ``stop_token_ids``, prompt truncation, ...).
Parameters that change nothing here
(``metadata``, ``store``, ``service_tier``, ...) are accepted and ignored, as
OpenAI-compatible servers do. The tenant
billed (and held to its limits) is the ``x-pdorch-tenant`` header, else the body's ``user``,
else "default".

Defaults follow OpenAI: ``temperature`` 1, ``top_p`` 1. ``max_tokens`` defaults to
`GatewaySettings`' (a call that names none and does not fit the context is refused saying
so, and how much room the prompt leaves: `Call.explained`). A call without ``seed`` gets one
derived from its request id, so a retry under the same ``Idempotency-Key`` is the same
request (pdorch refuses a reused id with a different body) and different calls differ.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from orchestrator.control.orchestrator import GenerateInput
from orchestrator.core.idents import ECHO_CHARS, check_request_id, check_tenant, shown
from orchestrator.core.sampling import SamplingParams
from orchestrator.core.spec import MAX_CHUNK_WINDOW_MS, ContextExceededError
from orchestrator.errors import InvalidRequestError, PdorchError
from orchestrator.gateway.errors import ApiError
from orchestrator.gateway.settings import GatewaySettings

REQUEST_ID_HEADERS = ("idempotency-key", "x-request-id")
"""Headers naming pdorch's request id, first found wins: a retry with the same id follows
(or resumes) the request already running instead of starting another."""

_CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


@dataclass(frozen=True, slots=True)
class Call:
    """One generation call, parsed."""

    chat: bool
    model: str
    inp: GenerateInput
    stream: bool
    include_usage: bool
    """Streaming only: send a last chunk with token usage (``stream_options``)."""
    continuous_usage: bool = False
    """Streaming only: every chunk carries the usage so far
    (``stream_options.continuous_usage_stats``)."""
    echo: bool = False
    """Completions: the answer starts with the prompt (and its log probabilities, when
    ``logprobs`` is set)."""
    max_tokens_param: str = "max_tokens"
    """The parameter the output's length came from (chat: ``max_completion_tokens``, when
    given, as OpenAI names it now)."""
    max_tokens_default: bool = False
    """The client named no ``max_tokens``: the call asks the gateway's default."""

    @property
    def logprobs(self) -> bool:
        return self.inp.sampling.logprobs is not None

    @property
    def params(self) -> dict[str, str]:
        """Orchestrator field names → this call's parameter names, for error messages."""
        prompt = "messages" if self.chat else "prompt"
        names = {
            "prompt": prompt,
            "request_id": REQUEST_ID_HEADERS[0],
            "max_tokens": self.max_tokens_param,
        }
        if self.chat:
            names["logprobs"] = "top_logprobs"
        return names | {"prompt_logprobs": "logprobs"}

    def explained(self, exc: PdorchError) -> PdorchError:
        """``exc`` in this call's terms, for `errors.api_error_for`. A prompt too long for
        the context with the gateway's default ``max_tokens`` says that the client sent
        none, and what it may send instead (the orchestrator's own message cites a
        ``max_tokens`` the client never wrote)."""
        if not (self.max_tokens_default and isinstance(exc, ContextExceededError)):
            return exc
        room, kind = exc.context - exc.prompt_tokens, "chat" if self.chat else "completions"
        if room < 1:
            message = (
                f"{exc.prompt_tokens} prompt tokens leave no room for output in the model's "
                f"context of {exc.context}"
            )
        else:
            names = "max_completion_tokens (or max_tokens)" if self.chat else "max_tokens"
            message = (
                f"{exc.prompt_tokens} prompt tokens leave {room} of the model's context of "
                f"{exc.context} for output, less than this gateway's default max_tokens "
                f"{exc.max_tokens} for a {kind} call that sends none: send {names} of at "
                f"most {room}"
            )
        return InvalidRequestError(exc.field, message)


def request_id(headers: Mapping[str, str]) -> str:
    """The client's request id from `REQUEST_ID_HEADERS` (UTF-8, by `idents`' rule: a 400
    naming the header otherwise), else a fresh one."""
    for name in REQUEST_ID_HEADERS:
        value = header(headers, name).strip()
        if value:
            try:
                check_request_id(value, name)
            except InvalidRequestError as exc:
                raise ApiError(400, str(exc), param=name) from None
            return value
    return uuid.uuid4().hex


def header(headers: Mapping[str, str], name: str) -> str:
    """A header's value as UTF-8 text. HTTP servers hand headers over as Latin-1 (every byte
    one character); decoding their bytes as UTF-8 makes the same bytes the same text as a
    gRPC string. Not UTF-8: a 400 naming the header."""
    raw = headers.get(name, "")
    try:
        return raw.encode("latin-1").decode("utf-8")
    except UnicodeError:
        raise ApiError(400, f"{name} is not valid UTF-8", param=name) from None


def header_value(text: str) -> str:
    """``text`` (valid by `idents`' rules) as a response header: its UTF-8 bytes, which the
    HTTP server writes as Latin-1 — the inverse of `header`."""
    return text.encode("utf-8").decode("latin-1")


TENANT_HEADER = "x-pdorch-tenant"


def tenant(headers: Mapping[str, str], body: Mapping[str, Any]) -> str:
    """Who is billed: the ``x-pdorch-tenant`` header, else ``user``, else "default"."""
    given: object = header(headers, TENANT_HEADER) if TENANT_HEADER in headers else None
    where = TENANT_HEADER
    if given is None:
        given, where = body.get("user"), "user"
    if given is None:
        return "default"
    if not isinstance(given, str):
        raise ApiError(400, f"{where} must be a string", param=where)
    try:
        return check_tenant(given, where)
    except InvalidRequestError as exc:
        raise ApiError(400, str(exc), param=where) from None


MAX_JSON_DEPTH = 32
"""How deeply a request body may nest (an OpenAI body nests 4 levels; a tool's JSON schema,
refused anyway, a few more)."""


def check_json(body: object) -> None:
    """What `json.loads` lets through but nothing downstream may see: nesting deeper than
    `MAX_JSON_DEPTH`, and strings (or keys) with a lone surrogate (``"\\ud800"``: JSON may
    escape one; it is no text, and encoding it fails). A 400 naming where, never a 500.
    Iterative: a body is at most a few MiB, each value visited once."""
    stack: list[tuple[object, str, int]] = [(body, "", 0)]
    while stack:
        value, where, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise ApiError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(value, str):
            _check_text(value, where or "body")
        elif isinstance(value, list):
            stack.extend((v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value))
        elif isinstance(value, dict):
            for key, v in value.items():
                name = f"{where}.{_part(key)}" if where else _part(key)
                _check_text(key, f"the key {name}")
                stack.append((v, name, depth + 1))


def _part(key: str) -> str:
    """A key as part of a parameter's path in an error: itself, or `shown` if long or odd."""
    return key if len(key) <= ECHO_CHARS and key.isprintable() else shown(key)


def _check_text(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ApiError(
            400,
            f"{where} is not valid Unicode: a lone surrogate at character {exc.start}",
            param=where.removeprefix("the key "),
        ) from None


def seed_for(request_id: str) -> int:
    """A seed in [0, 2^63) that depends on the request id only."""
    return int.from_bytes(hashlib.sha256(request_id.encode()).digest()[:8], "big") >> 1


def parse_completion(body: Mapping[str, Any], rid: str, settings: GatewaySettings) -> Call:
    """``POST /v1/completions``."""
    _refuse_unsupported(body, chat=False)
    prompt = body.get("prompt")
    text: str | None = None
    tokens: tuple[int, ...] | None = None
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        text = prompt
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        tokens = tuple(prompt)
    elif (
        isinstance(prompt, list)
        and len(prompt) > 1
        and all(isinstance(p, str | list) for p in prompt)
    ):
        raise ApiError(400, "batched prompts are not supported: send one per call", param="prompt")
    elif isinstance(prompt, list) and prompt:
        i, bad = next((i, t) for i, t in enumerate(prompt) if not _is_int(t))
        raise ApiError(
            400,
            f"prompt[{i}] is {shown(bad)} ({type(bad).__name__}): a list prompt is token ids, "
            "integers (a batch of prompts is not supported)",
            param="prompt",
        )
    else:
        raise ApiError(
            400, "prompt must be a string or a list of token ids (non-empty)", param="prompt"
        )
    max_tokens = _int_or_none(body, "max_tokens")
    logprobs = _int_or_none(body, "logprobs")
    echo = _bool(body, "echo", default=False)
    sampling = replace(
        _sampling(body, rid),
        logprobs=logprobs,
        # The echoed prompt's tokens (texts, and log probabilities when asked for).
        prompt_logprobs=(logprobs or 0) if echo else None,
    )
    call = _call(
        body,
        rid,
        chat=False,
        inp=GenerateInput(
            request_id=rid,
            text=text,
            token_ids=tokens,
            max_tokens=settings.completion_max_tokens if max_tokens is None else max_tokens,
            sampling=sampling,
            stop=_stop(body),
        ),
    )
    return replace(call, echo=echo, max_tokens_default=max_tokens is None)


def parse_chat(body: Mapping[str, Any], rid: str, settings: GatewaySettings) -> Call:
    """``POST /v1/chat/completions``."""
    _refuse_unsupported(body, chat=True)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", param="messages")
    chat = tuple(_message(m, i) for i, m in enumerate(messages))
    param = "max_completion_tokens"
    max_tokens = _int_or_none(body, param)
    if max_tokens is None:
        param = "max_tokens"
        max_tokens = _int_or_none(body, param)
    top = _int_or_none(body, "top_logprobs")
    if top is not None and not _bool(body, "logprobs", default=False):
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    logprobs = (top or 0) if _bool(body, "logprobs", default=False) else None
    call = _call(
        body,
        rid,
        chat=True,
        inp=GenerateInput(
            request_id=rid,
            chat=chat,
            max_tokens=settings.chat_max_tokens if max_tokens is None else max_tokens,
            sampling=replace(_sampling(body, rid), logprobs=logprobs),
            stop=_stop(body),
        ),
    )
    return replace(call, max_tokens_param=param, max_tokens_default=max_tokens is None)


# ----------------------------------------------------------------------------- parts


def _call(body: Mapping[str, Any], rid: str, *, chat: bool, inp: GenerateInput) -> Call:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "model must be a non-empty string", param="model")
    stream = _bool(body, "stream", default=False)
    options = body.get("stream_options")
    include_usage = continuous = False
    if options is not None:
        if not stream:
            raise ApiError(400, "stream_options needs stream: true", param="stream_options")
        if not isinstance(options, dict):
            raise ApiError(400, "stream_options must be an object", param="stream_options")
        include_usage = _bool(options, "include_usage", default=False, param="stream_options")
        continuous = _bool(
            options,
            "continuous_usage_stats",
            default=False,
            param="stream_options.continuous_usage_stats",
        )
    return Call(
        chat=chat,
        model=model,
        # A non-streamed answer is read only at its end: its tokens travel in the fewest
        # messages (the longest chunk window), each costing the orchestrator a read, a
        # journal write and a hand-off whatever it carries.
        inp=inp if stream else replace(inp, chunk_window_ms=MAX_CHUNK_WINDOW_MS),
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous,
    )


def _message(m: object, i: int) -> tuple[str, str]:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise ApiError(400, f"{where} must be an object", param=where)
    role = m.get("role")
    if not isinstance(role, str) or role not in _CHAT_ROLES:
        raise ApiError(
            400,
            f"{where}.role {shown(role)} is not supported (system, developer, user, assistant)",
            param=f"{where}.role",
        )
    if m.get("tool_calls") or m.get("function_call"):
        raise ApiError(400, "tool calls are not supported", param=f"{where}.tool_calls")
    return _CHAT_ROLES[role], _content(m.get("content"), f"{where}.content")


def _content(content: object, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise ApiError(400, "only text content parts are supported", param=where)
            text = part.get("text")
            if not isinstance(text, str):
                raise ApiError(400, "a text part needs a string 'text'", param=where)
            texts.append(text)
        return "".join(texts)
    raise ApiError(400, "content must be a string or a list of text parts", param=where)


def _sampling(body: Mapping[str, Any], rid: str) -> SamplingParams:
    temperature = _number_or_none(body, "temperature")
    top_p = _number_or_none(body, "top_p")
    seed = _int_or_none(body, "seed")
    top_k = _int_or_none(body, "top_k")
    min_p = _number_or_none(body, "min_p")
    penalty = _number_or_none(body, "repetition_penalty")
    min_tokens = _int_or_none(body, "min_tokens")
    return SamplingParams(
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        seed=seed_for(rid) if seed is None else seed,
        top_k=0 if top_k is None or top_k == -1 else top_k,  # vLLM's -1: no limit
        min_p=0.0 if min_p is None else min_p,
        repetition_penalty=1.0 if penalty is None else penalty,
        min_tokens=0 if min_tokens is None else min_tokens,
        ignore_eos=_bool(body, "ignore_eos", default=False),
    )


def _stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return tuple(stop)
    raise ApiError(400, "stop must be a string or a list of strings", param="stop")


_VLLM_NEUTRAL: dict[str, tuple[object, ...]] = {
    # Structured output, vLLM's and its older names.
    "structured_outputs": (),
    "guided_choice": (),
    "guided_json": (),
    "guided_regex": (),
    "guided_grammar": (),
    "guided_decoding_backend": (),
    "guided_whitespace_pattern": (),
    # Sampling and stopping pdorch's draw does not do.
    "use_beam_search": (False,),
    "length_penalty": (1, 1.0),
    "stop_token_ids": ([],),
    "bad_words": ([],),
    "allowed_token_ids": (),
    "logits_processors": (),
    "repetition_detection": (),
    "watermarking": (),
    "vllm_xargs": (),
    # The prompt as pdorch tokenizes it: whole, never with added special tokens, chat with
    # the model's template and its generation prompt.
    "truncate_prompt_tokens": (),
    "add_special_tokens": (False,),
    "add_generation_prompt": (True,),
    "continue_final_message": (False,),
    "chat_template": (),
    "chat_template_kwargs": ({},),
    "documents": (),
    "prompt_embeds": (),
    # The answer as pdorch renders it: text without special tokens, stop strings cut.
    "include_stop_str_in_output": (False,),
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
    "prompt_logprobs": (),  # completions' echo + logprobs is pdorch's
    "logprob_token_ids": (),
    "return_tokens_as_token_ids": (False,),
    "return_token_ids": (False,),
    "return_token_offsets": (False,),
    "return_prompt_text": (False,),
    # Scheduling, caching and KV movement are pdorch's own.
    "priority": (0,),
    "cache_salt": (),
    "kv_transfer_params": (),
    "ec_transfer_params": (),
}
"""vLLM's extensions to OpenAI's bodies that pdorch does not honour, with their neutral
values (none: any value is refused). Those it does honour are read by `_sampling` and
`_call`; the rest of vLLM's (``request_id``, ``stream_interval``, ...) change no output."""


def _refuse_unsupported(body: Mapping[str, Any], *, chat: bool) -> None:
    """A parameter pdorch cannot honour, set to anything but a neutral value, is a 400."""
    for name in ("n", "best_of"):
        value = body.get(name)
        if value is not None and not (_is_int(value) and value == 1):
            raise ApiError(400, f"{name} must be 1: pdorch returns one choice", param=name)
    neutral: dict[str, tuple[object, ...]] = {
        "suffix": ("",),
        "presence_penalty": (0, 0.0),
        "frequency_penalty": (0, 0.0),
        "logit_bias": ({},),
        "tools": ([],),
        "functions": ([],),
        "tool_choice": ("none", "auto"),
        "function_call": ("none", "auto"),
        "response_format": ({"type": "text"},),
        "audio": (),
        "prediction": (),
    }
    if chat:
        neutral["echo"] = (False,)
    else:  # chat's parameter; completions' alternatives are ``logprobs``
        neutral["top_logprobs"] = (0,)
    for name, allowed in (neutral | _VLLM_NEUTRAL).items():
        value = body.get(name)
        # Same type too: ``True == 1`` and ``0 == False`` must not pass for each other.
        if value is not None and not any(type(value) is type(a) and value == a for a in allowed):
            raise ApiError(400, f"{name} is not supported", param=name)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _int_or_none(body: Mapping[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value):
        raise ApiError(400, f"{name} must be an integer", param=name)
    return int(value)


def _number_or_none(body: Mapping[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_number(value):
        raise ApiError(400, f"{name} must be a number", param=name)
    try:
        return float(value)
    except OverflowError:  # an integer past a float's range (JSON has no size limit)
        raise ApiError(400, f"{name} is out of range", param=name) from None


def _bool(body: Mapping[str, Any], name: str, *, default: bool, param: str = "") -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(400, f"{name} must be true or false", param=param or name)
    return value
