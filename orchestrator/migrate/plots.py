"""The report's plots (PNG, matplotlib's Agg backend): TTFT and TPOT distributions per path
as empirical CDFs, and latency over time with the rollbacks marked."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from orchestrator.migrate.policy import Sample
from orchestrator.migrate.report import PATHS

COLOURS = {"existing": "tab:blue", "pdorch": "tab:orange"}


def _cdf(ax: Any, samples: Sequence[Sample], attr: str, label: str) -> None:
    for path in PATHS:
        values = sorted(
            v for s in samples
            if s.path == path and not s.failed and (v := getattr(s, attr)) is not None
        )  # fmt: skip
        if values:
            ys = [(i + 1) / len(values) for i in range(len(values))]
            ax.step(values, ys, where="post", label=f"{path} (n={len(values)})",
                    color=COLOURS[path])  # fmt: skip
    ax.set_xlabel(label)
    ax.set_ylabel("share of requests ≤ x")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()


def draw(
    samples: Sequence[Sample], rollbacks: Sequence[dict[str, Any]], out_dir: Path, stem: str
) -> list[tuple[str, str]]:
    """Write the plots beside the report; returns (title, file name) for each."""
    import matplotlib  # noqa: PLC0415 - optional dependency, loaded only for a report

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    out: list[tuple[str, str]] = []
    for attr, title, label in (
        ("ttft_ms", "TTFT distribution", "TTFT (ms)"),
        ("tpot_ms", "TPOT distribution", "TPOT (ms per token)"),
    ):
        fig, ax = plt.subplots(figsize=(7, 4))
        _cdf(ax, samples, attr, label)
        ax.set_title(title)
        name = f"{stem}-{attr.split('_')[0]}.png"
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=90)
        plt.close(fig)
        out.append((title, name))
    fig, ax = plt.subplots(figsize=(9, 4))
    start = min((s.ts for s in samples), default=0.0)
    for path in PATHS:
        ok = [s for s in samples if s.path == path and not s.failed]
        bad = [s for s in samples if s.path == path and s.failed]
        ax.scatter([s.ts - start for s in ok], [s.total_ms for s in ok], s=10,
                   color=COLOURS[path], label=f"{path}")  # fmt: skip
        if bad:
            ax.scatter([s.ts - start for s in bad], [s.total_ms for s in bad], s=30,
                       marker="x", color="tab:red", label=f"{path} failed")  # fmt: skip
    for i, r in enumerate(rollbacks):
        ax.axvline(float(r.get("ts", start)) - start, color="tab:red", linestyle="--",
                   label="rollback" if i == 0 else None)  # fmt: skip
    ax.set_xlabel("seconds since the first sample")
    ax.set_ylabel("total latency (ms)")
    ax.set_title("Requests over time")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    name = f"{stem}-timeline.png"
    fig.tight_layout()
    fig.savefig(out_dir / name, dpi=90)
    plt.close(fig)
    out.append(("Requests over time", name))
    return out
