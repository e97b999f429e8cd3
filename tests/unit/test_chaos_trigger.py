"""Phase-triggered worker faults (`FaultExecutor` with a scenario's ``when``): which request
fires the trigger, which worker the fault is then aimed at, and a trigger never met.

The executor reads request records through ``store.get`` and the cluster's processes through
``procs``; both are small in-memory stand-ins here (no processes are signalled: the faults
used are ``continue``, a no-op for a running process, on workers whose "process" is this one).
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field
from typing import Any

import pytest

from orchestrator.chaos import scenario as sc
from orchestrator.chaos.faults import FaultExecutor
from orchestrator.chaos.history import History, Op, RequestSpec
from orchestrator.core.records import RequestRecord
from orchestrator.core.state import State


class _Running:
    pid = os.getpid()

    def poll(self) -> None:
        return None


class _Dead:
    pid = 0

    def poll(self) -> int:
        return -9


@dataclass
class _Proc:
    popen: Any

    def signal(self, sig: int) -> None:
        pass


@dataclass
class _Cluster:
    procs: dict[str, _Proc] = field(default_factory=dict)


class _Store:
    """Records that change as the polls read them: ``script[rid]`` is the record's state per
    poll round (the last one repeats)."""

    def __init__(self, script: dict[str, list[tuple[State, str, int]]]) -> None:
        self.script = script
        self.reads: dict[str, int] = {}

    async def get(self, rid: str) -> RequestRecord | None:
        steps = self.script.get(rid)
        if not steps:
            return None
        n = self.reads.get(rid, 0)
        self.reads[rid] = n + 1
        state, worker, tokens = steps[min(n, len(steps) - 1)]
        return RequestRecord(
            rid, state, 1, "h", 4, 16, 0.0, owner="orchestrator-0",
            prefill_worker=worker if state == State.PREFILLING else "p",
            decode_worker=worker if state != State.PREFILLING else "",
            output_tokens=tokens,
        )  # fmt: skip


def _executor(script: dict[str, list[tuple[State, str, int]]], dead: set[str]) -> FaultExecutor:
    history = History(run=0, seed=0)
    for rid in script:
        history.requests[rid] = RequestSpec(rid, 0, 16)
        history.add(Op(0.0, "invoke", rid, 1))
    names = ("prefill-0", "prefill-1", "decode-0", "decode-1")
    cluster = _Cluster({n: _Proc(_Dead() if n in dead else _Running()) for n in names})
    return FaultExecutor(
        cluster,  # type: ignore[arg-type]
        _Store(script),  # type: ignore[arg-type]
        history,
        {},
        kv_injector=False,
        now=lambda: 1.0,
        seed=0,
    )


def _fault(target: str, when: sc.Trigger) -> sc.PlannedFault:
    return sc.PlannedFault(0.0, "continue", target, None, {}, when=when)


def test_the_trigger_waits_for_the_phase_and_aims_at_that_requests_worker() -> None:
    script = {
        # on a dead worker: never the target
        "a": [(State.DECODING, "decode-0", 9)],
        # decoding on decode-1, but only from the third poll with enough tokens
        "b": [
            (State.PREFILLING, "prefill-0", 0),
            (State.DECODING, "decode-1", 1),
            (State.DECODING, "decode-1", 3),
        ],
    }
    ex = _executor(script, dead={"decode-0"})
    when = sc.Trigger(state="decoding", tokens=3, within_s=5.0)
    record = asyncio.run(ex.inject(_fault("decode:busiest", when)))
    assert not record.error
    assert record.resolved == "decode-1"
    assert record.affected == ("b",)
    assert record.trigger == "b decoding on decode-1 (3 tokens)"


def test_after_s_fires_only_once_the_request_stayed_in_the_phase() -> None:
    script = {"p": [(State.PREFILLING, "prefill-1", 0)]}
    ex = _executor(script, dead=set())
    when = sc.Trigger(state="prefilling", after_s=0.3, within_s=5.0)
    started = asyncio.run(_timed(ex, _fault("prefill:busiest", when)))
    assert started >= 0.3
    assert ex.history.faults[-1].resolved == "prefill-1"


async def _timed(ex: FaultExecutor, fault: sc.PlannedFault) -> float:
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    await ex.inject(fault)
    return loop.time() - t0


def test_a_named_target_must_be_the_triggering_requests_worker() -> None:
    script = {"x": [(State.DECODING, "decode-0", 5)]}
    ex = _executor(script, dead=set())
    when = sc.Trigger(state="decoding", within_s=0.3)
    record = asyncio.run(ex.inject(_fault("decode:decode-1", when)))
    assert record.error.startswith("trigger not met within 0.3s")
    assert record.resolved == ""
    assert ex.history.faults == [record]  # reported, not injected


@pytest.mark.parametrize(
    ("when", "target", "message"),
    [
        ({"state": "decoding"}, "prefill:busiest", "when.state"),
        ({"state": "prefilling"}, "redis", "only prefill and decode"),
        ({"state": "decoding", "tokens": -1}, "decode:busiest", "when.tokens"),
        ({"state": "decoding", "soon": True}, "decode:busiest", "unknown field"),
    ],
)
def test_bad_triggers_name_the_field(when: dict[str, object], target: str, message: str) -> None:
    data = {"faults": [{"at": 1, "kind": "kill", "target": target, "when": when}]}
    with pytest.raises(sc.ScenarioError, match=message):
        sc.parse(data, "s.yaml")


def test_a_trigger_is_parsed_into_the_plan() -> None:
    when = {"state": "prefilling", "after_s": 2, "within_s": 60}
    data = {"faults": [{"at": 1, "kind": "kill", "target": "prefill:busiest", "when": when}]}
    (planned,) = sc.plan(sc.parse(data), 0)
    assert planned.when == sc.Trigger(state="prefilling", after_s=2.0, within_s=60.0)
