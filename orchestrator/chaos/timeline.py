"""The timeline picture of a chaos run (PNG): requests as lanes, faults marked, recoveries.

Each request is a lane; each attempt (a Generate call) is a bar from its invoke to its end —
green when it completed, orange when the stream broke and the client resumed, red on a
definite error — with a tick per received chunk. Faults are vertical lines labelled with what
they hit; on every stream a fault affected, a purple bar runs from the fault to that stream's
next token: the recovery.
"""

from __future__ import annotations

from pathlib import Path

from orchestrator.chaos.checker import RunVerdict
from orchestrator.chaos.history import History

_COLOURS = {"ok": "#2e7d32", "info": "#ef6c00", "fail": "#c62828", "open": "#9e9e9e"}


def draw(history: History, verdict: RunVerdict, path: Path, *, title: str) -> Path:
    import matplotlib  # noqa: PLC0415 - heavy; only the chaos tool draws

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    rids = list(history.requests)
    lane = {rid: i for i, rid in enumerate(rids)}
    height = max(3.0, 0.28 * len(rids) + 1.6)
    fig, ax = plt.subplots(figsize=(12, height), dpi=100)
    end = max([history.end] + [op.t for op in history.ops] + [0.1])
    for rid in rids:
        y = lane[rid]
        start: float | None = None
        for op in history.of(rid):
            if op.type == "invoke":
                start = op.t
            elif op.type == "chunk":
                ax.plot([op.t, op.t], [y - 0.25, y + 0.25], color="#455a64", lw=0.5)
            elif op.type in {"ok", "info", "fail"} and start is not None:
                ax.plot([start, op.t], [y, y], color=_COLOURS[op.type], lw=3, solid_capstyle="butt")
                start = None
        if start is not None:  # never answered
            ax.plot([start, end], [y, y], color=_COLOURS["open"], lw=3)
    for fault in history.faults:
        ax.axvline(fault.at, color="#b71c1c", ls="--", lw=1)
        ax.text(fault.at, len(rids) - 0.3, f" {fault.label()}", color="#b71c1c", fontsize=8,
                rotation=90, va="top", ha="right")  # fmt: skip
        if fault.healed_at is not None:
            ax.axvspan(fault.at, fault.healed_at, color="#ffcdd2", alpha=0.35, lw=0)
    for label, rid, seconds in verdict.recoveries:
        fault_at = next((f.at for f in history.faults if f.label() == label), None)
        if fault_at is not None and rid in lane:
            ax.plot([fault_at, fault_at + seconds], [lane[rid] + 0.3] * 2, color="#6a1b9a", lw=2)
    ax.set_yticks(range(len(rids)))
    ax.set_yticklabels([rid.rsplit("-", 1)[-1] for rid in rids], fontsize=7)
    ax.set_ylim(-1, len(rids))
    ax.set_xlim(0, end * 1.02)
    ax.set_xlabel("seconds since the workload started")
    ax.set_ylabel("request (workload index)")
    ax.set_title(
        f"{title}: lost {sum(r.lost for r in verdict.requests)}, "
        f"duplicates {sum(r.duplicates for r in verdict.requests)}, "
        f"gaps {sum(r.gaps for r in verdict.requests)} — green completed, orange broke and "
        "resumed, red failed, purple recovery",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
