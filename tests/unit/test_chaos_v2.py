"""Chaos tool v2 (issue 18): the KV fault injector's faults, phase and load triggers, honest
fault reports, and scenario files that pass flags and are checked against the model.

The executor runs against in-memory stand-ins for the store and the cluster's processes (as
in `test_chaos_trigger`); the workers' side of the gate (announcing a held layer) is a file
the test writes, as `pdorch worker`'s injector does.
"""

from __future__ import annotations

import ast
import asyncio
import os
import signal
import subprocess
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from orchestrator.chaos import scenario as sc
from orchestrator.chaos.checker import RunVerdict, Summary, check_run
from orchestrator.chaos.faults import FaultExecutor
from orchestrator.chaos.history import History, Op, RequestSpec
from orchestrator.chaos.pace import LoopPace
from orchestrator.chaos.runner import cluster_for
from orchestrator.core.records import RequestRecord
from orchestrator.core.state import State
from transport import errors
from transport.testing import FaultInjector

# ----------------------------------------------------------------------------- the injector


@dataclass
class _Sender:
    payload_hook: Any = None
    delay_hook: Any = None


def _layer(injector: FaultInjector, index: int, nbytes: int = 1000) -> float:
    """Send one layer of ``nbytes`` (K and V halves) through the hooks, as `KvSender` does:
    the payload hook, then the delay hook; returns the seconds the layer is held."""
    sender = _Sender()
    injector.attach(sender)  # type: ignore[arg-type]
    half = memoryview(bytearray(nbytes // 2))
    sender.payload_hook(index, half, half)
    return float(sender.delay_hook(index))


def test_bandwidth_paces_every_layer_to_its_rate() -> None:
    injector = FaultInjector(bytes_per_s=10_000)
    assert [_layer(injector, i, 1000) for i in range(4)] == [0.1] * 4
    assert _layer(injector, 0, 5000) == 0.5


def test_delay_holds_every_layer_not_just_one() -> None:
    injector = FaultInjector.parse("lag=0.25")
    assert [_layer(injector, i) for i in range(4)] == [0.25] * 4


def test_drop_fails_every_layer_send_while_armed() -> None:
    injector = FaultInjector.parse("drop=1")
    for index in (0, 3):
        with pytest.raises(errors.PeerLostError, match="link is down"):
            _layer(injector, index)
    injector.armed = False
    assert _layer(injector, 0) == 0.0


def test_the_gate_holds_its_layer_and_announces_it() -> None:
    announced: list[int] = []
    injector = FaultInjector.parse("hold_layer=2,hold=1.5")
    injector.on_hold = announced.append
    assert [_layer(injector, i) for i in range(4)] == [0.0, 0.0, 1.5, 0.0]
    assert announced == [2]


def test_configure_switches_off_what_the_new_spec_lacks() -> None:
    injector = FaultInjector.parse("lag=0.1,bw=100,drop=1,hold_layer=1,hold=2")
    injector.configure(FaultInjector.parse("layer=1,corrupt=7,p=1"))
    assert (injector.lag_s, injector.bytes_per_s, injector.drop, injector.hold_s) == (0, 0, 0, 0)
    assert injector.corrupt_offset == 7


@pytest.mark.parametrize("spec", ["bw=-1", "lag=nan", "p=2", "hold=x", "speed=1"])
def test_bad_fault_specs_are_refused(spec: str) -> None:
    with pytest.raises(ValueError, match="fault spec"):
        FaultInjector.parse(spec)


# ----------------------------------------------------------------------------- scenarios


def _parse(fault: dict[str, Any], **more: Any) -> sc.Scenario:
    return sc.parse({"faults": [fault], **more}, "s.yaml")


KILL_DECODE = {"at": 1, "kind": "kill", "target": "decode:busiest"}


def test_phase_and_load_triggers_are_parsed() -> None:
    s = _parse({**KILL_DECODE, "when": {"state": "sending", "layer": 2}})
    assert s.faults[0].when == sc.Trigger(state="sending", layer=2)
    s = _parse({"at": 1, "kind": "restart", "target": "redis", "when": {"streams": 6}})
    assert s.faults[0].when == sc.Trigger(streams=6)


@pytest.mark.parametrize(
    ("when", "message"),
    [
        ({}, "give a state, streams, or both"),
        ({"state": "decoding", "layer": 2}, "only for state sending"),
        ({"streams": 2, "tokens": 3}, "need a state"),
        ({"state": "sending", "layer": -1}, "when.layer"),
    ],
)
def test_bad_triggers_are_refused(when: dict[str, Any], message: str) -> None:
    with pytest.raises(sc.ScenarioError, match=message):
        _parse({**KILL_DECODE, "when": when})


def test_the_sending_gate_needs_the_reference_engine() -> None:
    vllm = {"engine": "vllm", "model": "smollm2"}
    with pytest.raises(sc.ScenarioError, match="sending needs engine reference"):
        _parse({**KILL_DECODE, "when": {"state": "sending"}}, cluster=vllm)


@pytest.mark.parametrize(
    ("cluster", "output", "message"),
    [
        ({}, [100, 2049], "max_tokens of 2048"),
        ({"engine": "vllm", "model": "smollm2"}, [1000, 2000], "context of 2048"),
    ],
)
def test_output_tokens_beyond_the_models_limit_are_refused_at_load(
    cluster: dict[str, str], output: list[int], message: str
) -> None:
    with pytest.raises(sc.ScenarioError, match=message):
        _parse(KILL_DECODE, cluster=cluster, workload={"output_tokens": output})
    _parse(KILL_DECODE, cluster=cluster, workload={"output_tokens": [10, 1500]})


def test_model_contexts_agree_with_the_engines() -> None:
    from orchestrator.workers.model_files import tiny_model  # noqa: PLC0415

    assert sc.MODEL_CONTEXT[("tiny", "reference")] == tiny_model().config.max_position_embeddings
    # vLLM's settings module imports vllm: read the default from its source instead
    source = Path(sc.__file__).parents[1] / "workers" / "vllm" / "engine.py"
    tree = ast.parse(source.read_text())
    (settings,) = (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "VllmSettings")
    default = next(
        n.value
        for n in settings.body
        if isinstance(n, ast.AnnAssign) and getattr(n.target, "id", "") == "max_model_len"
    )
    assert isinstance(default, ast.Constant)
    assert sc.MODEL_CONTEXT[("smollm2", "vllm")] == default.value


def test_scenarios_pass_flags_per_role_and_keep_the_cluster_up() -> None:
    cluster = {
        "prefill_flags": ["--kv-hold", "2"],
        "decode_flags": ["--metrics-port", "920{index}"],
        "orchestrator_flags": ["--metrics-port=930{index}"],
    }
    s = _parse(KILL_DECODE, cluster=cluster, keep_up_s=30)
    assert s.keep_up_s == 30.0
    local = cluster_for(s.cluster)
    assert local.worker_extra["prefill"][-2:] == ["--kv-hold", "2"]
    assert local.worker_extra["decode"][-2:] == ["--metrics-port", "920{index}"]
    args = local.worker_args("decode", 1)  # the flags the cluster sets; extra ones follow
    assert "--metrics-port" not in args
    from orchestrator.cluster import _indexed  # noqa: PLC0415

    assert _indexed(local.worker_extra["decode"], 1)[-1] == "9201"
    assert _indexed(local.orchestrator_extra, 0) == ["--metrics-port=9300"]


@pytest.mark.parametrize("flag", ["--port", "--worker-id=x", "--kv-fault-file"])
def test_flags_the_cluster_sets_itself_are_refused(flag: str) -> None:
    with pytest.raises(sc.ScenarioError, match="set by the local cluster"):
        _parse(KILL_DECODE, cluster={"decode_flags": [flag, "1"]})


def test_every_new_trigger_has_a_shipped_scenario() -> None:
    whens = [f.when for name in sc.shipped() for f in sc.load(name).faults if f.when]
    states = {(w.state, w.layer) for w in whens}
    assert ("sending", 2) in states
    assert any(w.state == "transferring" for w in whens)
    assert any(w.streams and not w.state for w in whens)


# ----------------------------------------------------------------------------- executor


class _Running:
    pid = os.getpid()

    def poll(self) -> None:
        return None

    def wait(self, timeout: float) -> int:
        raise subprocess.TimeoutExpired("worker", timeout)


@dataclass
class _Proc:
    popen: Any = field(default_factory=_Running)
    signals: list[int] = field(default_factory=list)

    def signal(self, sig: int) -> None:
        self.signals.append(sig)


@dataclass
class _Cluster:
    procs: dict[str, _Proc] = field(default_factory=dict)


class _Store:
    def __init__(self, records: dict[str, RequestRecord]) -> None:
        self.records = records

    async def get(self, rid: str) -> RequestRecord | None:
        return self.records.get(rid)


def _record(rid: str, state: State, prefill: str, decode: str) -> RequestRecord:
    return RequestRecord(rid, state, 1, "h", 4, 16, 0.0, owner="orchestrator-0",
                         prefill_worker=prefill, decode_worker=decode)  # fmt: skip


def _executor(
    records: dict[str, RequestRecord],
    *,
    now: float = 1.0,
    kv_file: Path | None = None,
    kv_injector: bool = False,
) -> FaultExecutor:
    history = History(run=0, seed=0)
    for rid in records:
        history.requests[rid] = RequestSpec(rid, 0, 16)
        history.add(Op(0.0, "invoke", rid, 1))
    names = ("prefill-0", "prefill-1", "decode-0", "decode-1", "redis")
    return FaultExecutor(
        _Cluster({n: _Proc() for n in names}),  # type: ignore[arg-type]
        _Store(records),  # type: ignore[arg-type]
        history,
        {},
        kv_injector=kv_injector,
        now=lambda: now,
        seed=0,
        kv_file=kv_file,
    )


def _fault(kind: str, target: str, when: sc.Trigger | None = None, **kw: Any) -> sc.PlannedFault:
    return sc.PlannedFault(kw.pop("at", 1.0), kind, target, kw.pop("heal_after", None),
                           kw.pop("params", {}), when=when)  # fmt: skip


def test_a_streams_trigger_waits_for_that_many_active_streams() -> None:
    ex = _executor({})
    for i, rid in enumerate(("a", "b", "c")):
        ex.history.add(Op(0.1, "invoke", rid, 1))
        ex.history.add(Op(0.2, "chunk", rid, 1, index=0, tokens=(i,)))
    ex.history.add(Op(0.3, "ok", "c", 1, code="stop"))
    record = asyncio.run(ex.inject(_fault("continue", "redis", sc.Trigger(streams=2))))
    assert (record.error, record.trigger) == ("", "2 streams active")
    three = sc.Trigger(streams=3, within_s=0.2)
    record = asyncio.run(ex.inject(_fault("continue", "redis", three)))
    assert record.error == "trigger not met within 0.2s: fewer than 3 streams active"


@pytest.mark.parametrize(("role", "expected"), [("prefill", "prefill-1"), ("decode", "decode-0")])
def test_a_sending_trigger_holds_transfers_and_hits_the_held_ones_worker(
    tmp_path: Path, role: str, expected: str
) -> None:
    kv_file = tmp_path / "kv-fault"
    records = {"r": _record("r", State.PREFILLING, "prefill-1", "decode-0")}
    ex = _executor(records, kv_file=kv_file)
    specs: list[str] = []

    def worker_holds_a_layer() -> None:
        """The prefill worker's side: its injector re-reads the file, then holds a layer."""
        deadline = time.monotonic() + 5
        while not kv_file.exists() and time.monotonic() < deadline:  # the runner arms first
            time.sleep(0.01)
        specs.append(kv_file.read_text())
        Path(f"{kv_file}.held.prefill-1").write_text(f"{time.time()} 2")

    async def main() -> Any:
        holder = asyncio.create_task(asyncio.to_thread(worker_holds_a_layer))
        when = sc.Trigger(state="sending", layer=2, within_s=5.0)
        record = await ex.inject(_fault("continue", f"{role}:busiest", when))
        await holder
        await ex.cancel()
        return record

    record = asyncio.run(main())
    assert specs == [f"hold_layer=2,hold={sc.GATE_HOLD_S:g},seed=7,armed=1"]
    assert kv_file.read_text() == "seed=7,armed=0"  # the gate opened after the fault
    assert not record.error
    assert record.resolved == expected
    assert record.affected == ("r",)
    assert record.trigger.endswith(" sending prefill-1 -> layer 2 held")
    if role == "decode":  # the receiver was read from the request's record: it is named
        assert record.trigger.startswith("r ")


def test_kv_faults_through_the_injector_heal_one_by_one(tmp_path: Path) -> None:
    kv_file = tmp_path / "kv-fault"
    ex = _executor({}, kv_file=kv_file, kv_injector=True)

    async def main() -> None:
        delay = _fault("delay", "link:kv", heal_after=0.05, params={"delay_ms": 100.0})
        corrupt = _fault("corrupt", "link:kv", params={"probability": 0.5})
        await ex.inject(delay)
        await ex.inject(corrupt)
        assert kv_file.read_text() == "lag=0.1,layer=1,corrupt=4099,p=0.5,seed=7,armed=1"
        await ex.settle()
        assert kv_file.read_text() == "layer=1,corrupt=4099,p=0.5,seed=7,armed=1"
        await ex.cancel()

    asyncio.run(main())
    assert ex.cluster.procs["prefill-0"].signals.count(10) == 3  # SIGUSR1: re-read, each time


def _verdict(history: History) -> RunVerdict:
    return check_run(history, {}, {})


def test_a_fault_executed_late_is_recorded_so_and_fails_the_verdict() -> None:
    ex = _executor({}, now=1.8)
    record = asyncio.run(ex.inject(_fault("continue", "prefill:prefill-0", at=1.0)))
    assert (record.planned_at, record.at, record.late_s, record.late) == (1.0, 1.8, 0.8, True)
    summary = Summary("s", [_verdict(ex.history)])
    assert summary.violations([]) == ["late_faults=1"]
    assert "executed 800 ms after it was due" in summary.human()
    assert "1 faults (at most 800 ms late)" in summary.human()


def test_the_report_says_how_late_the_latest_fault_ran_late_or_not() -> None:
    on_time = _executor({}, now=1.3)
    asyncio.run(on_time.inject(_fault("continue", "prefill:prefill-0", at=1.0)))
    late = _executor({}, now=2.2)
    asyncio.run(late.inject(_fault("continue", "prefill:prefill-0", at=1.0)))
    runs = [_verdict(on_time.history), _verdict(late.history)]
    assert [run.late_max_s for run in runs] == [pytest.approx(0.3), pytest.approx(1.2)]
    assert Summary("s", runs[:1]).to_json()["late_max_s"] == pytest.approx(0.3)
    assert Summary("s", runs[:1]).violations([]) == []  # within the bound: reported only
    assert Summary("s", runs).to_json()["late_max_s"] == pytest.approx(1.2)
    assert Summary("s", []).to_json()["late_max_s"] == 0.0


@pytest.mark.parametrize(
    ("cpu_used", "said"),
    [
        (0.05, "used 6% of a core meanwhile: the machine did not run the runner"),
        (0.425, "used 50% of a core meanwhile: the runner was busy"),  # the boundary
        (0.7, "used 82% of a core meanwhile: the runner was busy"),
    ],
)
def test_a_late_fault_says_whether_the_runner_was_busy_or_not_run(
    cpu_used: float, said: str
) -> None:
    ex = _executor({}, now=1.8)
    clock, cpu = iter([0.95, 1.8]), iter([10.0, 10.0 + cpu_used])
    ex.pace = LoopPace(lambda: next(clock), cpu=lambda: next(cpu))
    ex.pace.sample()  # the loop's last sample before the fault was due (1.0 s)
    record = asyncio.run(ex.inject(_fault("continue", "prefill:prefill-0", at=1.0)))
    assert record.late_cpu_share == pytest.approx(cpu_used / 0.85, abs=1e-3)
    human = Summary("s", [_verdict(ex.history)]).human()
    assert f"800 ms after it was due (the runner's process {said})" in human


def test_a_late_fault_looks_back_from_when_it_was_due_not_when_it_ran() -> None:
    """Samples at 0.5, 0.9 and 1.5 s; the fault was due at 1.0 and ran at 1.8: the share is
    taken from the 0.9 s sample (CPU 3.0 -> 3.45 over 0.9 s), not the 1.5 s one."""
    ex = _executor({}, now=1.8)
    clock = iter([0.5, 0.9, 1.5, 1.8])
    cpu = iter([2.0, 3.0, 3.4, 3.45])
    ex.pace = LoopPace(lambda: next(clock), cpu=lambda: next(cpu))
    for _ in range(3):
        ex.pace.sample()
    record = asyncio.run(ex.inject(_fault("continue", "prefill:prefill-0", at=1.0)))
    assert record.late_cpu_share == 0.5


def test_the_loop_pace_looks_back_to_the_last_sample_before_a_time() -> None:
    clock = iter([1.0, 2.0, 3.0, 4.0, 4.0, 4.0])
    cpu = iter([5.0, 5.5, 6.0, 6.25, 6.25, 6.25])
    pace = LoopPace(lambda: next(clock), cpu=lambda: next(cpu))
    assert pace.cpu_share(1.0) is None  # no sample yet
    for _ in range(3):
        pace.sample()  # (1.0, 5.0) (2.0, 5.5) (3.0, 6.0)
    assert pace.cpu_share(0.5) is None  # older than every sample
    assert pace.cpu_share(2.5) == 0.375  # from the sample at 2.0 s: 0.75 s of CPU in 2 s
    assert pace.cpu_share(3.0) == 0.25


def test_the_loop_pace_samples_on_the_running_loop_until_stopped() -> None:
    async def main() -> int:
        loop = asyncio.get_running_loop()
        pace = LoopPace(loop.time, every_s=0.01)
        pace.start()
        assert pace.cpu_share(loop.time()) is not None  # a first sample at once
        task = pace._task
        pace.start()  # a second start: the same task
        assert pace._task is task
        await asyncio.sleep(0.1)
        await pace.stop()
        assert task is not None
        assert task.done()
        assert pace._task is None
        n = len(pace._samples)
        await asyncio.sleep(0.05)
        assert len(pace._samples) == n  # stopped
        return n

    assert asyncio.run(main()) >= 3


def test_the_executor_runs_its_sampler_from_start_to_cancel_whatever_the_watcher_did() -> None:
    async def main() -> None:
        ex = _executor({})
        ex.start()
        sampler = ex.pace._task
        assert sampler is not None
        assert not sampler.done()
        await asyncio.sleep(0.01)

        async def failed() -> None:
            raise RuntimeError("the store went away")

        watcher = ex.watcher._task
        assert watcher is not None
        watcher.cancel()
        ex.watcher._task = asyncio.create_task(failed())
        await asyncio.sleep(0)
        with pytest.raises(RuntimeError, match="the store went away"):
            await ex.cancel()
        assert sampler.done()
        assert ex.pace._task is None

    asyncio.run(main())


def test_a_kill_whose_process_is_not_reaped_fails_the_verdict() -> None:
    ex = _executor({})
    record = asyncio.run(ex.inject(_fault("kill", "decode:decode-1")))
    assert "not reaped within 10 s of SIGKILL" in record.error
    verdict = _verdict(ex.history)
    assert not verdict.clean
    assert Summary("s", [verdict]).violations([]) == ["fault_errors=1"]
    assert verdict.errors == Counter()


def test_a_stream_that_ended_before_the_fault_is_not_counted_as_hit() -> None:
    records = {
        rid: _record(rid, State.DECODING, "prefill-0", "decode-1") for rid in ("done", "live")
    }
    ex = _executor(records, now=2.0)  # the reading still shows "done" decoding
    ex.history.add(Op(1.9, "ok", "done", 1, code="stop"))
    record = asyncio.run(ex.inject(_fault("continue", "decode:decode-1", at=2.0)))
    assert record.affected == ("live",)


def test_a_sending_trigger_without_the_workers_injector_is_reported_not_fatal() -> None:
    ex = _executor({})  # kv_file None: workers without the injector (vLLM)
    when = sc.Trigger(state="sending", within_s=0.2)
    record = asyncio.run(ex.inject(_fault("kill", "prefill:busiest", when)))
    assert record.error.startswith("trigger failed: PdorchError")
    assert record.resolved == ""


# ----------------------------------------------------------------------------- healing


class _Killable:
    """A process that dies of the SIGKILL the executor sends."""

    pid = os.getpid()

    def __init__(self) -> None:
        self.code: int | None = None

    def poll(self) -> int | None:
        return self.code

    def wait(self, timeout: float) -> int:
        self.code = -9
        return self.code


@dataclass
class _Restarting(_Cluster):
    """Starts a worker again; its registration, waited for by the heal, fails or is held."""

    ready_timeout_s: float = 1.0
    fail: bool = False
    release: Any = None
    starting: Any = None

    def start_worker(self, role: str, index: int) -> None:
        self.procs[f"{role}-{index}"] = _Proc(popen=_Killable())
        if self.starting is not None:
            self.starting.set()

    def wait_registered(self, names: list[str], timeout_s: float) -> None:
        from orchestrator.cluster import ClusterError  # noqa: PLC0415

        if self.fail:  # e.g. the new process died (of a later fault's SIGKILL) while starting
            raise ClusterError(f"{names[0]} exited with -9 before registering")
        self.release.wait(5)


def _healing(cluster: _Restarting) -> FaultExecutor:
    names = ("decode-0", "decode-1")
    cluster.procs.update({n: _Proc(popen=_Killable()) for n in names})
    return FaultExecutor(
        cluster,  # type: ignore[arg-type]
        _Store({}),  # type: ignore[arg-type]
        History(run=0, seed=0),
        {},
        kv_injector=False,
        now=time.monotonic,
        seed=0,
    )


def test_a_heal_that_fails_is_recorded_and_fails_the_verdict() -> None:
    """A restart whose process never registers again is not healed: the fault says why and
    the run is not clean (it did not carry out its plan) — before, the heal's error was an
    unretrieved task exception and the run passed."""
    ex = _healing(_Restarting(fail=True))

    async def main() -> Any:
        record = await ex.inject(_fault("restart", "decode:decode-0", heal_after=0.0))
        await ex.settle()
        return record

    record = asyncio.run(main())
    assert record.healed_at is None
    assert record.error.startswith("heal failed: ClusterError: decode-0 exited with -9")
    verdict = _verdict(ex.history)
    assert verdict.fault_errors == 1
    assert not verdict.clean


def test_a_process_being_started_again_is_not_a_target() -> None:
    """While a heal starts decode-0 again, a fault picking a decode worker takes another
    (a signal mid-start would kill it before it serves, and fail the heal); one naming it,
    or its pool, is not injected and says why (the run did not carry out its plan)."""
    import threading  # noqa: PLC0415

    cluster = _Restarting(release=threading.Event(), starting=threading.Event())
    ex = _healing(cluster)

    async def main() -> list[Any]:
        first = await ex.inject(_fault("restart", "decode:decode-0", heal_after=0.0))
        await asyncio.to_thread(cluster.starting.wait, 5)  # the heal is starting decode-0
        picks = [await ex.inject(_fault("continue", f"decode:{s}")) for s in ("busiest", "random")]
        named = await ex.inject(_fault("continue", "decode:decode-0"))
        pool = await ex.inject(_fault("stop", "pool:decode"))
        cluster.release.set()
        await ex.settle()
        return [first, *picks, named, pool]

    first, busiest, random_pick, named, pool = asyncio.run(main())
    assert first.healed_at is not None
    assert not first.error
    assert busiest.resolved == random_pick.resolved == "decode-1"
    for refused in (named, pool):
        assert "decode-0 being started again by an earlier fault's heal" in refused.error
    # decode-1: the two picks' SIGCONT, and no SIGSTOP (the pool fault signalled none)
    assert ex.cluster.procs["decode-1"].signals == [signal.SIGCONT, signal.SIGCONT]
    assert _verdict(ex.history).fault_errors == 2


def test_chaos_run_late_bound_replaces_the_scenarios(monkeypatch: pytest.MonkeyPatch) -> None:
    from orchestrator.chaos import runner  # noqa: PLC0415
    from orchestrator.cli import main  # noqa: PLC0415

    bounds: list[float] = []
    monkeypatch.setattr(
        runner, "run_chaos", lambda scenario, **_: bounds.append(scenario.late_bound_s) or 0
    )
    assert main(["chaos", "run", "kv-link-tcp", "--late-bound", "2.5", "--json"]) == 0
    assert main(["chaos", "run", "kv-link-tcp", "--json"]) == 0
    assert bounds == [2.5, sc.load("kv-link-tcp").late_bound_s] == [2.5, 0.5]
