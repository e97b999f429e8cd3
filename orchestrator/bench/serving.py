"""`pdorch bench serving`, the pure part: the workload, per-request samples, their summary
per system, and the table. No sockets, no processes.

Every system is measured the same way, by one OpenAI-compatible streaming client
(`orchestrator.bench.openai_load`) sending ``POST /v1/completions`` with the prompt as
token ids, so every row counts the same tokens and the same HTTP hop:

* **TTFT**: from just before the request is sent to the first event carrying text;
* **TPOT**: (the last text event's arrival − the first's) / (completion tokens − 1), the
  tokens from the stream's closing usage object (servers may put several tokens in one
  event: pdorch's relay coalesces);
* **throughput**: output tokens of all requests / the level's wall time;
* **KV transfer**: per request, where the system reports it (pdorch: the request record's
  ``transfer_ms``; vLLM+NIXL: the mean of its ``nixl_xfer_time_seconds`` histogram — its
  per-request times are not exposed). Aggregated systems move no KV: none.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from orchestrator.bench.stats import percentile

SYSTEMS = ("vllm", "pdorch-agg", "pdorch-pd", "vllm-nixl")
"""The systems, in table order: (a) plain ``vllm serve``; (b) vLLM behind pdorch on one
aggregated worker; (c) pdorch P/D, vLLM on both pools; (d) vLLM's own disaggregation (its
NIXL connector, two ``vllm serve`` and a proxy)."""

LABELS = {
    "vllm": "vllm serve (no pdorch)",
    "pdorch-agg": "pdorch, 1 vLLM worker (aggregated)",
    "pdorch-pd": "pdorch P/D, vLLM 1 prefill + 1 decode",
    "vllm-nixl": "vLLM P/D: NixlConnector + proxy",
}


@dataclass(frozen=True, slots=True)
class Workload:
    requests: int = 64
    """Requests per concurrency level."""
    concurrency: tuple[int, ...] = (8,)
    """Closed-loop client slots; each level runs ``requests`` requests."""
    prompt_tokens: int = 256
    max_tokens: int = 64
    warmup: int = 2
    """Unmeasured requests before the first level (vLLM's first steps are slower)."""
    timeout_s: float = 600.0
    """Per request, the whole stream."""


@dataclass(slots=True)
class Sample:
    ok: bool
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    tokens: int = 0
    kv_transfer_ms: float | None = None
    error: str = ""


@dataclass(slots=True)
class Level:
    concurrency: int
    requests: int
    failed: int
    wall_s: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    tpot_p50_ms: float | None
    tpot_p99_ms: float | None
    tokens_per_s: float
    requests_per_s: float
    kv_transfer_ms: float | None
    """Median per request (or the system's mean, see the module doc); None: no KV moved."""
    errors: list[str] = field(default_factory=list)
    """The first few distinct errors."""


@dataclass(slots=True)
class Row:
    system: str
    levels: list[Level] = field(default_factory=list)
    not_run: str = ""
    """Why the system was not measured ("" when it was)."""
    kv_note: str = ""
    """How the KV transfer figure was obtained, when it is not per request."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "system": self.system,
            "label": LABELS.get(self.system, self.system),
            "not_run": self.not_run,
            "kv_note": self.kv_note,
            "levels": [_level_dict(lv) for lv in self.levels],
        }


def _level_dict(lv: Level) -> dict[str, Any]:
    return {
        "concurrency": lv.concurrency,
        "requests": lv.requests,
        "failed": lv.failed,
        "wall_s": round(lv.wall_s, 3),
        "ttft_p50_ms": _r(lv.ttft_p50_ms),
        "ttft_p99_ms": _r(lv.ttft_p99_ms),
        "tpot_p50_ms": _r(lv.tpot_p50_ms),
        "tpot_p99_ms": _r(lv.tpot_p99_ms),
        "tokens_per_s": round(lv.tokens_per_s, 2),
        "requests_per_s": round(lv.requests_per_s, 3),
        "kv_transfer_ms": _r(lv.kv_transfer_ms),
        "errors": lv.errors,
    }


def _r(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def _pct(values: Sequence[float], p: float) -> float | None:
    return percentile(values, p) if values else None


MAX_ERRORS = 3


def summarize(concurrency: int, samples: Sequence[Sample], wall_s: float) -> Level:
    """One level's figures from its samples; failed requests count in ``failed`` only."""
    good = [s for s in samples if s.ok]
    ttfts = [s.ttft_ms for s in good if s.ttft_ms is not None]
    tpots = [s.tpot_ms for s in good if s.tpot_ms is not None]
    kv = [s.kv_transfer_ms for s in good if s.kv_transfer_ms is not None]
    tokens = sum(s.tokens for s in good)
    errors: list[str] = []
    for s in samples:
        if not s.ok and s.error not in errors and len(errors) < MAX_ERRORS:
            errors.append(s.error)
    return Level(
        concurrency=concurrency,
        requests=len(samples),
        failed=len(samples) - len(good),
        wall_s=wall_s,
        ttft_p50_ms=_pct(ttfts, 50),
        ttft_p99_ms=_pct(ttfts, 99),
        tpot_p50_ms=_pct(tpots, 50),
        tpot_p99_ms=_pct(tpots, 99),
        tokens_per_s=tokens / wall_s if wall_s > 0 else 0.0,
        requests_per_s=len(good) / wall_s if wall_s > 0 else 0.0,
        kv_transfer_ms=_pct(kv, 50),
        errors=errors,
    )


def tpot(first_s: float, last_s: float, tokens: int) -> float | None:
    """Time per output token after the first, in ms (None for fewer than two tokens)."""
    return (last_s - first_s) * 1000 / (tokens - 1) if tokens > 1 else None


def prompt_ids(prefix: Sequence[int], body: Sequence[int], length: int) -> list[int]:
    """A prompt of exactly ``length`` token ids: ``prefix`` (distinct per request, so no
    system reuses another request's cached prefix), then ``body`` repeated."""
    if not body:
        raise ValueError("empty prompt body")
    ids = list(prefix[:length])
    while len(ids) < length:
        ids.extend(body[: length - len(ids)])
    return ids


def tpot_ratios(result: dict[str, Any]) -> dict[str, float]:
    """System → TPOT p50 at its highest concurrency / at its lowest (systems measured at
    two or more levels)."""
    out: dict[str, float] = {}
    for row in result["rows"]:
        levels = sorted(row["levels"], key=lambda lv: lv["concurrency"])
        if len(levels) >= 2 and levels[0]["tpot_p50_ms"] and levels[-1]["tpot_p50_ms"]:
            out[row["system"]] = levels[-1]["tpot_p50_ms"] / levels[0]["tpot_p50_ms"]
    return out


_HEAD = (
    f"{'system':<40} {'conc':>4} {'ok/req':>7} {'TTFT p50':>9} {'TTFT p99':>9} "
    f"{'TPOT p50':>9} {'TPOT p99':>9} {'tok/s':>7} {'req/s':>6} {'KV xfer':>8}"
)


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f}"


