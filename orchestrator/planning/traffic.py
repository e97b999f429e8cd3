"""Traffic profiles and SLOs the planner plans for. Pure and deterministic.

Length distributions are never sampled: the planner reads their mean, a quantile, and a fixed
grid of quantiles (``quantile_grid``: the midpoints ``(k + 0.5) / n``) to take expectations
of non-linear costs such as prefill time, so the same input always gives the same plan.

Length specs (``parse_length``), as written on the command line or in a file:

* ``512`` or ``fixed:512`` — every request has 512 tokens;
* ``uniform:128:2048`` — uniform between 128 and 2048;
* ``lognormal:1024:4096`` — log-normal with median 1024 and 90th percentile 4096 (the usual
  shape of prompt lengths: most short, a long tail).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from statistics import NormalDist
from typing import Protocol

from orchestrator.errors import ConfigError

_Z90 = NormalDist().inv_cdf(0.9)


class LengthDist(Protocol):
    def mean(self) -> float: ...

    def quantile(self, q: float) -> float: ...

    def describe(self) -> str: ...

    def to_dict(self) -> dict[str, object]: ...


@dataclass(frozen=True, slots=True)
class Fixed:
    tokens: int

    def mean(self) -> float:
        return float(self.tokens)

    def quantile(self, q: float) -> float:
        return float(self.tokens)

    def describe(self) -> str:
        return f"{self.tokens}"

    def to_dict(self) -> dict[str, object]:
        return {"dist": "fixed", "tokens": self.tokens}


@dataclass(frozen=True, slots=True)
class Uniform:
    low: int
    high: int

    def mean(self) -> float:
        return (self.low + self.high) / 2

    def quantile(self, q: float) -> float:
        return self.low + q * (self.high - self.low)

    def describe(self) -> str:
        return f"uniform {self.low}-{self.high}"

    def to_dict(self) -> dict[str, object]:
        return {"dist": "uniform", "low": self.low, "high": self.high}


@dataclass(frozen=True, slots=True)
class LogNormal:
    median: int
    p90: int

    @property
    def sigma(self) -> float:
        return math.log(self.p90 / self.median) / _Z90

    def mean(self) -> float:
        return self.median * math.exp(self.sigma**2 / 2)

    def quantile(self, q: float) -> float:
        return self.median * math.exp(self.sigma * NormalDist().inv_cdf(q))

    def describe(self) -> str:
        return f"lognormal median {self.median}, p90 {self.p90}"

    def to_dict(self) -> dict[str, object]:
        return {"dist": "lognormal", "median": self.median, "p90": self.p90}


def tokens_at(dist: LengthDist, q: float) -> int:
    """The ``q`` quantile in whole tokens (at least 1)."""
    return max(1, round(dist.quantile(q)))


def quantile_grid(dist: LengthDist, points: int = 32) -> list[int]:
    """``points`` equally likely lengths: the quantiles at ``(k + 0.5) / points``."""
    return [tokens_at(dist, (k + 0.5) / points) for k in range(points)]


def _int(field: str, value: object) -> int:
    if isinstance(value, str):
        try:
            value = int(value)
        except ValueError:
            raise ConfigError(field, f"must be a whole number of tokens, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(field, f"must be a whole number of tokens >= 1, got {value!r}")
    return value


def _build(field: str, kind: str, args: list[object]) -> LengthDist:
    arity = {"fixed": 1, "uniform": 2, "lognormal": 2}
    if kind not in arity:
        raise ConfigError(field, f"unknown distribution {kind!r} (fixed, uniform, lognormal)")
    if len(args) != arity[kind]:
        raise ConfigError(field, f"{kind} takes {arity[kind]} number(s), got {len(args)}")
    values = [_int(field, a) for a in args]
    if kind == "fixed":
        return Fixed(values[0])
    if values[1] < values[0]:
        upper = "high" if kind == "uniform" else "p90"
        lower = "low" if kind == "uniform" else "median"
        raise ConfigError(field, f"{upper} ({values[1]}) is below {lower} ({values[0]})")
    return Uniform(values[0], values[1]) if kind == "uniform" else LogNormal(values[0], values[1])


_KEYS = {"fixed": ("tokens",), "uniform": ("low", "high"), "lognormal": ("median", "p90")}


def parse_length(spec: object, field: str) -> LengthDist:
    """A length distribution from a spec string, a number, or a table (``{dist = ..., ...}``)."""
    if isinstance(spec, int) and not isinstance(spec, bool):
        return Fixed(_int(field, spec))
    if isinstance(spec, str):
        parts = spec.strip().split(":")
        if len(parts) == 1:
            return Fixed(_int(field, parts[0]))
        return _build(field, parts[0].lower(), list(parts[1:]))
    if isinstance(spec, Mapping):
        kind = spec.get("dist")
        if not isinstance(kind, str) or kind not in _KEYS:
            raise ConfigError(f"{field}.dist", f"must be one of {', '.join(_KEYS)}, got {kind!r}")
        extra = set(spec) - {"dist", *_KEYS[kind]}
        if extra:
            raise ConfigError(f"{field}.{sorted(extra)[0]}", f"unknown key for {kind}")
        missing = [k for k in _KEYS[kind] if k not in spec]
        if missing:
            raise ConfigError(f"{field}.{missing[0]}", f"required for {kind}")
        return _build(field, kind, [spec[k] for k in _KEYS[kind]])
    raise ConfigError(
        field, f"must be a length spec such as 512 or lognormal:1024:4096, got {spec!r}"
    )


@dataclass(frozen=True, slots=True)
class Traffic:
    rate: float
    """Requests per second, Poisson arrivals."""
    prompt: LengthDist
    output: LengthDist
    """Generated tokens per request (the first comes from prefill, the rest from decode)."""

    def __post_init__(self) -> None:
        if not (self.rate > 0 and math.isfinite(self.rate)):
            raise ConfigError("traffic.rate", f"must be > 0 requests/s, got {self.rate!r}")
        if self.output.mean() < 2:
            raise ConfigError(
                "traffic.output", "must average at least 2 tokens (one from prefill, one decoded)"
            )


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_s: float
    """Time to first token, for a prompt at the ``percentile`` length."""
    tpot_s: float
    """Time per output token after the first (mean over a request's tokens)."""
    percentile: float = 0.9
    """Which prompt length the TTFT target applies to (0.9: the 90th percentile prompt)."""

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tpot_s"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ConfigError(f"slo.{name}", f"must be > 0 seconds, got {value!r}")
        if not 0 < self.percentile < 1:
            raise ConfigError("slo.percentile", f"must be in (0, 1), got {self.percentile!r}")
