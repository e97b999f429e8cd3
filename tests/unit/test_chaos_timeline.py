"""The chaos timeline's layout (`orchestrator.chaos.timeline.layout`): the x-axis spans the
workload, a fault healed after it is cut at the edge, the legend lists only what is drawn;
and `draw` writes a PNG."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from orchestrator.chaos.checker import RunVerdict
from orchestrator.chaos.history import FaultRecord, History, Op, RequestSpec
from orchestrator.chaos.timeline import Bar, draw, layout


def _history(healed_at: float | None) -> History:
    h = History(run=0, seed=0, end=30.0)
    for i in range(2):
        rid = f"r-{i}"
        h.requests[rid] = RequestSpec(rid, i, 8)
    h.add(Op(0.0, "invoke", "r-0"))
    h.add(Op(0.5, "chunk", "r-0", index=0))
    h.add(Op(1.0, "invoke", "r-1"))
    h.add(Op(2.0, "info", "r-0", code="UNAVAILABLE"))
    h.add(Op(2.1, "invoke", "r-0", attempt=1))
    h.add(Op(4.0, "ok", "r-0", attempt=1))
    h.add(Op(5.0, "ok", "r-1"))
    h.faults.append(FaultRecord(1.5, "kill", "decode", "decode-0", ("r-0",), healed_at=healed_at))
    return h


def _verdict() -> RunVerdict:
    return RunVerdict(0, 0, [], [("kill decode-0", "r-0", 0.9)], [], Counter(), faults=1)


def test_the_axis_spans_the_workload_not_a_late_heal() -> None:
    plan = layout(_history(healed_at=25.0), _verdict())
    assert plan.x_max == pytest.approx(5.0 * 1.03)  # not the heal at 25 s, nor history.end
    (fault,) = plan.faults
    assert fault.band_end == plan.x_max
    assert fault.healed_later
    assert plan.bars == [
        Bar(0, 0.0, 2.0, "info"), Bar(0, 2.1, 4.0, "ok"), Bar(1, 1.0, 5.0, "ok"),
    ]  # fmt: skip
    assert plan.recoveries == [(0, 1.5, 0.9)]


def test_the_legend_lists_only_what_is_drawn() -> None:
    plan = layout(_history(healed_at=3.0), _verdict())
    assert plan.legend == ["ok", "info", "fault", "recovery"]
    assert not plan.faults[0].healed_later
    unhealed = layout(_history(healed_at=None), RunVerdict(0, 0, [], [], [], Counter(), 1))
    assert unhealed.legend == ["ok", "info"]


def test_draw_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = draw(_history(healed_at=25.0), _verdict(), tmp_path / "t.png", title="kill")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
