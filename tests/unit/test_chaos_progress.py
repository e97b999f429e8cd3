"""`pdorch chaos run` reports each phase as a progress step (issue 19: no silence during long
work): cluster up, the fault-free reference, each faulted run with its checks, the stop —
and a phase that fails is reported as failed. The phases' work is replaced by stand-ins here
(the real ones start a cluster: tests/integration/test_chaos.py)."""

from __future__ import annotations

import asyncio
import io
from collections import Counter
from pathlib import Path

import pytest

from orchestrator.chaos import runner as runner_mod
from orchestrator.chaos.checker import RunVerdict
from orchestrator.chaos.history import History
from orchestrator.chaos.scenario import load, shipped
from orchestrator.cli.progress import Progress


def _runner(tmp_path: Path, stream: io.StringIO, runs: int) -> runner_mod.ChaosRunner:
    scenario = load(str(shipped()["decode-kill"]))
    return runner_mod.ChaosRunner(
        scenario, runs=runs, out_dir=tmp_path, pictures=False, steps=Progress(stream=stream).step
    )


def test_every_phase_of_a_chaos_command_is_a_progress_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stream = io.StringIO()
    r = _runner(tmp_path, stream, runs=2)
    calls: list[str] = []

    async def start() -> list[str]:
        calls.append("start")
        return ["127.0.0.1:1"]

    async def reference(addresses: list[str], plans: list[object]) -> dict[int, tuple[int, ...]]:
        calls.append("reference")
        return {}

    async def one(index: int, *args: object) -> tuple[RunVerdict, History]:
        calls.append(f"run{index}")
        verdict = RunVerdict(index, index, [], [], [], Counter(), faults=0)
        return verdict, History(run=index, seed=index)

    async def nothing() -> None:
        calls.append("restore/close")

    monkeypatch.setattr(r, "_start", start)
    monkeypatch.setattr(r, "_reference", reference)
    monkeypatch.setattr(r, "_one", one)
    monkeypatch.setattr(r, "_restore", nothing)
    monkeypatch.setattr(r, "_close", nothing)
    monkeypatch.setattr(r, "_save", lambda *a: None)
    asyncio.run(r.run())
    lines = stream.getvalue().splitlines()
    done = [line for line in lines if ": done in " in line]
    assert [line.split(": done in ")[0] for line in done] == [
        "decode-kill: cluster up (starting)",
        f"decode-kill: reference run, {_n(r)} requests without faults",
        f"decode-kill: run 1/2, {_n(r)} requests under faults, then checks",
        f"decode-kill: run 2/2, {_n(r)} requests under faults, then checks",
        "decode-kill: stopping the cluster",
    ]
    assert calls == ["start", "reference", "run0", "restore/close", "run1", "restore/close"]


def _n(r: runner_mod.ChaosRunner) -> int:
    return len(runner_mod.make_requests(r.scenario.workload, r.seed))


def test_a_phase_that_fails_is_reported_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stream = io.StringIO()
    r = _runner(tmp_path, stream, runs=1)

    async def start() -> list[str]:
        raise runner_mod.ScenarioError("no cluster today")

    async def nothing() -> None:
        return None

    monkeypatch.setattr(r, "_start", start)
    monkeypatch.setattr(r, "_close", nothing)
    with pytest.raises(runner_mod.ScenarioError):
        asyncio.run(r.run())
    text = stream.getvalue()
    assert "decode-kill: cluster up (starting): FAILED in" in text
    assert "decode-kill: stopping the cluster: done in" in text
