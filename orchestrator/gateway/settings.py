"""The gateway's settings: one frozen group, filled in by the CLI (the only env reader)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from orchestrator.core.models import MODEL_ALIASES


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    api_key: str = ""
    """When set, every ``/v1`` call needs ``Authorization: Bearer <api_key>`` (else 401);
    ``/health`` stays open for probes."""
    completion_max_tokens: int = 16
    """``max_tokens`` of a ``/v1/completions`` call that names none (OpenAI's default)."""
    chat_max_tokens: int = 512
    """``max_tokens`` of a chat call that names none. OpenAI's is "until the context is
    full"; a bound keeps one forgetful client from holding a decode slot for minutes."""
    max_body_bytes: int = 4 << 20
    """Larger request bodies are refused with 413 before they are parsed."""
    body_timeout_s: float = 30.0
    """A request's body must be in within this of its head (else 408): a body that never
    ends must not hold a connection and its buffer."""
    model_aliases: Mapping[str, str] = field(default_factory=lambda: dict(MODEL_ALIASES))
    """Other names a call may give a served model: alias -> the name the workers serve it
    under (their heartbeats'). A call naming an alias is served as that model and answered
    with its served name, as vLLM answers a call naming any of its ``--served-model-name``s
    with the first; ``/v1/models`` lists served names only. A served name always means
    itself, even where it is an alias too."""
