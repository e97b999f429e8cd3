"""A migration's report from its recorded samples: the summary, and Markdown or HTML. Pure
(the plots are `orchestrator.migrate.plots`; here they are file names to link).

Per path (existing, pdorch): requests, failures and error rate, TTFT/TPOT/total latency
percentiles, cost per request; output agreement over the shadow pairs; the rollbacks.

Cost per request: pdorch's is the mean of what its gateway priced each request at
(``usage.pdorch_cost_usd``: GPU-seconds per pool × the pools' prices). The existing
service's comes from the migration's pricing: ``usd_per_1k_tokens`` × (prompt + completion
tokens) / 1000 per request, or ``usd_per_hour`` × the hours between the first and last
sample / the requests it answered in them (a dedicated deployment's price spread over the
traffic the proxy saw), both when both are set.
"""

from __future__ import annotations

import html
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from orchestrator.migrate.policy import Sample, percentile

PATHS = ("existing", "pdorch")


@dataclass(frozen=True, slots=True)
class PathSummary:
    path: str
    requests: int
    answered: int
    """Requests whose answer the client got from this path."""
    shadow: int
    failures: int
    ttft_ms: tuple[float | None, float | None, float | None]
    """p50, p90, p99 (streamed requests that succeeded)."""
    tpot_ms: tuple[float | None, float | None, float | None]
    total_ms: tuple[float | None, float | None, float | None]
    cost_per_request_usd: float | None
    cost_basis: str

    @property
    def error_rate(self) -> float:
        return self.failures / self.requests if self.requests else 0.0


@dataclass(frozen=True, slots=True)
class AgreementSummary:
    pairs: int
    exact: int
    char_similarity: float | None
    token_similarity: float | None

    @property
    def exact_share(self) -> float:
        return self.exact / self.pairs if self.pairs else 0.0


@dataclass(frozen=True, slots=True)
class Summary:
    name: str
    mode: str
    percent: float
    generated_at: float
    span_s: float
    paths: tuple[PathSummary, ...]
    agreement: AgreementSummary
    rollbacks: tuple[dict[str, Any], ...]
    errors: tuple[tuple[str, str, int], ...]
    """(path, error, count), most frequent first."""


def _pcts(values: Sequence[float]) -> tuple[float | None, float | None, float | None]:
    return percentile(values, 50), percentile(values, 90), percentile(values, 99)


def summarize(
    name: str,
    config: dict[str, Any],
    samples: Sequence[Sample],
    rollbacks: Sequence[dict[str, Any]],
    now: float | None = None,
) -> Summary:
    span = max(s.ts for s in samples) - min(s.ts for s in samples) if samples else 0.0
    pricing = config.get("pricing") or {}
    paths = tuple(_path(p, [s for s in samples if s.path == p], pricing, span) for p in PATHS)
    pairs = [s for s in samples if s.role == "shadow" and s.match is not None]
    chars = [s.char_similarity for s in pairs if s.char_similarity is not None]
    words = [s.token_similarity for s in pairs if s.token_similarity is not None]
    agree = AgreementSummary(
        pairs=len(pairs),
        exact=sum(bool(s.match) for s in pairs),
        char_similarity=sum(chars) / len(chars) if chars else None,
        token_similarity=sum(words) / len(words) if words else None,
    )
    counts: dict[tuple[str, str], int] = {}
    for s in samples:
        if s.failed:
            counts[(s.path, s.error)] = counts.get((s.path, s.error), 0) + 1
    errs = tuple((p, e, n) for (p, e), n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
    return Summary(
        name=name,
        mode=str(config.get("mode", "")),
        percent=float(config.get("percent", 0.0)),
        generated_at=time.time() if now is None else now,
        span_s=span,
        paths=paths,
        agreement=agree,
        rollbacks=tuple(rollbacks),
        errors=errs[:10],
    )


def _path(
    path: str, samples: Sequence[Sample], pricing: dict[str, Any], span_s: float
) -> PathSummary:
    ok = [s for s in samples if not s.failed]
    cost: float | None = None
    basis = "not priced"
    if path == "pdorch":
        priced = [s.cost_usd for s in ok if s.cost_usd is not None]
        if priced:
            cost = sum(priced) / len(priced)
            basis = f"pdorch's own pricing ({len(priced)} requests)"
    else:
        per_1k = float(pricing.get("usd_per_1k_tokens", 0.0))
        per_hour = float(pricing.get("usd_per_hour", 0.0))
        parts = []
        cost = 0.0
        if per_1k and ok:
            tokens = sum(s.prompt_tokens + s.completion_tokens for s in ok) / len(ok)
            cost += per_1k * tokens / 1000
            parts.append(f"${per_1k:g}/1k tokens")
        answered = [s for s in ok if s.role == "answer"]
        if per_hour and answered and span_s > 0:
            cost += per_hour * span_s / 3600 / len(answered)
            parts.append(f"${per_hour:g}/h over {span_s:.0f} s")
        if parts:
            basis = " + ".join(parts)
        else:
            cost = None
    return PathSummary(
        path=path,
        requests=len(samples),
        answered=sum(s.role == "answer" for s in samples),
        shadow=sum(s.role == "shadow" for s in samples),
        failures=sum(s.failed for s in samples),
        ttft_ms=_pcts([s.ttft_ms for s in ok if s.ttft_ms is not None]),
        tpot_ms=_pcts([s.tpot_ms for s in ok if s.tpot_ms is not None]),
        total_ms=_pcts([s.total_ms for s in ok]),
        cost_per_request_usd=cost,
        cost_basis=basis,
    )


# ---------------------------------------------------------------------------- rendering


def _ms(v: float | None) -> str:
    return "—" if v is None else f"{v:.1f}"


def _usd(v: float | None) -> str:
    if v is None:
        return "—"
    # at least 3 significant digits: a cost that is not 0 never shows as $0.000000
    return f"${v:.6f}" if v == 0 or abs(v) >= 1e-4 else f"${v:.3g}"


def _pct(v: float | None) -> str:
    return "—" if v is None else f"{v:.1%}"


def tables(summary: Summary) -> list[tuple[str, list[str], list[list[str]]]]:
    """The report's tables: (title, header, rows)."""
    paths = summary.paths
    latency = [
        [f"{metric} p{q}"] + [_ms(getattr(p, attr)[i]) for p in paths]
        for metric, attr in (
            ("TTFT ms", "ttft_ms"),
            ("TPOT ms", "tpot_ms"),
            ("total ms", "total_ms"),
        )
        for i, q in enumerate((50, 90, 99))
    ]
    traffic = [
        ["requests"] + [str(p.requests) for p in paths],
        ["answered the client"] + [str(p.answered) for p in paths],
        ["shadow (mirrored)"] + [str(p.shadow) for p in paths],
        ["failures"] + [str(p.failures) for p in paths],
        ["error rate"] + [_pct(p.error_rate) for p in paths],
        ["cost per request"] + [_usd(p.cost_per_request_usd) for p in paths],
        ["cost basis"] + [p.cost_basis for p in paths],
    ]
    a = summary.agreement
    agree = [
        ["shadow pairs compared", str(a.pairs)],
        ["exact match", f"{a.exact} ({_pct(a.exact_share if a.pairs else None)})"],
        ["mean character similarity", _pct(a.char_similarity)],
        ["mean word similarity", _pct(a.token_similarity)],
    ]
    rollbacks = [
        [
            time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(float(r.get("ts", 0)))),
            f"{float(r.get('percent_before', 0)):g}% → 0%",
            str(r.get("reason", "")),
        ]
        for r in summary.rollbacks
    ]
    errs = [[p, e, str(n)] for p, e, n in summary.errors]
    names = [p.path for p in paths]
    return [
        ("Traffic, errors and cost", ["", *names], traffic),
        ("Latency", ["", *names], latency),
        ("Output agreement (shadow pairs)", ["", "value"], agree),
        ("Rollbacks", ["time (UTC)", "share", "reason"], rollbacks),
        ("Most frequent errors", ["path", "error", "count"], errs),
    ]


