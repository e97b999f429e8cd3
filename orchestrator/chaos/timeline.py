"""The timeline picture of a chaos run (PNG): requests as lanes, faults marked, recoveries.

Each request is a lane; each attempt (a Generate call) is a bar from its invoke to its end —
green when it completed, orange when the stream broke and the client resumed, red on a
definite error, grey when it never ended — with a short tick above the bar per received
chunk. Faults are dashed vertical lines, labelled above the plot; a pale red band runs from
a fault to the moment it was healed (the killed worker back, the Redis restarted), cut at the
right edge when that came after the workload ended. On every stream a fault affected, a
purple bar runs from the fault to that stream's next token: the recovery.

`layout` decides what is drawn (pure, tested); `draw` draws it with matplotlib.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from orchestrator.chaos.checker import RunVerdict
from orchestrator.chaos.history import History

_COLOURS = {"ok": "#2e7d32", "info": "#ef6c00", "fail": "#c62828", "open": "#9e9e9e"}
_LEGEND = {
    "ok": "attempt completed",
    "info": "stream broke, client resumed",
    "fail": "attempt failed",
    "open": "never ended",
    "fault": "fault until healed",
    "recovery": "recovery (fault to next token)",
}
_FAULT = "#b71c1c"
_BAND = "#ffcdd2"
_RECOVERY = "#6a1b9a"
_MARGIN = 0.03
"""Of the workload's span, on the right of the last event."""


@dataclass(frozen=True, slots=True)
class Bar:
    lane: int
    start: float
    end: float
    kind: str
    """ok | info | fail | open"""


@dataclass(frozen=True, slots=True)
class FaultMark:
    at: float
    label: str
    band_end: float | None
    """Where the healing band ends (clipped to the plot); None: not healed."""
    healed_later: bool
    """Healed after the workload ended (the band runs off the right edge)."""


@dataclass(frozen=True, slots=True)
class Layout:
    lanes: list[str]
    bars: list[Bar]
    chunks: list[tuple[int, float]]
    faults: list[FaultMark]
    recoveries: list[tuple[int, float, float]]
    """(lane, fault time, seconds to the next token)."""
    x_max: float
    legend: list[str]
    """Keys of `_LEGEND` for what is actually drawn, in its order."""


def layout(history: History, verdict: RunVerdict) -> Layout:
    """What to draw: the x-axis spans the workload (its requests' events and the faults),
    not the healing of a fault after it, so the requests fill the plot."""
    rids = list(history.requests)
    lane = {rid: i for i, rid in enumerate(rids)}
    last = max([op.t for op in history.ops] + [f.at for f in history.faults] + [0.1])
    x_max = last * (1 + _MARGIN)
    bars: list[Bar] = []
    chunks: list[tuple[int, float]] = []
    for rid in rids:
        start: float | None = None
        for op in history.of(rid):
            if op.type == "invoke":
                start = op.t
            elif op.type == "chunk":
                chunks.append((lane[rid], op.t))
            elif op.type in {"ok", "info", "fail"} and start is not None:
                bars.append(Bar(lane[rid], start, op.t, op.type))
                start = None
        if start is not None:
            bars.append(Bar(lane[rid], start, last, "open"))
    faults = [
        FaultMark(
            at=f.at,
            label=f.label(),
            band_end=None if f.healed_at is None else min(f.healed_at, x_max),
            healed_later=f.healed_at is not None and f.healed_at > x_max,
        )
        for f in history.faults
    ]
    labels = {f.label(): f.at for f in history.faults}
    recoveries = [
        (lane[rid], labels[label], seconds)
        for label, rid, seconds in verdict.recoveries
        if label in labels and rid in lane
    ]
    drawn = {b.kind for b in bars}
    if any(f.band_end is not None for f in faults):
        drawn.add("fault")
    if recoveries:
        drawn.add("recovery")
    return Layout(
        lanes=rids,
        bars=bars,
        chunks=chunks,
        faults=faults,
        recoveries=recoveries,
        x_max=x_max,
        legend=[k for k in _LEGEND if k in drawn],
    )


def draw(history: History, verdict: RunVerdict, path: Path, *, title: str) -> Path:
    import matplotlib  # noqa: PLC0415 - heavy; only the chaos tool draws

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    from matplotlib.lines import Line2D  # noqa: PLC0415
    from matplotlib.patches import Patch  # noqa: PLC0415

    plan = layout(history, verdict)
    n = len(plan.lanes)
    height = max(3.0, 0.28 * n + 1.8)
    fig, ax = plt.subplots(figsize=(12, height), dpi=100)
    for lane, t in plan.chunks:  # above the bar, thin and light: the bar stays visible
        ax.plot([t, t], [lane + 0.12, lane + 0.32], color="#90a4ae", lw=0.4, zorder=2)
    for b in plan.bars:
        ax.plot([b.start, b.end], [b.lane, b.lane], color=_COLOURS[b.kind], lw=3,
                solid_capstyle="butt", zorder=3)  # fmt: skip
    for i, f in enumerate(plan.faults):
        ax.axvline(f.at, color=_FAULT, ls="--", lw=1, zorder=1)
        if f.band_end is not None:
            ax.axvspan(f.at, f.band_end, color=_BAND, alpha=0.35, lw=0, zorder=0)
        text = f"{f.label}" + (" (healed after the end)" if f.healed_later else "")
        ax.annotate(  # above the plot, staggered: never over the lanes or each other
            text, xy=(f.at, 1.0), xycoords=("data", "axes fraction"),
            xytext=(0, 2 + 10 * (i % 3)), textcoords="offset points",
            color=_FAULT, fontsize=8, ha="center", va="bottom",
        )  # fmt: skip
    for lane, at, seconds in plan.recoveries:
        ax.plot([at, at + seconds], [lane + 0.3] * 2, color=_RECOVERY, lw=2, zorder=4)
    handles = {
        **{k: Line2D([], [], color=c, lw=3) for k, c in _COLOURS.items()},
        "fault": Patch(color=_BAND, alpha=0.6),
        "recovery": Line2D([], [], color=_RECOVERY, lw=2),
    }
    ax.legend(
        [handles[k] for k in plan.legend], [_LEGEND[k] for k in plan.legend],
        loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False,
    )  # fmt: skip
    ax.set_yticks(range(n))
    ax.set_yticklabels([rid.rsplit("-", 1)[-1] for rid in plan.lanes], fontsize=7)
    ax.set_ylim(-1, n)
    ax.set_xlim(0, plan.x_max)
    ax.set_xlabel("seconds since the workload started")
    ax.set_ylabel("request (workload index)")
    ax.set_title(
        f"{title}: lost {sum(r.lost for r in verdict.requests)}, "
        f"duplicates {sum(r.duplicates for r in verdict.requests)}, "
        f"gaps {sum(r.gaps for r in verdict.requests)}",
        fontsize=9,
        pad=14 + 10 * min(len(plan.faults), 3),
    )
    fig.tight_layout()
    fig.savefig(path, bbox_inches="tight")  # the legend beside the axes included
    plt.close(fig)
    return path
