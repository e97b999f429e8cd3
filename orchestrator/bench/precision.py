"""`pdorch bench precision`: what converting the KV for the wire does to generated tokens.

Pure part: comparing two greedy generations of one prompt, summing a prompt set up, the
recommendation and the text report. The run itself (an engine, the conversion) is in
`orchestrator.bench.precision_run`.

**Definitions.** For each prompt the *reference* is the greedy generation with the prompt's
KV passed to decoding unchanged; the *candidate* is the same with the KV passed through the
conversion (exactly what a transfer in that dtype does). Both start from the same prefill, so
output token 0 is always shared.

- *first divergence*: the first output index where the two differ (a shorter sequence that is
  a prefix of the other diverges at its end); None when they are identical.
- *agreement*: tokens before the first divergence / the longer sequence's length. After a
  greedy generation diverges it continues from a different context, so later positions that
  happen to match say nothing; this is the share of the reference reproduced exactly.
- the set's *agreement* is the sum of the prompts' matched prefixes over the sum of their
  lengths (token-weighted); *disagreement* = 100% - agreement.
- *positional agreement* (reported, not decided on): the share of positions, up to the
  shorter length, where the tokens are equal.

**Recommendation.** A dtype is recommended only when disagreement <= 1%
(`MAX_DISAGREEMENT_PCT`); for fp8 this is the refusal the issue asks for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

MAX_DISAGREEMENT_PCT = 1.0


@dataclass(frozen=True, slots=True)
class PromptResult:
    prompt: str
    reference: tuple[int, ...]
    candidate: tuple[int, ...]

    @property
    def first_divergence(self) -> int | None:
        for i, (a, b) in enumerate(zip(self.reference, self.candidate, strict=False)):
            if a != b:
                return i
        if len(self.reference) != len(self.candidate):
            return min(len(self.reference), len(self.candidate))
        return None

    @property
    def length(self) -> int:
        return max(len(self.reference), len(self.candidate))

    @property
    def matched(self) -> int:
        d = self.first_divergence
        return self.length if d is None else d

    @property
    def positional_equal(self) -> int:
        return sum(a == b for a, b in zip(self.reference, self.candidate, strict=False))

    @property
    def shorter(self) -> int:
        return min(len(self.reference), len(self.candidate))

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt": self.prompt,
            "reference_tokens": len(self.reference),
            "candidate_tokens": len(self.candidate),
            "first_divergence": self.first_divergence,
            "agreement_pct": _pct(self.matched, self.length),
            "positional_agreement_pct": _pct(self.positional_equal, self.shorter),
        }


@dataclass(frozen=True, slots=True)
class PrecisionReport:
    model: str
    dtype: str
    max_tokens: int
    results: tuple[PromptResult, ...]
    kv_bytes_ratio: float
    """Wire bytes of the converted KV / bytes of the engine's KV (scales included)."""
    seconds: float = 0.0

    @property
    def agreement_pct(self) -> float:
        return _pct(sum(r.matched for r in self.results), sum(r.length for r in self.results))

    @property
    def disagreement_pct(self) -> float:
        return 100.0 - self.agreement_pct

    @property
    def positional_agreement_pct(self) -> float:
        equal = sum(r.positional_equal for r in self.results)
        return _pct(equal, sum(r.shorter for r in self.results))

    @property
    def identical_prompts(self) -> int:
        return sum(r.first_divergence is None for r in self.results)

    @property
    def recommended(self) -> bool:
        return self.disagreement_pct <= MAX_DISAGREEMENT_PCT

    @property
    def verdict(self) -> str:
        pct = f"{self.disagreement_pct:.2f}%"
        if self.recommended:
            return f"recommend {self.dtype}: disagreement {pct} <= {MAX_DISAGREEMENT_PCT}%"
        return f"do NOT use {self.dtype}: disagreement {pct} > {MAX_DISAGREEMENT_PCT}%"

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "dtype": self.dtype,
            "max_tokens": self.max_tokens,
            "prompts": len(self.results),
            "identical_prompts": self.identical_prompts,
            "agreement_pct": round(self.agreement_pct, 3),
            "disagreement_pct": round(self.disagreement_pct, 3),
            "positional_agreement_pct": round(self.positional_agreement_pct, 3),
            "threshold_pct": MAX_DISAGREEMENT_PCT,
            "recommended": self.recommended,
            "verdict": self.verdict,
            "kv_bytes_ratio": round(self.kv_bytes_ratio, 4),
            "seconds": round(self.seconds, 1),
            "per_prompt": [r.to_dict() for r in self.results],
        }


def render(report: PrecisionReport) -> str:
    """The human-readable report: one line per prompt, then the summary and the verdict."""
    lines = [
        f"KV precision: {report.model}, KV as {report.dtype} vs unchanged, greedy, "
        f"max {report.max_tokens} tokens, {len(report.results)} prompts",
        f"{'#':>3} {'tokens':>6} {'first div':>9} {'agree':>7}  prompt",
    ]
    for i, r in enumerate(report.results):
        div = "-" if r.first_divergence is None else str(r.first_divergence)
        lines.append(
            f"{i:>3} {r.length:>6} {div:>9} {_pct(r.matched, r.length):>6.1f}%  {r.prompt[:48]}"
        )
    lines += [
        f"identical: {report.identical_prompts}/{len(report.results)} prompts; "
        f"agreement {report.agreement_pct:.2f}% (positional {report.positional_agreement_pct:.2f}"
        f"%); KV bytes x{report.kv_bytes_ratio:.3f}",
        report.verdict,
    ]
    return "\n".join(lines)


def _pct(part: int, whole: int) -> float:
    return 100.0 if whole == 0 else 100.0 * part / whole


def prompts_from_text(text: str) -> list[str]:
    """One prompt per non-empty line; lines starting with ``#`` are comments."""
    return [s for line in text.splitlines() if (s := line.strip()) and not s.startswith("#")]


def summarize(
    model: str,
    dtype: str,
    max_tokens: int,
    results: Sequence[PromptResult],
    kv_bytes_ratio: float,
    seconds: float = 0.0,
) -> PrecisionReport:
    return PrecisionReport(model, dtype, max_tokens, tuple(results), kv_bytes_ratio, seconds)