def _head(summary: Summary) -> str:
    return (
        f"mode {summary.mode}, pdorch share {summary.percent:g}%, "
        f"{sum(p.requests for p in summary.paths)} answers over {summary.span_s:.0f} s; "
        f"generated {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(summary.generated_at))}"
    )


NOTES = (
    "TTFT and TPOT come from streamed requests (time to the first text, then per output "
    "token after it); non-streamed ones count in total latency only. Failures: 5xx, 429, "
    "no answer, a broken stream. Agreement compares only shadow pairs where both answered; "
    "it means something for greedy or seeded requests."
)


def markdown(summary: Summary, plots: Sequence[tuple[str, str]]) -> str:
    """Markdown with the plots (``(title, file name)``) linked beside the report."""
    out = [f"# Migration report: {summary.name}", "", _head(summary), ""]
    for title, header, rows in tables(summary):
        out += [f"## {title}", ""]
        if not rows:
            out += ["none", ""]
            continue
        out.append("| " + " | ".join(header) + " |")
        out.append("|" + "---|" * len(header))
        out += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
        out.append("")
    out += ["## Plots", ""]
    out += [f"![{title}]({path})" for title, path in plots] or ["(none: no samples)"]
    out += ["", "## Notes", "", NOTES, ""]
    return "\n".join(out)


def html_page(summary: Summary, plots: Sequence[tuple[str, str]]) -> str:
    e = html.escape
    out = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>Migration report: {e(summary.name)}</title>",
        "<style>body{font-family:sans-serif;max-width:60em;margin:2em auto}"
        "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:.2em .6em}"
        "</style></head><body>",
        f"<h1>Migration report: {e(summary.name)}</h1><p>{e(_head(summary))}</p>",
    ]
    for title, header, rows in tables(summary):
        out.append(f"<h2>{e(title)}</h2>")
        if not rows:
            out.append("<p>none</p>")
            continue
        out.append("<table><tr>" + "".join(f"<th>{e(h)}</th>" for h in header) + "</tr>")
        out += ["<tr>" + "".join(f"<td>{e(c)}</td>" for c in row) + "</tr>" for row in rows]
        out.append("</table>")
    out.append("<h2>Plots</h2>")
    out += [f"<p><img src='{e(path)}' alt='{e(title)}'></p>" for title, path in plots]
    out += [f"<h2>Notes</h2><p>{e(NOTES)}</p></body></html>"]
    return "\n".join(out)
