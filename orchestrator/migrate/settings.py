"""A migration's settings: grouped, frozen, validated. Pure.

Bad values raise `orchestrator.errors.ConfigError` naming the flag (``--percent``), so the
CLI prints one line instead of a traceback.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from orchestrator.errors import ConfigError

MODES = ("shadow", "canary")
NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
"""Migration names go into Redis keys: no colons, braces or spaces."""


@dataclass(frozen=True, slots=True)
class Limits:
    """When a canary rolls back: the pdorch path's statistics over its last ``window``
    requests, once it has ``min_samples`` of them. A limit of 0 is off."""

    max_error_rate: float = 0.05
    """Share of failed requests (5xx, 429, transport failure, an error mid-stream)."""
    max_ttft_p99_ms: float = 0.0
    """p99 time to first token, streamed requests only."""
    max_tpot_p99_ms: float = 0.0
    """p99 time per output token after the first, streamed requests only."""
    window: int = 100
    min_samples: int = 20

    def __post_init__(self) -> None:
        if not (0.0 <= self.max_error_rate <= 1.0):
            raise ConfigError("--max-error-rate", f"must be in [0, 1], got {self.max_error_rate}")
        for name, value in (
            ("--max-ttft-p99-ms", self.max_ttft_p99_ms),
            ("--max-tpot-p99-ms", self.max_tpot_p99_ms),
        ):
            if not (value >= 0 and math.isfinite(value)):
                raise ConfigError(name, f"must be >= 0 (0: off), got {value}")
        if self.window < 1:
            raise ConfigError("--window", f"must be >= 1, got {self.window}")
        if not (1 <= self.min_samples <= self.window):
            raise ConfigError(
                "--min-samples", f"must be in [1, --window={self.window}], got {self.min_samples}"
            )


@dataclass(frozen=True, slots=True)
class Pricing:
    """What the existing service costs. pdorch prices its own requests (``usage``).

    Two ways, both optional: ``usd_per_1k_tokens`` (a hosted API's price, prompt and output
    tokens alike), or ``usd_per_hour`` for a deployment you pay for by the hour, spread over
    the requests the proxy saw it answer (an upper bound when it also serves other traffic).
    """

    usd_per_1k_tokens: float = 0.0
    usd_per_hour: float = 0.0

    def __post_init__(self) -> None:
        for name, value in (
            ("--existing-usd-per-1k-tokens", self.usd_per_1k_tokens),
            ("--existing-usd-per-hour", self.usd_per_hour),
        ):
            if not (value >= 0 and math.isfinite(value)):
                raise ConfigError(name, f"must be >= 0, got {value}")


@dataclass(frozen=True, slots=True)
class Upstreams:
    existing: str
    """Base URL of the existing OpenAI-compatible service (``http://host:port``; a trailing
    ``/v1`` is dropped: the proxy forwards ``/v1/...`` paths as they came)."""
    pdorch: str
    """Base URL of pdorch's gateway."""
    pdorch_api_key: str = ""
    """Sent to pdorch instead of the client's key ("" forwards the client's)."""
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 300.0
    """Longest wait for the next bytes of an answer."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "existing", base_url(self.existing, "--existing"))
        object.__setattr__(self, "pdorch", base_url(self.pdorch, "--pdorch"))
        for name, value in (
            ("--connect-timeout", self.connect_timeout_s),
            ("--upstream-timeout", self.read_timeout_s),
        ):
            if not (value > 0 and math.isfinite(value)):
                raise ConfigError(name, f"must be > 0, got {value}")


@dataclass(frozen=True, slots=True)
class MigrationSettings:
    name: str
    mode: str
    upstreams: Upstreams
    percent: float = 0.0
    """canary: share of requests pdorch answers, in percent."""
    sample: float = 0.1
    """shadow: share of requests also sent to pdorch, in [0, 1]."""
    limits: Limits = field(default_factory=Limits)
    pricing: Pricing = field(default_factory=Pricing)
    shadow_concurrency: int = 8
    """Most shadow requests in flight; a sampled request beyond that is skipped (counted)."""
    max_samples: int = 10_000
    """Per-request samples kept in Redis (oldest trimmed)."""
    max_body_bytes: int = 4 << 20
    refresh_s: float = 1.0
    """How often the proxy re-reads mode and share from Redis (`pdorch migrate percent`)."""
    listen: str = "127.0.0.1:8090"
    """``HOST:PORT`` the proxy serves (`parse_listen`)."""
    drain_grace_s: float = 10.0
    """On SIGTERM: seconds answers in flight may finish before the proxy stops."""

    def __post_init__(self) -> None:
        check_name(self.name)
        if self.mode not in MODES:
            raise ConfigError("mode", f"must be one of {MODES}, got {self.mode!r}")
        if not (0.0 <= self.percent <= 100.0):
            raise ConfigError("--percent", f"must be in [0, 100], got {self.percent}")
        if not (0.0 <= self.sample <= 1.0):
            raise ConfigError("--sample", f"must be in [0, 1], got {self.sample}")
        if self.shadow_concurrency < 1:
            raise ConfigError("--shadow-concurrency", "must be >= 1")
        if self.max_samples < 10:
            raise ConfigError("--max-samples", "must be >= 10")


def check_name(name: str) -> str:
    if not NAME_RE.match(name):
        raise ConfigError("--name", f"1-64 letters, digits, '.', '_' or '-', got {name!r}")
    return name


def base_url(url: str, flag: str) -> str:
    """``http(s)://host[:port][/prefix]`` without a trailing ``/`` or ``/v1``."""
    url = url.strip().rstrip("/")
    if not re.match(r"^https?://[^/\s]+", url):
        raise ConfigError(flag, f"must be an http(s):// URL, got {url!r}")
    return url.removesuffix("/v1")


def parse_listen(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6) → (host, port)."""
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not (0 <= int(port) <= 65535):
        raise ConfigError("--listen", f"must be HOST:PORT, got {text!r}")
    return host, int(port)
