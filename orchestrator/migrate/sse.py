"""Reading OpenAI answers as they pass through the proxy: whole JSON bodies and server-sent
event streams. Pure (the caller passes the clock).

A `StreamReader` is fed the upstream's bytes as they arrive and returns the bytes to send on
to the client, event by event: every event passes unchanged except the usage-only chunk the
proxy asked for itself (``stream_options.include_usage``) when the client did not. Meanwhile
it notes the time of the first and last text, the text, the usage, an error event and
whether ``[DONE]`` came — what a `policy.Sample` needs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

MAX_EVENT_BYTES = 1 << 20
"""An event longer than this is passed on unread (and the stream counted as broken)."""


@dataclass(slots=True)
class Reading:
    """What an answer said."""

    text: str = ""
    first_text_at: float | None = None
    last_text_at: float | None = None
    deltas: int = 0
    prompt_tokens: int = 0
    completion_tokens: int | None = None
    cost_usd: float | None = None
    error: str = ""
    done: bool = False

    def timings(self, started: float) -> tuple[float | None, float | None]:
        """(TTFT, TPOT) in ms from the arrival time ``started``; None where unknown."""
        if self.first_text_at is None:
            return None, None
        ttft = (self.first_text_at - started) * 1000
        tokens = self.completion_tokens if self.completion_tokens is not None else self.deltas
        if tokens < 2 or self.last_text_at is None:
            return ttft, None
        return ttft, (self.last_text_at - self.first_text_at) * 1000 / (tokens - 1)

    def note_usage(self, usage: object) -> None:
        if not isinstance(usage, dict):
            return
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if isinstance(prompt, int):
            self.prompt_tokens = prompt
        if isinstance(completion, int):
            self.completion_tokens = completion
        cost = usage.get("pdorch_cost_usd")
        if isinstance(cost, int | float) and not isinstance(cost, bool):
            self.cost_usd = float(cost)


def choice_text(choice: object, *, delta: bool) -> str:
    """The text of one choice of a chat or text completion (whole or a stream chunk)."""
    if not isinstance(choice, dict):
        return ""
    if isinstance(choice.get("text"), str):
        return str(choice["text"])
    message = choice.get("delta" if delta else "message")
    if isinstance(message, dict) and isinstance(message.get("content"), str):
        return str(message["content"])
    return ""


def error_message(obj: object) -> str:
    if isinstance(obj, dict) and isinstance(obj.get("error"), dict):
        err = obj["error"]
        return str(err.get("message") or err.get("code") or "error")
    return ""


def read_whole(body: bytes, reading: Reading, at: float) -> Reading:
    """A non-streamed answer (a completion object, or an error object)."""
    try:
        obj: Any = json.loads(body)
    except ValueError:
        reading.error = reading.error or "the answer is not JSON"
        return reading
    reading.error = error_message(obj) or reading.error
    if isinstance(obj, dict):
        choices = obj.get("choices")
        if isinstance(choices, list) and choices:
            reading.text = choice_text(choices[0], delta=False)
            reading.first_text_at = reading.last_text_at = at
            reading.deltas = 1
        reading.note_usage(obj.get("usage"))
        reading.done = True
    return reading


class StreamReader:
    def __init__(self, strip_usage: bool) -> None:
        self.reading = Reading()
        self._strip_usage = strip_usage
        self._buffer = b""

    def feed(self, data: bytes, at: float) -> bytes:
        """Bytes received at ``at`` → the bytes to send on now (whole events only)."""
        self._buffer += data.replace(b"\r\n", b"\n")
        out = bytearray()
        while True:
            end = self._buffer.find(b"\n\n")
            if end < 0:
                if len(self._buffer) > MAX_EVENT_BYTES:
                    out += self._buffer
                    self._buffer = b""
                    self.reading.error = self.reading.error or "an event too long to read"
                break
            event, self._buffer = self._buffer[: end + 2], self._buffer[end + 2 :]
            if self._event(event, at):
                out += event
        return bytes(out)

    def close(self) -> bytes:
        """The end of the upstream's bytes: whatever is left, unread."""
        rest, self._buffer = self._buffer, b""
        if not self.reading.done and not self.reading.error:
            self.reading.error = "the stream ended without [DONE]"
        return rest

    def _event(self, event: bytes, at: float) -> bool:
        """Note one event; False to drop it."""
        data = b"\n".join(
            line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:")
        )
        if not data:
            return True  # a comment or keep-alive
        if data.strip() == b"[DONE]":
            self.reading.done = True
            return True
        try:
            obj: Any = json.loads(data)
        except ValueError:
            return True
        if not isinstance(obj, dict):
            return True
        message = error_message(obj)
        if message:
            self.reading.error = message
            return True
        choices = obj.get("choices")
        if obj.get("usage"):
            self.reading.note_usage(obj["usage"])
            if self._strip_usage and not choices:
                return False
        if isinstance(choices, list):
            for choice in choices[:1]:
                text = choice_text(choice, delta=True)
                if text:
                    self.reading.text += text
                    self.reading.deltas += 1
                    if self.reading.first_text_at is None:
                        self.reading.first_text_at = at
                    self.reading.last_text_at = at
        return True