def format_table(result: dict[str, Any]) -> str:
    """The human table of a `run` result (milliseconds; KV xfer per request)."""
    w = result["workload"]
    conc = ",".join(str(c) for c in w["concurrency"])
    lines = [
        f"{w['requests']} requests per level, concurrency {conc}, {w['prompt_tokens']}-token "
        f"prompts, {w['max_tokens']} output tokens, greedy; model {result['model']}",
        _HEAD,
    ]
    notes: list[str] = []
    for row in result["rows"]:
        label = row["label"]
        if row["not_run"]:
            lines.append(f"{label:<40} not run: {row['not_run']}")
            continue
        for lv in row["levels"]:
            ok = f"{lv['requests'] - lv['failed']}/{lv['requests']}"
            lines.append(
                f"{label:<40} {lv['concurrency']:>4} {ok:>7} {_ms(lv['ttft_p50_ms']):>9} "
                f"{_ms(lv['ttft_p99_ms']):>9} {_ms(lv['tpot_p50_ms']):>9} "
                f"{_ms(lv['tpot_p99_ms']):>9} {lv['tokens_per_s']:>7.1f} "
                f"{lv['requests_per_s']:>6.2f} {_ms(lv['kv_transfer_ms']):>8}"
            )
            notes.extend(f"  {label}: {e}" for e in lv["errors"])
        if row["kv_note"]:
            notes.append(f"  {label}: KV xfer {row['kv_note']}")
    for system, ratio in tpot_ratios(result).items():
        notes.append(f"  {LABELS.get(system, system)}: TPOT at max / min concurrency {ratio:.2f}")
    if notes:
        lines += ["notes:", *notes]
    return "\n".join(lines)
